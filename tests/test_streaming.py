"""Samples streamed into their batch as they are made (collate.py, _batch_fill.py): the batches
are torch's, whatever the samples hold, and a worker holds one sample's memory, not a batch's."""

from __future__ import annotations

import collections
import socket
import weakref

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset, IterableDataset, default_collate, get_worker_info

import fastmm
from fastmm.telemetry import Telemetry
from fastmm import _batch_fill, collate
from fastmm.config import TransportConfig
from fastmm.slabs import SlabPool, SlabWriter
from _datasets import Point


def _image(i: int, shape=(3, 48, 48), dtype=torch.uint8) -> torch.Tensor:
    return torch.arange(i, i + torch.Size(shape).numel()).reshape(shape).to(dtype)


def make(kind: str, i: int):
    """Sample i of each kind; every kind's batch is over 16 KiB, so its tensors stream."""
    image = _image(i)
    if kind == "tensor":
        return image
    if kind == "pair":
        return image, i
    if kind == "dict":
        return {"image": image, "name": f"s{i}", "label": i, "mask": image[0] > 100}
    if kind == "ordered":
        return collections.OrderedDict(video=_image(i, (4, 3, 16, 16)), label=float(i))
    if kind == "namedtuple":
        return Point(x=image.float(), y=i)
    if kind == "nested":
        return [(image, [image[:, :8].clone()]), {"deep": (image.double(),)}]
    if kind == "channels_last":  # a decoder's HWC pixels viewed as CHW
        return image.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    if kind == "strided":
        return image.transpose(1, 2)
    if kind == "same_tensor_twice":
        return image, image
    if kind == "dtype_changes":  # torch's own rule decides what a mixed batch becomes
        return image if i % 4 else image.float()
    if kind == "shape_changes":  # torch's kind of error
        return image if i % 4 != 2 else image[:, :40]
    raise ValueError(kind)


class Samples(Dataset):
    def __init__(self, kind: str, n: int = 22):
        self.kind, self.n = kind, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return make(self.kind, i)


class StreamOfSamples(IterableDataset):
    """The same samples from an iterable, split between the workers in turn."""

    def __init__(self, kind: str, n: int = 22):
        self.kind, self.n = kind, n

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return (make(self.kind, i) for i in range(start, self.n, step))


def _same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _outcome(loader):
    """The batches, or the error's type and last line; the workers ended either way (an
    iterator left in the error's traceback would be collected later, in another test, where
    torch's waits 5 s per worker to join them)."""
    it = iter(loader)
    try:
        return list(it), None
    except Exception as exc:  # noqa: BLE001 - the error itself is compared
        return None, (type(exc), str(exc).splitlines()[-1] if str(exc) else "")
    finally:
        getattr(it, "_shutdown_workers", lambda: None)()


@pytest.mark.parametrize("kind", ["tensor", "pair", "dict", "ordered", "namedtuple", "nested",
                                  "channels_last", "strided", "same_tensor_twice",
                                  "dtype_changes", "shape_changes"])
