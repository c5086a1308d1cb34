"""Image classification from a folder of JPEGs, as a team would write it: torchvision's
ImageFolder with v2 augmentation, and a small CNN trained on the CPU.

Point it at your data with ``IMAGE_FOLDER=/path/to/root`` (``root/<class>/<image>``); unset, it
uses stand-in photos generated once into a cache (``EXAMPLE_IMAGES`` of them; standin_data.py).

    python examples/image_folder.py                      # a few training steps
    fastmm-bench --dataset examples/image_folder.py:dataset \\
                 --step examples/image_folder.py:train_step --batch-size 32 --num-workers 2 --out DIR
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn
from torchvision import datasets
from torchvision.transforms import v2

# standin_data.py sits next to this file, which may be loaded by path rather than run.
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import standin_data  # noqa: E402

SIZE = 128
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's


def data_root() -> str:
    return os.environ.get("IMAGE_FOLDER") or standin_data.image_folder()


def dataset() -> datasets.ImageFolder:
    """(image, label) samples: a float32 [3, SIZE, SIZE] tensor, normalised, and the class index."""
    transform = v2.Compose([
        v2.RandomResizedCrop(SIZE),
        v2.RandomHorizontalFlip(),
        v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
    ])
    return datasets.ImageFolder(data_root(), transform=transform)


def small_cnn(num_classes: int) -> nn.Module:
    """Four strided conv blocks and a linear head. Widths sized so that a step of 32 images
    takes about as long as one loader worker takes to make the batch (about 0.075 s on one
    core): neither the loader nor the step is trivially the bottleneck."""

    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    return nn.Sequential(*block(3, 16), *block(16, 32), *block(32, 96), *block(96, 192),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(192, num_classes))


_trainer = None  # (model, optimizer): built on the first step, so workers importing this stay light


def trainer() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer, built once with their own seed (the caller's RNG untouched,
    so the loader's seeds do not depend on whether the model exists yet).

    The step runs on one thread: the loader's workers take the other cores, and intra-op
    threads competing with them for a core made the loop 3-4x slower on a 2-core machine."""
    global _trainer
    if _trainer is None:
        torch.set_num_threads(1)
        num_classes = len(datasets.folder.find_classes(data_root())[0])
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = small_cnn(num_classes)
        _trainer = model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return _trainer


def train_step(batch) -> float:
    """One SGD step on a batch of (images, labels); returns the loss."""
    images, labels = batch
    model, optimizer = trainer()
    model.train()
    loss = nn.functional.cross_entropy(model(images), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


if __name__ == "__main__":
    import fastmm  # the one-import change: was torch.utils.data.DataLoader

    loader = fastmm.DataLoader(dataset(), batch_size=32, shuffle=True, num_workers=2)
    start = time.perf_counter()
    for step, batch in enumerate(loader):
        print(f"step {step}: loss {train_step(batch):.3f} ({time.perf_counter() - start:.2f} s)")
        if step == 9:
            break
