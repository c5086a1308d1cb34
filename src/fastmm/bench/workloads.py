"""The benchmark's datasets and the training-loop stand-ins that consume each batch.

Both datasets are ordinary map-style ``torch.utils.data.Dataset`` classes, defined at module
level so that any start method can pickle them, and used unchanged by both loaders.
"""

from __future__ import annotations

import time
import zlib
from typing import Callable, Literal, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

ClipMode = Literal["clone", "view", "numpy", "bytes"]

VIRTUAL_LENGTH = 1 << 40  # "endless": the harness stops on time, never by running out


class ClipBankDataset(Dataset):
    """Transport-heavy samples: uint8 clips (default 16x3x224x224, 2.4 MB) taken from a small
    bank of K random clips preallocated in the main process, sample ``i`` = clip ``i % K``.

    ``mode="clone"`` (the default) returns a fresh copy, the way a real decoder hands out new
    memory for every sample; ``mode="view"`` returns the bank's own tensor (no per-sample copy,
    so collation is the only copy in the worker); ``mode="numpy"`` returns it as a NumPy array,
    for a ``collate_fn`` that keeps batches in NumPy (``stack_numpy``); ``mode="bytes"`` returns
    its bytes as the read-only flat array ``np.frombuffer`` makes (raw file bytes for a GPU
    decoder), for a ``collate_fn`` that keeps the samples apart (``keep_list``).
    """

    def __init__(self, shape: tuple[int, ...], bank_size: int = 8, mode: ClipMode = "clone",
                 length: int = VIRTUAL_LENGTH, seed: int = 0):
        if mode not in ("clone", "view", "numpy", "bytes"):
            raise ValueError(f"mode must be 'clone', 'view', 'numpy' or 'bytes', got {mode!r}")
        generator = torch.Generator().manual_seed(seed)
        self.bank = torch.randint(0, 256, (bank_size, *shape), dtype=torch.uint8, generator=generator)
        self.mode = mode
        self.length = length
        self._blobs = [clip.numpy().tobytes() for clip in self.bank] if mode == "bytes" else None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor | np.ndarray:
        if self.mode == "bytes":
            return np.frombuffer(self._blobs[index % len(self._blobs)], dtype=np.uint8)
        clip = self.bank[index % len(self.bank)]
        if self.mode == "numpy":
            return clip.numpy()
        return clip.clone() if self.mode == "clone" else clip

    @property
    def sample_bytes(self) -> int:
        return self.bank[0].numel()


def stack_numpy(batch: list[np.ndarray]) -> np.ndarray:
    """A custom ``collate_fn`` that keeps the batch a NumPy array (as JAX-bound pipelines do)."""
    return np.stack(batch)


def keep_list(batch: list) -> list:
    """A custom ``collate_fn`` that keeps the samples apart (raw bytes for a GPU decoder,
    samples of different sizes)."""
    return list(batch)


class CaptionDataset(Dataset):
    """Batches with no pixels: sample ``i`` is a caption (about 60 characters), with
    ``labels`` also an int label, so a batch is a list of strings (and a small label tensor).
    What is left is each loader's fixed cost per batch (messages, pickling, bookkeeping), which
    image batches hide."""

    def __init__(self, labels: bool = True, length: int = VIRTUAL_LENGTH):
        self.labels = labels
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        caption = f"a photo of object number {index} on a table, seen from the left"
        return (caption, index % 1000) if self.labels else caption


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


def leaves(batch) -> list:
    """The tensors, arrays and strings of a batch (one of them, or lists, tuples and dicts of
    them; a sample's plain numbers are left out)."""
    if isinstance(batch, (torch.Tensor, np.ndarray, str)):
        return [batch]
    if isinstance(batch, dict):
        batch = batch.values()
    elif not isinstance(batch, (list, tuple)):
        return []
    return [leaf for value in batch for leaf in leaves(value)]


def _bytes(batch) -> np.ndarray:
    """The batch's bytes as a flat uint8 array (a view when the batch is one contiguous tensor;
    strings count as their UTF-8 bytes)."""
    if not isinstance(batch, (torch.Tensor, np.ndarray)):
        parts = [leaf.encode() if isinstance(leaf, str) else _bytes(leaf).tobytes()
                 for leaf in leaves(batch)]
        return np.frombuffer(b"".join(parts), dtype=np.uint8)
    array = batch.numpy() if isinstance(batch, torch.Tensor) else batch
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array.reshape(-1).view(np.uint8)


def sum64(batch) -> int:
    """Read every byte of the batch at memory speed on one thread: the sum, modulo 2**64, of its
    bytes viewed as uint64 words (``np.add.reduce``), plus the trailing ``nbytes % 8`` bytes
    added one by one; for a batch of several tensors (dicts, tuples, strings), the sum of each
    one's, read in place. Deterministic for given bytes; numpy releases the GIL while it runs."""
    if not isinstance(batch, (torch.Tensor, np.ndarray)):
        return sum(sum64(np.frombuffer(leaf.encode(), dtype=np.uint8) if isinstance(leaf, str)
                         else leaf) for leaf in leaves(batch)) & 0xFFFF_FFFF_FFFF_FFFF
    data = _bytes(batch)
    words = data.size // 8
    total = int(np.add.reduce(data[: words * 8].view(np.uint64))) if words else 0
    if data.size > words * 8:
        total += int(data[words * 8 :].sum(dtype=np.uint64))
    return total & 0xFFFF_FFFF_FFFF_FFFF


