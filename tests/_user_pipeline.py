"""A pipeline as a user writes one, for fastmm-bench --dataset: dict samples with a string and a
label, a random augmentation drawn from torch's RNG, and a real step (a small CNN's forward,
backward and optimizer step on the CPU). Also the ways such code goes wrong."""

import os

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class Shapes(Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        image = torch.randint(0, 256, (3, 40, 40), dtype=torch.uint8, generator=g)
        if torch.rand(()) < 0.5:  # an augmentation: torch's RNG, seeded per worker
            image = image.flip(-1)
        return {"image": image, "label": i % 4, "name": f"shape-{i}"}


class Stream(IterableDataset):
    """Every worker its own share, as get_worker_info says."""

    def __iter__(self):
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if info else (0, 1)
        for i in range(start, 96, step):
            yield torch.full((8,), i, dtype=torch.int64), str(i)


def shapes():
    return Shapes()


def stream():
    return Stream()


model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(),
                            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(batch):
    loss = torch.nn.functional.cross_entropy(model(batch["image"].float() / 255), batch["label"])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def broken_step(batch):
    raise RuntimeError("the step is broken on purpose")


def multimodal():
    """fastmm's own dataset over the images in PIPELINE_IMAGES (a manifest or tree)."""
    import fastmm

    return fastmm.MultimodalDataset(os.environ["PIPELINE_IMAGES"], modality="image", size=48,
                                    decoder="pil")


def not_a_dataset():
    return [1, 2, 3].__iter__()


answer = 42
