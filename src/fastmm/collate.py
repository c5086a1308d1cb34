"""Collation into slabs, and packing any batch for the trip from a worker to the main process.

``default_collate`` runs as torch's own ``collate`` with one change: a batched tensor is
allocated in the worker's slab instead of a new shared-memory segment, and each sample is
copied straight into its slot. Whatever a custom ``collate_fn`` returns travels too: every
plain CPU tensor in it is copied into the slab (or inlined, if tiny) by the pickler, and the
main process gets tensors that view the slab without a copy.
"""

from __future__ import annotations

import io
import math
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
from torch.utils.data._utils.collate import (
    collate,
    collate_tensor_fn,
    default_collate,
    default_collate_fn_map,
)

INLINE_MAX_BYTES = 16 * 1024  # smaller tensors travel inside the message; a slab is not worth it

_writer = None  # this worker's SlabWriter while a batch is being collated and packed


def _plain_cpu_tensor(t) -> bool:
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_nested
        and not t.requires_grad
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
    )


def _as_bytes(t: torch.Tensor):
    """A contiguous tensor's memory as a uint8 NumPy array (any dtype, bfloat16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _collate_tensor_into_slab(batch, *, collate_fn_map=None):
    elem = batch[0]
    if _writer is None or not _plain_cpu_tensor(elem):
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    shape = (len(batch), *elem.shape)
    numel = math.prod(shape)
    nbytes = numel * elem.element_size()
    if nbytes <= INLINE_MAX_BYTES:
        out = torch.empty(shape, dtype=elem.dtype)
        return torch.stack(batch, 0, out=out)  # out= keeps torch's dtype rule for mixed batches
    slab_id, offset, view = _writer.alloc(nbytes)
    out = torch.frombuffer(view, dtype=elem.dtype, count=numel).view(shape)
    if all(
        _plain_cpu_tensor(t) and t.dtype == elem.dtype and t.shape == elem.shape and t.is_contiguous()
        for t in batch
    ):
        _writer.gather(view, 0, [_as_bytes(t) for t in batch], nbytes // len(batch))
        return out
    return torch.stack(batch, 0, out=out)


def worker_collate_fn(collate_fn):
    """The collate function a worker runs in place of the loader's ``collate_fn``."""
    if collate_fn is not default_collate:
        return collate_fn
    fn_map = {**default_collate_fn_map, torch.Tensor: _collate_tensor_into_slab}

    def collate_into_slabs(batch):
        return collate(batch, collate_fn_map=fn_map)

    return collate_into_slabs


class _SlabPickler(ForkingPickler):
    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor) or not _plain_cpu_tensor(obj):
            return None  # everything else pickles as torch would send it
        dtype, shape = obj.dtype, tuple(obj.shape)
        nbytes = obj.numel() * obj.element_size()
        if nbytes <= INLINE_MAX_BYTES:
            return ("inline", dtype, shape, _as_bytes(obj.contiguous()).tobytes())
        if obj.is_contiguous():
            located = _writer.locate(obj.data_ptr(), nbytes)
            if located is not None:
                return ("slab", *located, dtype, shape)
        slab_id, offset, view = _writer.alloc(nbytes)
        torch.frombuffer(view, dtype=dtype, count=obj.numel()).view(shape).copy_(obj)
        return ("slab", slab_id, offset, dtype, shape)


class _SlabUnpickler(pickle.Unpickler):
    def __init__(self, file, views: dict[int, memoryview]):
        super().__init__(file)
        self._views = views

    def persistent_load(self, pid):
        kind, *rest = pid
        if kind == "inline":
            dtype, shape, raw = rest
            if not raw:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(bytearray(raw), dtype=dtype).view(shape)
        if kind == "slab":
            slab_id, offset, dtype, shape = rest
            view = self._views[slab_id]
            return torch.frombuffer(view, dtype=dtype, count=math.prod(shape), offset=offset).view(shape)
        raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")


def pack(data, writer) -> bytes:
    """Pickle ``data`` with its tensors placed in ``writer``'s slabs."""
    buf = io.BytesIO()
    _SlabPickler(buf, pickle.HIGHEST_PROTOCOL).dump(data)
    return buf.getvalue()


def unpack(payload: bytes, views: dict[int, memoryview]):
    """Rebuild a batch whose tensors view the given slabs."""
    return _SlabUnpickler(io.BytesIO(payload), views).load()


def set_writer(writer) -> None:
    """Make ``writer`` the slab owner for collation and packing in this process."""
    global _writer
    _writer = writer
