"""Collation into slabs, and packing any batch for the trip from a worker to the main process.

``default_collate`` runs as torch's own ``collate`` with one change: a batched tensor is
allocated in the worker's slab instead of a new shared-memory segment, and each sample is
copied straight into its slot, as soon as the sample is made where the worker fetches sample
by sample (see _batch_fill.py). Whatever a custom ``collate_fn`` returns travels too: every
plain CPU tensor (and NumPy array over 16 KiB) in it is copied into the slab (or inlined, if
tiny) by the pickler, and the main process gets tensors (arrays) that view the slab without a
copy.
"""

from __future__ import annotations

import copy
import functools
import io
import math
import pickle
import time
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch
from torch.utils.data import default_collate

from . import _batch_fill, _torch
from ._messages import Inline, InSlab, Packed, TensorSpec
from ._layout import copy_into, interleaved_bytes
from .slabs import ALIGN
from .telemetry.recorder import TimedCollate

INLINE_MAX_BYTES = 16 * 1024  # smaller storages travel inside the message; a slab is not worth it


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


def _collate_tensor_into_slab(writer, batch, *, collate_fn_map=None):
    """torch's collation of a tensor batch, into a slab of ``writer``'s."""
    elem = batch[0]
    if not _plain_cpu_tensor(elem):
        return _torch.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    batch_in_progress = _batch_fill.current()
    filled = batch_in_progress.claim(batch) if batch_in_progress is not None else None
    if filled is not None:
        return filled
    shape = (len(batch), *elem.shape)
    numel = math.prod(shape)
    nbytes = numel * elem.element_size()
    if nbytes <= INLINE_MAX_BYTES:
        out = torch.empty(shape, dtype=elem.dtype)
        return torch.stack(batch, 0, out=out)  # out= keeps torch's dtype rule for mixed batches
    slab_id, offset, view = writer.alloc(nbytes)
    out = torch.frombuffer(view, dtype=elem.dtype, count=numel).view(shape)
    if interleaved_bytes(elem) and all(_plain_cpu_tensor(t) and t.dtype == elem.dtype
                                       and t.shape == elem.shape for t in batch):
        for slot, t in zip(out, batch):  # decoded pixels, channels-last views: planes copies
            copy_into(slot, t, writer.planes)
        return out
    # one call for the whole batch: per-sample work in Python cost 7-10 us a sample, 40x
    # torch.stack's, and made batches of many small samples slower than torch's loader
    return torch.stack(batch, 0, out=out)