def crc32(batch: torch.Tensor) -> int:
    """Read every byte of the batch with zlib's CRC-32 (about 3 GB/s on one EPYC core, slower
    than memory). zlib releases the GIL while it runs."""
    return zlib.crc32(_bytes(batch))


def to_cuda(batch) -> int:
    """Copy every tensor of the batch to the GPU (``non_blocking=True``: asynchronous from
    pinned memory, as a training loop copies) and wait for the copies; the bytes copied."""
    tensors = [leaf for leaf in leaves(batch) if isinstance(leaf, torch.Tensor)]
    for tensor in tensors:
        tensor.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    return sum(tensor.nbytes for tensor in tensors)


Consumer = Callable[[torch.Tensor], int]

# The training-loop stand-ins: name -> (function, what it does, for the report).
CONSUMERS: dict[str, tuple[Consumer, str]] = {
    "sum64": (sum64, "sum64: every byte of the batch read as uint64 words and summed (numpy "
              "add.reduce on one thread, modulo 2**64, tail bytes added separately)"),
    "crc32": (crc32, "crc32: zlib.crc32 over every byte of the batch"),
    "cuda": (to_cuda, "cuda: the batch copied to the GPU (tensor.to('cuda', non_blocking=True), "
             "then torch.cuda.synchronize)"),
}
DEFAULT_CONSUMER = "sum64"


class Digest(NamedTuple):
    """CRC-32s of a batch: ``data`` over its content (the bytes of every tensor and array, and
    every other value by its repr: strings, numbers, None), ``structure`` over its form
    (containers, keys, types, dtypes, shapes). A batch with no tensors still has content, so
    two loaders' batches of strings or numbers are compared too."""

    data: int
    structure: int


def _walk(x, out: list) -> None:
    """(kind, value) leaves of a batch in a fixed order: its structure and its content."""
    if isinstance(x, torch.Tensor):
        out.append((f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}", x))
    elif isinstance(x, np.ndarray):
        out.append((f"ndarray {x.dtype}{list(x.shape)}", x))
    elif isinstance(x, dict):
        out.append((f"dict{list(x)}", None))
        for v in x.values():
            _walk(v, out)
    elif isinstance(x, (list, tuple)):
        out.append((f"{type(x).__name__}[{len(x)}]", None))
        for v in x:
            _walk(v, out)
    elif isinstance(x, (str, bytes, int, float, bool, type(None))):
        out.append((type(x).__name__, x))
    else:  # an object of the user's: its type is its structure, its repr may hold addresses
        out.append((type(x).__name__, None))


def _raw(value) -> bytes:
    if isinstance(value, torch.Tensor):
        if not value.numel():
            return b""
        # reshape first: a 0-dim tensor cannot be viewed as bytes
        value = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value).tobytes()
    return repr(value).encode()


def digest(batch) -> Digest:
    """The batch's :class:`Digest`: the correctness check that two loaders deliver the same
    batches, whatever the loop's consumer (sum64 alone would not see bytes swapped within a
    word)."""
    parts = []
    _walk(batch, parts)
    data = structure = 0
    for kind, value in parts:
        structure = zlib.crc32(kind.encode(), structure)
        if value is not None:
            data = zlib.crc32(_raw(value), data)
    return Digest(data, structure)


def batch_nbytes(batch) -> int:
    return sum(len(leaf.encode()) if isinstance(leaf, str) else
               leaf.nbytes if isinstance(leaf, np.ndarray) else leaf.numel() * leaf.element_size()
               for leaf in leaves(batch))


def batch_len(batch) -> int:
    """Samples in a batch: the length of its first tensor, or of its first list of strings
    or of NumPy arrays (a collate_fn that keeps the samples apart, as ``keep_list``)."""
    while isinstance(batch, (list, tuple, dict)) and batch:
        first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
        if isinstance(first, str) or (type(batch) is list and isinstance(first, np.ndarray)):
            break
        batch = first
    return len(batch)


class ModelStep:
    """A stand-in for the model's step: the host waits (GPU-bound), burns a core, or runs
    matmuls on the GPU, for about ``ms`` per micro-batch (calibrated once). On the GPU they are
    4096-square bf16 products: a few hundred kernels a step that fill the device, as a model's
    do, rather than thousands of tiny ones that would keep the host busy launching them."""

    def __init__(self, mode: str, ms: float):
        self.mode, self.seconds, self.iters = mode, ms / 1e3, 0
        if mode in ("cpu", "cuda") and ms > 0:
            self.weight = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
                           if mode == "cuda" else torch.randn(256, 256))
            self._matmuls(4)
            t0 = time.perf_counter()
            self._matmuls(20)
            per = (time.perf_counter() - t0) / 20
            self.iters = max(1, round(self.seconds / per))

    def _matmuls(self, n: int) -> None:
        x = self.weight
        for _ in range(n):
            x = torch.tanh(x @ self.weight)
        if self.mode == "cuda":  # the step's stream, as loss.item() waits: not other streams
            torch.cuda.current_stream().synchronize()

    def __call__(self) -> None:
        if self.mode == "sleep":
            time.sleep(self.seconds)
        elif self.mode in ("cpu", "cuda") and self.iters:
            self._matmuls(self.iters)