@pytest.mark.parametrize("style", [Samples, StreamOfSamples], ids=["map", "iterable"])
def test_streamed_batches_are_torchs(kind, style, transport):
    """Every structure default_collate knows, a short last batch, and samples that do not fit
    the first one's shape or dtype: the same batches, or the same error, as torch's loader."""
    _check_against_torch(style(kind), style, watched=False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dict", "dtype_changes"])
def test_streamed_batches_under_telemetry_are_torchs(kind, transport):
    """Watched, samples come through telemetry's timed dataset: some timed alone and streamed,
    the others timed in runs and copied at collation."""
    _check_against_torch(Samples(kind), Samples, watched=True)


def _check_against_torch(dataset, style, watched: bool):
    expected, expected_error = _outcome(TorchLoader(dataset, batch_size=8, num_workers=2))
    loader = fastmm.DataLoader(dataset, batch_size=8, num_workers=2)
    if watched:
        loader = Telemetry().watch(loader)
    got, error = _outcome(loader)
    if dataset.kind == "shape_changes":  # torch's worker says "Trying to resize storage that is not
        assert error[0] is expected_error[0] is RuntimeError  # resizable"; fastmm, torch.stack's
        assert "stack expects each tensor to be equal size" in error[1]
    else:
        assert error == expected_error
    if expected is not None:
        assert len(got) == len(expected) == (3 if style is Samples else 4)
        for a, b in zip(got, expected):
            _same(a, b)


class Alive(Dataset):
    """Each sample says how many of this worker's earlier samples were still alive when it was
    made: what the worker held of its batch so far."""

    def __init__(self):
        self.alive = 0

    def __len__(self):
        return 64

    def __getitem__(self, i):
        image = torch.full((3, 64, 64), i % 251, dtype=torch.uint8)
        held = self.alive
        self.alive += 1
        weakref.finalize(image, self._gone)
        return image, held

    def _gone(self):
        self.alive -= 1


def test_a_worker_holds_one_sample_not_a_batch(transport):
    torch_held = max(int(held.max()) for _, held in TorchLoader(Alive(), batch_size=16,
                                                                num_workers=2))
    assert torch_held == 15  # torch's fetcher keeps every sample until it stacks them
    held = [int(h.max()) for _, h in fastmm.DataLoader(Alive(), batch_size=16, num_workers=2)]
    assert held == [0, 0, 0, 0]


@pytest.fixture
def writer(transport):
    """A real slab writer in this process, as collation finds it in a worker."""
    worker_sock, main_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    writer = SlabWriter(worker_sock, TransportConfig(pure_python=transport == "pure"))
    pool = SlabPool(keep_free=1)
    pool.connect(0, main_sock)
    writer.begin()
    yield writer
    pool.close()
    writer.close()
    worker_sock.close()
    main_sock.close()


def _streamed_batch(samples, keep, writer):
    """Samples made one by one into a batch of len(samples); ``keep`` picks (and orders) the
    ones the producer hands to collation."""
    with collate.filling(len(samples), writer) as batch:
        with _batch_fill.sample_by_sample() as put:
            placed = [put(sample, position) for position, sample in enumerate(samples)]
        assert all(p is not s for p, s in zip(placed, samples))  # every one streamed
        return collate.worker_collate_fn(default_collate, writer)(keep(placed)), batch


@pytest.mark.parametrize("keep", [
    lambda items: items,
    lambda items: items[1:],  # skipped samples (on_error="skip"): moved down in place
    lambda items: items[:2] + items[3:],
    lambda items: items[::-1],  # another order: stacked anew
    lambda items: items[:1] + [torch.zeros(3, 48, 48, dtype=torch.uint8)] + items[2:],
], ids=["all", "first_skipped", "middle_skipped", "reversed", "one_replaced"])
def test_collation_takes_streamed_samples_in_any_order(writer, keep):
    samples = [_image(i) for i in range(6)]
    batch, streamed = _streamed_batch(samples, keep, writer)
    assert torch.equal(batch, torch.stack(keep(samples)))


def test_a_producer_inside_another_leaves_the_slots_to_it(writer):
    """A dataset whose __getitem__ calls another's sample-by-sample __getitems__: the inner
    one's samples come back unchanged, so the outer producer's slots are never overwritten."""
    with collate.filling(2, writer):
        with _batch_fill.sample_by_sample() as outer:
            with _batch_fill.sample_by_sample() as inner:
                inner_sample = _image(7)
                assert inner(inner_sample, 0) is inner_sample
            first = outer(_image(1), 0)
            second = outer(_image(2), 1)
        batch = collate.worker_collate_fn(default_collate, writer)([first, second])
    assert torch.equal(batch, torch.stack([_image(1), _image(2)]))


def test_nothing_streams_outside_a_worker_batch():
    sample = _image(0)
    with _batch_fill.sample_by_sample() as put:
        assert put(sample, 0) is sample
