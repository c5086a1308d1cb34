"""Datasets, samplers, collate functions and comparison helpers shared by the loader tests.

Everything a worker process may need to unpickle lives at module level here, so that the
same objects work with the "fork", "spawn" and "forkserver" start methods (a spawned worker
imports this module by name; conftest.py keeps tests/ on sys.path).
"""

from __future__ import annotations

import collections
import math
import os
import random
import time
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from fastmm.decode import DecodeError
from fastmm.decode.pil import Decoder as PilDecoder
from fastmm.telemetry import stage

# --------------------------------------------------------------------------------------------
# Sample types
# --------------------------------------------------------------------------------------------


class Point(NamedTuple):
    x: Any
    y: Any


class Pair(NamedTuple):
    left: Any
    right: Any


class Staged(Dataset):
    """Each sample: read 4 ms, decode 8 ms, augment 2 ms (sleeps), marked as stages."""

    def __init__(self, n: int = 24):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with stage("read"):
            time.sleep(0.004)
        with stage("decode"):
            time.sleep(0.008)
        with stage("augment"):
            time.sleep(0.002)
        return torch.full((4,), i)


class Holder:
    """A user class holding tensors (what a custom collate_fn may return)."""

    def __init__(self, images, labels, meta):
        self.images = images
        self.labels = labels
        self.meta = meta

    def __repr__(self):  # used by canonical() for multiset comparison
        return f"Holder({canonical(vars(self))})"


def _wid() -> int:
    info = get_worker_info()
    return -1 if info is None else info.id