class _FilledBatch:
    """A default-collated batch being fetched: each sample's tensors are copied into their slot
    of the batch the moment the sample is made, and the sample keeps a view of the slot instead.

    The sample's own memory is then free for the next one, still in the core's cache, where
    torch's fetcher holds a whole batch of samples before stacking them: the worker copies
    from cache rather than memory, and holds one sample's memory, not a batch's. Collation
    then finds the tensors in place (``claim``); whatever was not copied early (another shape or
    dtype, a sample made elsewhere) is copied then, as before."""

    def __init__(self, size: int, writer):
        self.size, self.writer = size, writer
        self._outs: dict[tuple, torch.Tensor | None] = {}  # per leaf: (size, *shape) in a slab
        # id(slot view) -> (out, place, the view: kept alive, so no id is reused in a batch)
        self._slots: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._taken: set[tuple[int, int]] = set()  # (id(out), place)
        self.copy_spans: list[int] = []  # start and end (ns) of each sample's copies, flat
        self._fills_nothing = False

    def put(self, sample, position: int):
        """``sample`` with each of its tensors that fits replaced by a view of its slot."""
        if sample is None or not 0 <= position < self.size or self._fills_nothing:
            return sample
        start = time.monotonic_ns()
        placed = self._place(sample, (), position)
        if placed is not sample:
            self.copy_spans += (start, time.monotonic_ns())
        # the first sample decides each leaf: when none of its tensors fits, none will
        self._fills_nothing = all(out is None for out in self._outs.values())
        return placed

    def _place(self, x, path: tuple, position: int):
        """``x`` with its tensors copied into the batch; containers default_collate descends
        into are rebuilt as their own type where a tensor in them was replaced."""
        if type(x) is torch.Tensor:
            return self._fill(x, path, position)
        if isinstance(x, dict):
            placed = {k: self._place(v, (*path, k), position) for k, v in x.items()}
            if all(placed[k] is v for k, v in x.items()):
                return x
            try:
                out = copy.copy(x)
            except TypeError:  # collation will copy its tensors instead
                return x
            out.update(placed)
            return out
        if type(x) in (tuple, list) or (isinstance(x, tuple) and hasattr(x, "_fields")):
            placed = [self._place(v, (*path, i), position) for i, v in enumerate(x)]
            if all(p is v for p, v in zip(placed, x)):
                return x
            return type(x)(*placed) if hasattr(x, "_fields") else type(x)(placed)
        return x

    def _fill(self, t: torch.Tensor, path: tuple, position: int) -> torch.Tensor:
        out = self._outs.get(path, False)
        if out is False:  # the first sample with this leaf sets the batch's shape and dtype
            out = None
            numel = self.size * t.numel()
            if _plain_cpu_tensor(t) and numel * t.element_size() > INLINE_MAX_BYTES:
                _, _, view = self.writer.alloc(numel * t.element_size())
                out = torch.frombuffer(view, dtype=t.dtype, count=numel)
                out = out.view(self.size, *t.shape)
            self._outs[path] = out
        if (out is None or t.dtype != out.dtype or t.shape != out.shape[1:]
                or not _plain_cpu_tensor(t) or id(t) in self._slots
                or (id(out), position) in self._taken):  # a place filled twice: not again
            return t
        slot = out[position]
        if t.is_contiguous():  # past the cache (fastmm._C): another process reads it
            self.writer.gather(_raw_bytes(slot), 0, [_raw_bytes(t)],
                               t.numel() * t.element_size())
        else:
            copy_into(slot, t, self.writer.planes)
        self._taken.add((id(out), position))
        self._slots[id(slot)] = (out, position, slot)
        return slot

    def claim(self, batch: list) -> torch.Tensor | None:
        """The batch of these tensors made in place, from the slots that hold them, or None
        (nothing of it copied early, or its order cannot be compacted in place)."""
        slots = [self._slots.get(id(t)) for t in batch]
        outs = {id(entry[0]) for entry in slots if entry is not None}
        if len(outs) != 1:
            return None
        out = next(entry[0] for entry in slots if entry is not None)
        if len(batch) > len(out):
            return None
        last = -1
        for position, (t, entry) in enumerate(zip(batch, slots)):
            if entry is None:
                if not (_plain_cpu_tensor(t) and t.dtype == out.dtype
                        and t.shape == out.shape[1:]):
                    return None  # torch's own rules (and errors) for this batch
            elif entry[1] < position or entry[1] <= last:
                return None  # (moved down in increasing order, each is read before it is
            else:  # overwritten; any other order would need a second copy)
                last = entry[1]
        for position, (t, entry) in enumerate(zip(batch, slots)):
            if entry is None:
                copy_into(out[position], t, self.writer.planes)
            elif entry[1] != position:
                out[position].copy_(out[entry[1]])
        return out[: len(batch)]


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's memory as a flat uint8 array (any dtype, bfloat16 too)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def filling(size: int | None, writer):
    """``with filling(size, writer):`` around fetching and collating one batch of ``size``
    samples in a worker into ``writer``'s slabs (None: not default-collated, or not batched):
    producers inside may copy their samples in as they make them."""
    return _batch_fill.fetching(_FilledBatch(size, writer) if size else None)


def is_default(collate_fn) -> bool:
    """Whether ``collate_fn`` is torch's default_collate (timed by telemetry or not)."""
    if isinstance(collate_fn, TimedCollate):
        return is_default(collate_fn.fn)
    return collate_fn is default_collate


