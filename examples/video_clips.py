"""Video classification from a folder of MP4s, as a team would write it: a map-style Dataset
that decodes one short clip per sample with torchcodec, and a small per-frame CNN averaged over
time, trained on the CPU.

Point it at your data with ``VIDEO_FOLDER=/path/to/root`` (``root/<class>/<video>.mp4``); unset,
it uses stand-in H.264 videos generated once into a cache (``EXAMPLE_VIDEOS`` of them;
standin_data.py).

    python examples/video_clips.py                       # a few training steps
    fastmm-bench --dataset examples/video_clips.py:dataset \\
                 --step examples/video_clips.py:train_step --batch-size 8 --num-workers 2 --out DIR
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn
from torchcodec.decoders import VideoDecoder
from torchvision.datasets.folder import find_classes
from torchvision.transforms import v2

# standin_data.py sits next to this file, which may be loaded by path rather than run.
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import standin_data  # noqa: E402

FRAMES, STRIDE, SIZE = 8, 2, 112
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def data_root() -> str:
    return os.environ.get("VIDEO_FOLDER") or standin_data.video_folder()


class VideoClips(torch.utils.data.Dataset):
    """One clip per video: ``frames`` frames, every ``stride``-th, from a random start.

    Samples are ``{"video": uint8 [frames, 3, size, size], "label": int, "path": str}``; with
    ``size=None`` the frames keep the video's own size. The start comes from torch's RNG, so
    each loader worker draws its own, seeded as torch seeds workers.
    """

    def __init__(self, root: str, frames: int = FRAMES, stride: int = STRIDE,
                 size: int | None = SIZE):
        self.root, self.frames, self.stride = root, frames, stride
        self.classes, class_to_idx = find_classes(root)
        self.samples = [
            (os.path.join(root, cls, name), class_to_idx[cls])
            for cls in self.classes
            for name in sorted(os.listdir(os.path.join(root, cls)))
            if name.lower().endswith(".mp4")
        ]
        # Short side to `size`, then the centre square: the aspect ratio is kept.
        self.transform = v2.Compose([v2.Resize(size), v2.CenterCrop(size)]) if size else None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        path, label = self.samples[index]
        decoder = VideoDecoder(path)
        span = (self.frames - 1) * self.stride + 1
        last_start = max(0, decoder.metadata.num_frames - span)
        start = int(torch.randint(0, last_start + 1, ()))
        # A video shorter than the span repeats its last frame.
        indices = [min(start + k * self.stride, decoder.metadata.num_frames - 1)
                   for k in range(self.frames)]
        video = decoder.get_frames_at(indices).data
        if self.transform is not None:
            video = self.transform(video)
        return {"video": video, "label": label, "path": path}


def dataset() -> VideoClips:
    return VideoClips(data_root())


class FrameCNN(nn.Module):
    """A 2D CNN on every frame, its features averaged over time, then a linear head. Widths
    sized so that a step of 8 clips takes about as long as one loader worker takes to make the
    batch (under 0.1 s on one core)."""

    def __init__(self, num_classes: int):
        super().__init__()

        def block(cin, cout):
            return [nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                    nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

        self.features = nn.Sequential(*block(3, 16), *block(16, 32), *block(32, 64),
                                      *block(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(128, num_classes)
        self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1) * 255)
        self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1) * 255)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        b, t = video.shape[:2]
        frames = (video.flatten(0, 1).float() - self.mean) / self.std
        return self.head(self.features(frames).view(b, t, -1).mean(1))


_trainer = None  # (model, optimizer): built on the first step, so workers importing this stay light


def trainer() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer, built once with their own seed (the caller's RNG untouched,
    so the loader's seeds do not depend on whether the model exists yet).

    The step runs on one thread: the loader's workers take the other cores, and intra-op
    threads competing with them for a core made the loop 3-4x slower on a 2-core machine."""
    global _trainer
    if _trainer is None:
        torch.set_num_threads(1)
        num_classes = len(find_classes(data_root())[0])
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = FrameCNN(num_classes)
        _trainer = model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return _trainer


def train_step(batch: dict) -> float:
    """One SGD step on a batch of clips; returns the loss."""
    model, optimizer = trainer()
    model.train()
    loss = nn.functional.cross_entropy(model(batch["video"]), batch["label"])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


if __name__ == "__main__":
    import fastmm  # the one-import change: was torch.utils.data.DataLoader

    loader = fastmm.DataLoader(dataset(), batch_size=8, shuffle=True, num_workers=2)
    start = time.perf_counter()
    for step, batch in enumerate(loader):
        print(f"step {step}: loss {train_step(batch):.3f} ({time.perf_counter() - start:.2f} s)")
        if step == 9:
            break