def make_sample(kind: str, i: int, offset: int = 0):
    """A deterministic sample of the given kind for index ``i`` (plus the worker id where it
    makes the worker assignment observable)."""
    v = i + offset
    if kind == "tensor":
        return torch.arange(12, dtype=torch.float32).reshape(3, 4) + v
    if kind == "tensor_wid":
        return {"x": torch.arange(6, dtype=torch.int64) + v, "wid": _wid(), "i": v}
    if kind == "dtypes":
        g = torch.Generator().manual_seed(v)
        return {
            "u8": torch.randint(0, 256, (8, 8), dtype=torch.uint8, generator=g),
            "i8": torch.randint(-128, 128, (5,), dtype=torch.int8, generator=g),
            "i16": torch.randint(-1000, 1000, (5,), dtype=torch.int16, generator=g),
            "i32": torch.randint(-(2**31), 2**31 - 1, (5,), dtype=torch.int32, generator=g),
            "i64": torch.randint(-(2**62), 2**62, (4, 3), dtype=torch.int64, generator=g),
            "f16": torch.randn(6, generator=g).to(torch.float16),
            "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "f32": torch.randn(2, 3, 4, generator=g),
            "f64": torch.randn(7, dtype=torch.float64, generator=g),
            "c64": torch.randn(3, dtype=torch.complex64, generator=g),
            "bool": torch.rand(9, generator=g) > 0.5,
            "zero_dim_i": torch.tensor(v),
            "zero_dim_f": torch.tensor(v / 7.0, dtype=torch.float64),
            "empty": torch.empty(0, 3),
            "empty2": torch.zeros(2, 0, 5, dtype=torch.int32),
            # > 16 KiB per sample: slab path even for a single sample
            "big_f32": torch.randn(72, 72, generator=g),
            "big_u8": torch.randint(0, 256, (3, 96, 96), dtype=torch.uint8, generator=g),
            "big_bool": torch.rand(20000, generator=g) > 0.3,
            "big_bf16": torch.randn(100, 100, generator=g).to(torch.bfloat16),
            "big_i64": torch.arange(3000, dtype=torch.int64) * (v + 1),
            # right at the inline threshold (16 KiB) and one element past it
            "edge_16k": torch.full((4096,), float(v)),
            "edge_16k_plus": torch.full((4097,), float(v)),
            "small": torch.tensor([v, -v], dtype=torch.int64),
            "wid": _wid(),
        }
    if kind == "numpy":
        rs = np.random.RandomState(v)
        return {
            "f32": rs.rand(4, 4).astype(np.float32),
            "i16": rs.randint(-100, 100, size=(3,)).astype(np.int16),
            "u8_big": rs.randint(0, 256, size=(3, 64, 64)).astype(np.uint8),
            "f64_0d": np.array(v / 3.0),
            "f64": np.float64(v / 3.0),
            "f32s": np.float32(v * 0.25),
            "i32": np.int32(v * 7),
            "u8s": np.uint8(v % 256),
            "b": np.bool_(v % 2 == 0),
            "fortran": np.asfortranarray(rs.rand(3, 5)),
            "noncontig": rs.rand(6, 8)[::2, 1::3],
        }
    if kind == "python":
        return {
            "int": v * 3,
            "neg": -v,
            "float": v / 8.0,
            "bool": v % 3 == 0,
            "str": f"sample-{v}",
            "unicode": "ünïcødé-" + "é" * (v % 4),
            "bytes": bytes([v % 256]) * (v % 5 + 1),
            "big_int": 2**40 + v,
        }
    if kind == "containers":
        t = torch.full((2, 2), float(v))
        return {
            "tuple": (v, t, f"t{v}"),
            "list": [t * 2, v, [float(v), v % 2 == 1]],
            "point": Point(x=t, y=v),
            "nested_point": Point(x=Pair(left=v, right=t.long()), y={"s": str(v), "a": np.int64(v)}),
            "odict": collections.OrderedDict([("b", v), ("a", t.sum())]),
            "dict_of_dicts": {"inner": {"deep": {"x": t[0], "y": [v, v + 1]}}},
            "int_keys": {1: v, 2: t[1]},
        }
    if kind == "mixed_big_small":
        return {
            "image": (torch.arange(3 * 48 * 48, dtype=torch.int32).reshape(3, 48, 48) + v).to(torch.uint8),
            "label": v % 10,
            "caption": f"caption {v}",
            "emb": torch.full((4,), v / 2.0, dtype=torch.float64),
            "meta": {"id": v, "tags": ["a", f"t{v % 3}"]},
        }
    if kind == "noncontig":
        base = torch.arange(120 * 100, dtype=torch.float32).reshape(120, 100) + v
        return {
            "big_t": base.t(),  # 48 KB, not contiguous
            "big_step": base[::2, ::3],
            "small_t": base[:4, :3].t(),
            "expanded": torch.tensor([v, v + 1]).expand(3, 2),
        }
    if kind == "channels_last":  # decoded pixels: HWC memory viewed as CHW (or TCHW)
        hwc = (torch.arange(64 * 96 * 4, dtype=torch.int32).reshape(64, 96, 4) * 7 + v).to(torch.uint8)
        return {
            "rgb": hwc[..., :3].contiguous().permute(2, 0, 1),
            "rgb_of_rgba": hwc.permute(2, 0, 1)[:3],
            "crop": hwc.permute(2, 0, 1)[:, 5:50, 7:70],
            "clip": torch.stack([hwc + i for i in range(3)]).permute(0, 3, 1, 2),
            "bool": (hwc > 100).permute(2, 0, 1),
            "int8": hwc.view(torch.int8)[..., :2].contiguous().permute(2, 0, 1),
            "float": hwc[:8, :8].float().permute(2, 0, 1),
        }
    if kind == "big":
        return torch.full((3, 64, 64), float(v))
    if kind == "dtype_cycle":  # a batch of mixed dtypes over 16 KiB: stacked as its first's
        return torch.full((2100,), v * 1.5, dtype=(torch.float64, torch.float32, torch.int32)[v % 3])
    raise ValueError(kind)