def worker_collate_fn(collate_fn, writer):
    """The collate function a worker runs in place of the loader's ``collate_fn``: torch's
    default collation builds its tensors in ``writer``'s slabs."""
    if isinstance(collate_fn, TimedCollate):  # telemetry's timing stays around our collation
        return collate_fn.rewrap(worker_collate_fn(collate_fn.fn, writer))
    if collate_fn is not default_collate:
        return collate_fn
    fn_map = {**_torch.default_collate_fn_map,
              torch.Tensor: functools.partial(_collate_tensor_into_slab, writer)}

    def collate_into_slabs(batch):
        return _torch.collate(batch, collate_fn_map=fn_map)

    return collate_into_slabs


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[lo, hi): the bytes of its storage that a non-empty tensor can reach."""
    size = t.element_size()
    lo = t.storage_offset() * size
    reach = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
    return lo, lo + (reach + 1) * size


class _SlabPickler(pickle.Pickler):
    """Pickles a batch with each plain CPU tensor (and slab-worthy NumPy array) replaced by a
    reference to its storage.

    Every storage the batch's tensors use is copied once (only the bytes they reach), so
    tensors that share memory in the worker share it in the main process and the same tensor
    twice stays one object, as torch does; strides are kept, and a view's storage offset counts
    from the first byte copied. Each NumPy array gets its own copy, as pickle gives it. Other
    objects pickle as ForkingPickler (what torch sends batches with) would pickle them; only
    objects of types pickle does not know itself reach ``reducer_override`` (a ``persistent_id``
    hook and ForkingPickler's per-pickler table copy cost a batch of 32 captions 10 us).
    """

    def __init__(self, file, protocol):
        super().__init__(file, protocol)
        self._protocol = protocol
        self._storage_index: dict[tuple[int, int], int] = {}
        self.storages: list[list] = []  # [storage, lo, hi] per storage (lo, hi: widened)
        self.tensors: list[TensorSpec] = []

    def reducer_override(self, obj):
        if type(obj) is np.ndarray:
            tensor = _slab_worthy_array(obj)
            if tensor is None:
                return NotImplemented
            # pickle gives a read-only array back writable below protocol 5 (torch's default
            # up to Python 3.13), read-only from 5 on
            read_only = not obj.flags.writeable and self._protocol >= 5
            # its own copy, as pickle gives each array (a view of another, or of a tensor, too)
            return _slab_array, (*self._add(tensor, shared=False), read_only)
        if not _plain_cpu_tensor(obj):
            reduce = ForkingPickler._extra_reducers.get(type(obj))  # torch's, for the rest
            return NotImplemented if reduce is None else reduce(obj)
        if obj.numel() == 0:
            return _empty_tensor, (obj.dtype, tuple(obj.shape), obj.stride())
        return _slab_tensor, self._add(obj)

    def _add(self, obj: torch.Tensor, shared: bool = True) -> tuple[int]:
        """Note a tensor's storage and place in it; the reference to it, as reduce arguments.
        ``shared``: its storage is one slot with other tensors' on the same memory."""
        storage = obj.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes()) if shared else None
        lo, hi = _byte_span(obj)
        slot = self._storage_index.get(key)
        if slot is None:
            slot = len(self.storages)
            if shared:
                self._storage_index[key] = slot
            self.storages.append([storage, lo, hi])
        else:
            entry = self.storages[slot]
            entry[1], entry[2] = min(entry[1], lo), max(entry[2], hi)
        self.tensors.append(TensorSpec(slot, obj.dtype, tuple(obj.shape), obj.stride(), lo))
        return (len(self.tensors) - 1,)

    def place(self, writer) -> list[Inline | InSlab]:
        """Copy each storage's reachable bytes into the slab (or inline them): the tables
        the main process needs to rebuild the tensors."""
        places = []
        for storage, lo, hi in self.storages:
            start = lo - lo % ALIGN  # keeps every tensor's offset a multiple of its item size
            nbytes = hi - start
            raw = torch.empty(0, dtype=torch.uint8).set_(storage, start, (nbytes,), (1,))
            if nbytes <= INLINE_MAX_BYTES:
                places.append(Inline(start, raw.numpy().tobytes()))
                continue
            located = writer.locate(storage.data_ptr() + start, nbytes)
            if located is None:
                slab_id, offset, view = writer.alloc(nbytes)
                writer.gather(view, 0, [raw.numpy()], nbytes)
                located = (slab_id, offset)
            places.append(InSlab(start, *located, nbytes))
        return places



def _slab_worthy_array(array: np.ndarray) -> torch.Tensor | None:
    """A tensor sharing a NumPy array's memory, when the array is worth a slab (a custom
    ``collate_fn``'s batch: pickled, torch's way, it is copied four times) and comes back from
    one just as pickle would give it back: contiguous, of a dtype torch knows."""
    if array.nbytes <= INLINE_MAX_BYTES or not (
            array.flags.c_contiguous or array.flags.f_contiguous):
        return None
    try:
        if array.flags.writeable:
            return torch.from_numpy(array)
        with warnings.catch_warnings():  # (np.frombuffer's arrays): only read, into the slab
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(array)
    except (TypeError, ValueError):  # object or structured dtypes, non-native byte order
        return None


def _slab_tensor(index: int):
    """Stands for a tensor in a packed batch; _SlabUnpickler makes the tensor instead."""
    raise pickle.UnpicklingError("a packed batch is read with collate.unpack")


def _slab_array(index: int, read_only: bool):
    """Stands for a NumPy array in a packed batch, as _slab_tensor does for a tensor."""
    raise pickle.UnpicklingError("a packed batch is read with collate.unpack")


def _empty_tensor(dtype, shape, stride):
    return torch.empty_strided(shape, stride, dtype=dtype)


