"""The benchmark's datasets and the training-loop stand-in that consumes each batch.

Both datasets are ordinary map-style ``torch.utils.data.Dataset`` classes, defined at module
level so that any start method can pickle them, and used unchanged by both loaders.
"""

from __future__ import annotations

import zlib
from typing import Literal

import torch
from torch.utils.data import Dataset

ClipMode = Literal["clone", "view"]

VIRTUAL_LENGTH = 1 << 40  # "endless": the harness stops on time, never by running out


class ClipBankDataset(Dataset):
    """Transport-heavy samples: uint8 clips (default 16x3x224x224, 2.4 MB) taken from a small
    bank of K random clips preallocated in the main process, sample ``i`` = clip ``i % K``.

    ``mode="clone"`` (the default) returns a fresh copy, the way a real decoder hands out new
    memory for every sample; ``mode="view"`` returns the bank's own tensor (no per-sample copy,
    so collation is the only copy in the worker).
    """

    def __init__(self, shape: tuple[int, ...], bank_size: int = 8, mode: ClipMode = "clone",
                 length: int = VIRTUAL_LENGTH, seed: int = 0):
        if mode not in ("clone", "view"):
            raise ValueError(f"mode must be 'clone' or 'view', got {mode!r}")
        generator = torch.Generator().manual_seed(seed)
        self.bank = torch.randint(0, 256, (bank_size, *shape), dtype=torch.uint8, generator=generator)
        self.mode = mode
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        clip = self.bank[index % len(self.bank)]
        return clip.clone() if self.mode == "clone" else clip

    @property
    def sample_bytes(self) -> int:
        return self.bank[0].numel()


def image_transform(crop: int = 224):
    """The typical ImageNet-style training augmentation, on PIL images, ending in a plain
    uint8 CHW tensor (``PILToTensor``: no float conversion, no tv_tensors subclass)."""
    from torchvision.transforms import v2

    return v2.Compose(
        [
            v2.RandomResizedCrop(crop, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.PILToTensor(),
        ]
    )


class JpegFolderDataset(Dataset):
    """Decode-heavy samples, written the way a typical user writes them: open the JPEG with
    PIL, convert to RGB, apply the torchvision v2 transform. Sample ``i`` is file
    ``i % len(files)`` (sequential order; the files sit in the page cache after the warm-up)."""

    def __init__(self, files, crop: int = 224, length: int = VIRTUAL_LENGTH):
        self.files = list(files)
        self.transform = image_transform(crop)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        from PIL import Image

        with Image.open(self.files[index % len(self.files)]) as image:
            rgb = image.convert("RGB")
        return self.transform(rgb)


def consume(batch: torch.Tensor) -> int:
    """The training-loop stand-in: read every byte of the batch (CRC-32). zlib releases the GIL
    while it runs, so a sampler thread is not held up."""
    return zlib.crc32(batch.numpy())


def batch_nbytes(batch: torch.Tensor) -> int:
    return batch.numel() * batch.element_size()