class SampleDataset(Dataset):
    """Map-style dataset of ``make_sample(kind, i)``; ``offset`` may be set by worker_init_fn."""

    def __init__(self, n: int, kind: str = "tensor"):
        self.n = n
        self.kind = kind
        self.offset = 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return make_sample(self.kind, int(i), self.offset)


class DelayedDataset(SampleDataset):
    """Some indices are slow, so that with in_order=False batches come back out of order."""

    def __getitem__(self, i):
        if int(i) % 5 == 0:
            time.sleep(0.03)
        return make_sample(self.kind, int(i), self.offset)


class GetItemsDataset(SampleDataset):
    """A map-style dataset with ``__getitems__`` (batched fetch), as torch supports."""

    def __getitems__(self, indices):
        return [{"x": make_sample(self.kind, int(i)), "via": "getitems", "n": len(indices)} for i in indices]


class BatchedGetItemsDataset(SampleDataset):
    """``__getitems__`` returning an already-batched structure (used with an identity collate);
    indexing with a list of indices (a sampler that yields batches) does the same."""

    def __getitem__(self, i):
        if isinstance(i, list):
            return self.__getitems__(i)
        return make_sample(self.kind, int(i), self.offset)

    def __getitems__(self, indices):
        idx = torch.tensor(list(indices))
        return {"idx": idx, "x": torch.stack([make_sample(self.kind, int(i)) for i in indices]), "wid": _wid()}