class _SlabUnpickler(pickle.Unpickler):
    """Unpickles a packed batch, making each tensor (array) it refers to a view of the bytes
    its place holds; tensors on one storage slot share one storage, as they did in the worker.

    Args:
        file: the batch's pickle payload (``Packed.payload``), as a binary file.
        places: where each storage slot's bytes are (Inline or InSlab), by slot.
        tensors: each tensor's TensorSpec (slot, dtype, shape, stride, first byte), by index.
        views: the slabs the batch was sent, by slab id.
    """

    def __init__(self, file, places, tensors, views: dict[int, memoryview]):
        super().__init__(file)
        self._places = places
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._tensor_specs = tensors
        self._views = views

    def find_class(self, module, name):
        if module == __name__ and name == "_slab_tensor":
            return self._tensor
        if module == __name__ and name == "_slab_array":
            return self._array
        return super().find_class(module, name)

    def _storage(self, slot: int):
        storage = self._storages.get(slot)
        if storage is None:
            place = self._places[slot]
            if isinstance(place, Inline):
                base = torch.frombuffer(bytearray(place.data), dtype=torch.uint8)
            else:
                base = torch.frombuffer(self._views[place.slab_id], dtype=torch.uint8,
                                        count=place.nbytes, offset=place.offset)
            storage = self._storages[slot] = base.untyped_storage()
        return storage

    def _array(self, index: int, read_only: bool) -> np.ndarray:
        array = self._tensor(index).numpy()  # it keeps the tensor alive
        if read_only:
            array.flags.writeable = False
        return array

    def _tensor(self, index: int) -> torch.Tensor:
        slot, dtype, shape, stride, lo = self._tensor_specs[index]
        start = self._places[slot].start
        return torch.empty(0, dtype=dtype).set_(
            self._storage(slot), (lo - start) // dtype.itemsize, shape, stride
        )


def pack(data, writer) -> Packed:
    """Pickle ``data`` with its tensors' memory placed in ``writer``'s slabs."""
    buf = io.BytesIO()
    pickler = _SlabPickler(buf, pickle.DEFAULT_PROTOCOL)  # as torch: arrays come back alike
    pickler.dump(data)
    return Packed(pickler.place(writer), pickler.tensors, buf.getvalue())


def unpack(packed: Packed, views: dict[int, memoryview]):
    """Rebuild a batch whose tensors view the given slabs."""
    places, tensors, payload = packed
    check_layout(places, tensors, views)
    if not tensors:  # captions, labels: nothing to rebuild
        return pickle.loads(payload)
    unpickler = _SlabUnpickler(io.BytesIO(payload), places, tensors, views)
    try:
        return unpickler.load()
    finally:
        unpickler.memo.clear()  # it holds unpickler._tensor: a cycle that would keep slabs lent


def check_layout(places, tensors, views: dict[int, memoryview]) -> None:
    """ValueError unless every place lies inside its slab and every tensor inside its place:
    the main process reads shared memory only where a batch's tables say, so they are checked
    before any tensor is made (fuzzed by fuzz/fuzz.py layout)."""

    def bad(why: str):
        return ValueError(f"bad batch layout from a worker: {why}")

    def count(x) -> bool:
        return type(x) is int and x >= 0

    sizes = []
    for place in places:
        if type(place) is Inline and count(place.start) and isinstance(place.data, bytes):
            sizes.append((place.start, len(place.data)))
        elif type(place) is InSlab and all(map(count, place)):
            if place.slab_id not in views or \
                    place.offset + place.nbytes > len(views[place.slab_id]):
                raise bad(f"{place} is not inside a slab it was sent")
            sizes.append((place.start, place.nbytes))
        else:
            raise bad(f"place {place!r:.80}")
    for spec in tensors:
        if type(spec) is not TensorSpec:
            raise bad(f"tensor {spec!r:.80}")
        slot, dtype, shape, stride, lo = spec
        if not (count(slot) and slot < len(sizes) and isinstance(dtype, torch.dtype)
                and len(shape) == len(stride) and all(map(count, (*shape, *stride, lo)))):
            raise bad(f"tensor {spec!r:.80}")
        if math.prod(max(n, 1) for n in shape) >= 1 << 62 or any(x >= 1 << 62 for x in stride):
            raise bad(f"tensor of shape {tuple(shape)} strides {tuple(stride)}")  # torch's int64
        start, nbytes = sizes[slot]
        itemsize = dtype.itemsize
        if lo < start or (lo - start) % itemsize:
            raise bad(f"tensor at byte {lo} of a place starting at {start}")
        if math.prod(shape):
            reach = sum((n - 1) * s for n, s in zip(shape, stride)) + 1
            if lo - start + reach * itemsize > nbytes:
                raise bad(f"tensor {tuple(shape)} strides {tuple(stride)} past its {nbytes} bytes")