class RangeIterable(IterableDataset):
    """An IterableDataset over ``make_sample(kind, i)`` for i in range(n).

    shard="none": every worker yields everything (duplicates, like torch);
    shard="stride": worker k yields i = k, k+W, k+2W, ...;
    shard="uneven": worker k yields a contiguous chunk whose size grows with k (workers end at
    different times).
    """

    def __init__(self, n: int, kind: str = "tensor", shard: str = "stride"):
        self.n = n
        self.kind = kind
        self.shard = shard

    def __iter__(self):
        info = get_worker_info()
        if info is None or self.shard == "none":
            ids = range(self.n)
        elif self.shard == "stride":
            ids = range(info.id, self.n, info.num_workers)
        elif self.shard == "uneven":
            weights = [k + 1 for k in range(info.num_workers)]
            total = sum(weights)
            bounds = [0]
            for w in weights:
                bounds.append(bounds[-1] + self.n * w // total)
            bounds[-1] = self.n
            ids = range(bounds[info.id], bounds[info.id + 1])
        else:
            raise ValueError(self.shard)
        for i in ids:
            yield make_sample(self.kind, i)


class SizedRangeIterable(RangeIterable):
    def __len__(self):
        return self.n


class RandomDataset(Dataset):
    """Samples drawn from the worker's torch, random and NumPy global RNGs."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {
            "i": int(i),
            "wid": _wid(),
            "torch": torch.rand(3),
            "torch_int": torch.randint(0, 1 << 30, (2,)),
            "randn_big": torch.randn(4200),  # > 16 KiB
            "random": random.random(),
            "randint": random.randint(0, 1 << 30),
            "np": np.random.rand(2),
            "np_int": int(np.random.randint(0, 1 << 30)),
        }


class RandomIterable(IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        for i in range(info.id, self.n, info.num_workers):
            yield {"i": i, "t": torch.rand(2), "r": random.random(), "n": np.random.rand()}


class WorkerInfoDataset(Dataset):
    """Reports what get_worker_info() and the RNGs say inside the worker."""

    def __init__(self, n: int):
        self.n = n
        self.tag = "worker-info-dataset"

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        frozen = False
        try:
            info.id = 99
        except (AttributeError, RuntimeError):  # torch's WorkerInfo is read-only
            frozen = True
        return {
            "i": int(i),
            "id": info.id,
            "num_workers": info.num_workers,
            "seed": info.seed,
            "dataset_is_self": info.dataset is self,
            "dataset_tag": info.dataset.tag,
            "info_type": type(info).__module__ + "." + type(info).__qualname__,
            "frozen": frozen,
            "torch_initial_seed": torch.initial_seed(),
            "np_state_head": [int(x) for x in np.random.get_state()[1][:8]],
            "init_state": getattr(self, "init_state", None),
            "num_threads": torch.get_num_threads(),
            "pid": os.getpid(),
        }


def record_init_state(worker_id: int) -> None:
    """worker_init_fn: record what the worker saw at init time in its dataset copy."""
    info = get_worker_info()
    info.dataset.init_state = {
        "worker_id_arg": worker_id,
        "info_id": info.id,
        "seed": info.seed,
        "torch_initial_seed": torch.initial_seed(),
        "np_state_head": [int(x) for x in np.random.get_state()[1][:8]],
        "random_first": random.random(),
        "np_first": float(np.random.rand()),
    }


def set_offset(worker_id: int) -> None:
    """worker_init_fn: changes the worker's dataset copy and reseeds NumPy per worker."""
    info = get_worker_info()
    info.dataset.offset = 1000 * (worker_id + 1)
    np.random.seed(1234 + worker_id)


def fail_init(worker_id: int) -> None:
    raise ZeroDivisionError(f"init failed in worker {worker_id}")


class FailingDataset(Dataset):
    """Raises ``exc_type`` for the indices in ``bad``."""

    def __init__(self, n: int, bad=(5,), exc_type=ValueError):
        self.n = n
        self.bad = set(bad)
        self.exc_type = exc_type

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if int(i) in self.bad:
            raise self.exc_type(f"bad index {i}")
        return torch.tensor([int(i)])


class SleepyDataset(Dataset):
    def __init__(self, n: int, slow: int, seconds: float):
        self.n = n
        self.slow = slow
        self.seconds = seconds

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if int(i) == self.slow:
            time.sleep(self.seconds)
        return torch.tensor([int(i)])


class SuicideDataset(Dataset):
    """The worker that fetches index ``victim`` kills itself with SIGKILL."""

    def __init__(self, n: int, victim: int):
        self.n = n
        self.victim = victim

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if int(i) == self.victim:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([int(i)])


class ExitingDataset(Dataset):
    """The worker that fetches index ``victim`` dies with exit code 3.

    With ``close_pipes_first`` it first closes every multiprocessing pipe it holds and lingers
    a second: a deterministic version of what any dying process does (the kernel closes its
    descriptors, so the parent can see EOF on a pipe before the child is reaped)."""

    def __init__(self, n: int, victim: int, close_pipes_first: bool = False):
        self.n = n
        self.victim = victim
        self.close_pipes_first = close_pipes_first

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if int(i) == self.victim:
            if self.close_pipes_first:
                import gc
                import multiprocessing.connection

                for obj in gc.get_objects():
                    if isinstance(obj, multiprocessing.connection.Connection) and not obj.closed:
                        try:
                            obj.close()
                        except OSError:
                            pass
                time.sleep(1.0)
            os._exit(3)
        return torch.tensor([int(i)])


class FullDataset(Dataset):
    """Sample i is a float32 tensor of ``shape`` filled with i (easy to verify later)."""

    def __init__(self, n: int, shape=(256, 256), dtype=torch.float32):
        self.n = n
        self.shape = tuple(shape)
        self.dtype = dtype

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.full(self.shape, float(i), dtype=self.dtype), "i": int(i)}


# in a spawned worker: about when it had started (its imports done), in seconds since boot
IMPORTED_AT = time.clock_gettime(time.CLOCK_BOOTTIME)


class StartingDataset(Dataset):
    """Each sample: its worker's pid and IMPORTED_AT there. A spawned worker unpickling it as it
    starts first sleeps ``start_s``, or exits with ``exit_code``."""

    def __init__(self, n: int, start_s: float = 0.0, exit_code: int | None = None):
        self.n, self.start_s, self.exit_code = n, start_s, exit_code

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.exit_code is not None:
            os._exit(self.exit_code)
        time.sleep(self.start_s)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"pid": os.getpid(), "imported_at": IMPORTED_AT}


class PidDataset(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"i": int(i), "pid": os.getpid()}


class TvTensorDataset(Dataset):
    """torchvision tv_tensors (Tensor subclasses with metadata), as modern pipelines return."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        from torchvision import tv_tensors

        i = int(i)
        return {
            "image": tv_tensors.Image(torch.full((3, 48, 48), i, dtype=torch.uint8)),
            "boxes": tv_tensors.BoundingBoxes(
                torch.tensor([[i, i, i + 5, i + 7]]), format="XYXY", canvas_size=(48, 48)
            ),
            "mask": tv_tensors.Mask(torch.arange(48 * 48).reshape(48, 48) % (i + 2) == 0),
            "label": i % 4,
        }


class ParamDataset(Dataset):
    """Samples that are tensor subclasses / special tensors (used with batch_size=None)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {
            "param": torch.nn.Parameter(torch.full((3,), float(i))),
            "leaf_grad": torch.full((2, 2), float(i)).requires_grad_(),
            "big_param": torch.nn.Parameter(torch.full((5000,), float(i))),
            "none": None,
            "str": f"s{i}",
            "np": np.arange(3) * i,
            "view_of_big": torch.arange(10000, dtype=torch.float32)[i : i + 5],
        }


# --------------------------------------------------------------------------------------------
# Samplers
# --------------------------------------------------------------------------------------------


class ReverseSampler(Sampler):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


class EveryOtherSampler(Sampler):
    """Yields numpy integers, not Python ints (samplers may do that)."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(np.arange(0, self.n, 2))

    def __len__(self):
        return (self.n + 1) // 2


class SizesBatchSampler(Sampler):
    """Consecutive batches of the given sizes (slabs must grow, shrink and be reused)."""

    def __init__(self, sizes):
        self.sizes = list(sizes)

    def __iter__(self):
        pos = 0
        for size in self.sizes:
            yield list(range(pos, pos + size))
            pos += size

    def __len__(self):
        return len(self.sizes)


class VariableBatchSampler(Sampler):
    """Batches of sizes 1, 2, 3, 1, 2, 3, ... over a permutation."""

    def __init__(self, n: int, seed: int = 0):
        self.n = n
        self.seed = seed

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed)).tolist()
        size, pos = 1, 0
        while pos < len(order):
            yield order[pos : pos + size]
            pos += size
            size = size % 3 + 1

    def __len__(self):
        count, size, pos = 0, 1, 0
        while pos < self.n:
            count += 1
            pos += size
            size = size % 3 + 1
        return count


# --------------------------------------------------------------------------------------------
# collate_fn
# --------------------------------------------------------------------------------------------


def collate_identity(batch):
    return batch


def collate_stack_sum(batch):
    x = torch.stack(batch)
    return x, x.sum(dim=0), len(batch)


def collate_nested(batch):
    xs = [b["big_f32"] for b in batch]
    return {
        "stacked": torch.stack(xs),
        "pairs": [(b["small"], int(b["zero_dim_i"])) for b in batch],
        "meta": {"n": len(batch), "ids": tuple(int(b["zero_dim_i"]) for b in batch)},
        "point": Point(x=torch.cat([b["u8"] for b in batch]), y=[b["bf16"] for b in batch]),
    }


def collate_holder(batch):
    images = torch.stack([b["image"] for b in batch]).float() / 255
    labels = torch.tensor([b["label"] for b in batch])
    return Holder(images=images, labels=labels, meta=[b["caption"] for b in batch])


def collate_noncontig(batch):
    x = torch.stack(batch)  # (B, 3, 4) small, and a big derived tensor
    big = x.repeat(1, 200, 10)  # B*600*40 floats
    return {"t": big.transpose(1, 2), "slice": big[:, ::7, 3], "x": x, "diag": x[:, 0].diagonal(dim1=0, dim2=1)}


def collate_numpy(batch):
    x = torch.stack(batch).numpy()
    return {"np": x, "np_big": np.repeat(x, 500, axis=0), "list": [a.tolist() for a in x]}


def collate_numpy_kinds(batch):
    """NumPy arrays of every kind a custom collate_fn returns: big ones travel in slabs unless
    pickling would give them back changed (strided, non-native byte order); read-only ones
    arrive writable (pickle protocol < 5), as torch's do."""
    x = torch.stack(batch).numpy().astype(np.uint8).repeat(200, axis=1)  # > 16 KiB
    return {"u8": x, "fortran": np.asfortranarray(x.astype(np.float32)),
            "read_only": np.frombuffer(x.tobytes(), np.uint8), "strided": x[:, ::2],
            "big_endian": x.astype(">i4"), "f16": x.astype(np.float16), "bool": x > 3,
            "c128": x[:, :8].astype(np.complex128), "u32": x.astype(np.uint32),
            "small": x[:, :4].copy(), "empty": np.zeros((0, 5000)), "0d": np.array(2.5),
            "objects": np.array([{"a": 1}] * 3000, dtype=object), "same": [x, x],
            "tensor_too": torch.from_numpy(x)}


# --------------------------------------------------------------------------------------------
# Comparison helpers
# --------------------------------------------------------------------------------------------


def assert_same(a, b, path: str = "batch", strides: bool = False) -> None:
    """Exact recursive equality: types (incl. namedtuple/dict/list/tuple classes), dtypes,
    shapes, values (NaN-free data assumed), and order of dict keys; with ``strides`` also
    the tensors' strides (memory layout)."""
    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if type(a) is not torch.Tensor and hasattr(a, "__dict__"):  # subclass metadata
            assert_same(vars(a), vars(b), f"{path}.__dict__", strides)
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.layout == b.layout, f"{path}: layout {a.layout} != {b.layout}"
        assert a.device == b.device, f"{path}: device {a.device} != {b.device}"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad differs"
        if a.layout == torch.strided:
            if strides:
                assert a.stride() == b.stride(), f"{path}: stride {a.stride()} != {b.stride()}"
            assert torch.equal(a.detach(), b.detach()), f"{path}: values differ"
        else:
            assert torch.equal(a.detach().to_dense(), b.detach().to_dense()), f"{path}: values differ"
        return
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        if strides:
            flags = ("C_CONTIGUOUS", "F_CONTIGUOUS", "WRITEABLE", "ALIGNED")
            assert (a.strides, [a.flags[f] for f in flags]) == (b.strides, [b.flags[f] for f in flags]), \
                f"{path}: strides or flags differ"
        assert np.array_equal(a, b), f"{path}: values differ"
        return
    if isinstance(a, np.generic):
        assert a.dtype == b.dtype and a == b, f"{path}: {a!r} != {b!r}"
        return
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]", strides)
        return
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: len {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]", strides)
        return
    if isinstance(a, float):
        assert a == b or (math.isnan(a) and math.isnan(b)), f"{path}: {a!r} != {b!r}"
        return
    if isinstance(a, (int, str, bytes, bool, type(None))):
        assert a == b, f"{path}: {a!r} != {b!r}"
        return
    if hasattr(a, "__dict__"):
        assert_same(vars(a), vars(b), f"{path}.__dict__", strides)
        return
    assert a == b, f"{path}: {a!r} != {b!r}"


def canonical(x) -> str:
    """A string that identifies a batch's content exactly (to sort batches into a multiset)."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.layout != torch.strided:
            t = t.to_dense()
        return f"T({t.dtype},{tuple(t.shape)},{t.tolist()!r})"
    if isinstance(x, np.ndarray):
        return f"N({x.dtype},{x.shape},{x.tolist()!r})"
    if isinstance(x, dict):
        items = ",".join(f"{k!r}:{canonical(v)}" for k, v in x.items())
        return f"{type(x).__name__}{{{items}}}"
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__}[{','.join(canonical(v) for v in x)}]"
    if hasattr(x, "__dict__") and not isinstance(x, type):
        return f"{type(x).__name__}({canonical(vars(x))})"
    return f"{type(x).__name__}:{x!r}"


class CustomError(Exception):
    """A user-defined exception class raised inside a worker."""


class MismatchDataset(Dataset):
    """Sample shapes differ at index ``odd``: default_collate fails inside the worker."""

    def __init__(self, n: int, size: int, odd: int):
        self.n = n
        self.size = size
        self.odd = odd

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        size = self.size + 1 if int(i) == self.odd else self.size
        return torch.zeros(size)


class BrokenIterable(IterableDataset):
    """Worker ``bad_worker`` raises after yielding ``after`` samples."""

    def __init__(self, n: int, after: int, bad_worker: int = 0):
        self.n = n
        self.after = after
        self.bad_worker = bad_worker

    def __iter__(self):
        info = get_worker_info()
        for k, i in enumerate(range(info.id, self.n, info.num_workers)):
            if info.id == self.bad_worker and k == self.after:
                raise CustomError(f"iterable broke in worker {info.id} at {i}")
            yield torch.tensor([i])


def collate_alias(batch):
    """The same tensor object twice, a view of it, and a small view of it."""
    t = torch.stack(batch)
    return {"a": t, "b": t, "view": t[1:], "small_view": t[0, 0, 0, :2]}


def collate_raises(batch):
    if any(int(x[0]) == 6 for x in batch):
        raise CustomError("collate refused a batch containing 6")
    return torch.stack(batch)


# --------------------------------------------------------------------------------------------
# Bad samples
# --------------------------------------------------------------------------------------------


class CorruptOn(PilDecoder):
    """The real Pillow decoder, except that the given keys are damaged."""

    def __init__(self, keys):
        super().__init__()
        self.keys = set(keys)

    def decode_resized_crop(self, data, plan, *, key="", reduce=False):
        if key in self.keys:
            raise DecodeError("corrupt", key, "damaged on purpose")
        return super().decode_resized_crop(data, plan, key=key, reduce=reduce)


def rss_anon() -> int:
    """This process's anonymous memory in RAM (``RssAnon``), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


def churn_heap(blocks: int, keep_last: bool = False) -> None:
    """Write and free ``blocks`` blocks of 64 KiB from the heap (under glibc's mapping
    threshold): a decode's or a training step's buffers. With ``keep_last`` the last one stays
    allocated, so that glibc cannot trim the freed ones off the heap's top."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    taken = [libc.malloc(64 << 10) for _ in range(blocks)]
    for block in taken:
        ctypes.memset(block, 1, 64 << 10)
    for block in taken[:-1] if keep_last else taken:
        libc.free(block)


class HeapChurn(Dataset):
    """Each sample: the worker's anonymous memory as it begins, then 24 MiB of the heap written
    and freed (which FASTMM_WORKER_MALLOC=reuse keeps for the next)."""

    def __init__(self, n: int = 3):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        at_start = rss_anon()
        churn_heap(384)
        return at_start


class FaultCounter(Dataset):
    """Each sample is a fresh 2.4 MB clip (a copy of one of 8, as a decoder hands out new
    memory), kept until the batch is collated, with the page faults making it took in its
    process: about one a 4 KiB page when its memory is new to the process, none when the
    allocator hands back memory an earlier batch freed."""

    def __init__(self):
        self.bank = torch.randint(0, 256, (8, 16, 3, 224, 224), dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return 384

    def __getitem__(self, i):
        import resource

        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        clip = self.bank[i % 8].clone()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        return {"faults": torch.tensor(faults), "clip": clip}
