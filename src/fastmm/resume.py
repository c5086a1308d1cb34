"""Mid-epoch resume: what ``DataLoader.state_dict()`` holds and how a new loader replays it.

A batch is fixed by three things: the sampler's order (drawn from torch's RNG or the loader's
``generator`` when the epoch's first index is drawn), the worker that makes it (round robin:
with ``in_order=True`` batch ``j`` of an epoch goes to worker ``j mod num_workers``), and that
worker's RNG states (torch, ``random``, NumPy) when it starts on it. So the state keeps the RNG
states at the epoch's first draw, how many batches were handed out, the base seed, and each
worker's RNG states after the last batch it handed out. A restored loader replays the sampler from
those states (leaving the caller's RNGs as they were), skips the batches handed out, and sets each
worker's RNGs before its first batch; batches that were prefetched but not handed out are made
again. An IterableDataset has no index to skip to. If it (or the iterator it returns) has
``state_dict()``/``load_state_dict()``, as torchdata's StatefulDataLoader asks of a resumable
iterable dataset, each worker's copy goes on from the state it had after its last batch handed out;
otherwise each worker pulls and drops the samples it had handed out (its iterator must be
deterministic). Then the worker's RNG states are set. With ``in_order=False`` the state also
lists the batches handed out ahead of the first one still missing (by their place in the
sampler's order); the restored loader yields the rest, each once, in whatever order.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import ctypes
import dataclasses
import functools
import json
import math
import pickle
import random
import struct
import sys
import zlib
from typing import NamedTuple

import torch
from torch.utils.data import IterableDataset

from . import offers
from ._wrappers import all_wrapped

VERSION = 1

try:
    import numpy as np
except ImportError:  # numpy is optional for torch, so for its workers' RNG states too
    np = None


# -- RNG states ------------------------------------------------------------------------------


class RngStates(NamedTuple):
    """A process's torch, random and NumPy RNG states as plain, comparable values (a worker
    sends them with each batch that moved them; a state_dict keeps them)."""

    torch: object
    random: object
    numpy: object


def capture_rng(previous: RngStates | None = None) -> RngStates:
    """This process's RNG states. ``previous`` (an earlier capture) lets NumPy's be read
    cheaply when it has not moved."""
    return RngStates(_state_of(torch.default_generator), _random_state(),
                     _numpy_state(None if previous is None else previous[2]))


# _random's RandomObject: PyObject_HEAD; int index; uint32_t state[624]
_RANDOM_RAW_OFFSET = object.__basicsize__
_RANDOM_RAW_BYTES = 4 + 624 * 4
_random_memo: tuple | None = None  # (raw words, gauss_next, getstate()) at the last full read


def _random_raw() -> bytes:
    return ctypes.string_at(id(random._inst) + _RANDOM_RAW_OFFSET, _RANDOM_RAW_BYTES)


def _random_raw_readable() -> bool:
    """Whether ``random``'s generator lies in memory as _random.c lays it out (checked against
    its own getstate once), else its state is always read in full."""
    if type(random._inst).__basicsize__ < _RANDOM_RAW_OFFSET + _RANDOM_RAW_BYTES:
        return False
    index, *words = struct.unpack("=i624I", _random_raw())
    return (*words, index) == super(random.Random, random._inst).getstate()


_RANDOM_RAW_READABLE = _random_raw_readable()


def _random_state() -> tuple:
    """``random.getstate()``. It costs about 11 us, which workers paid after every batch; the
    generator's raw words, read in 1 us, show whether it moved since the last full read."""
    global _random_memo
    if not _RANDOM_RAW_READABLE:
        return random.getstate()
    raw, gauss = _random_raw(), random._inst.gauss_next
    memo = _random_memo
    if memo is not None and memo[0] == raw and memo[1] == gauss:
        return memo[2]
    state = random.getstate()
    if _random_raw() == raw:  # no other thread drew in between: the two agree
        _random_memo = raw, state[2], state
    return state


_MT_STATE_BYTES = 624 * 4 + 4  # NumPy's mt19937_state: uint32_t key[624]; int pos


def _numpy_state(previous: tuple | None) -> tuple | None:
    """NumPy's global RNG state: (key bytes, pos, has_gauss, gauss). ``get_state`` costs about
    45 us, which workers paid after every batch (most of a cheap batch's cost); the generator's
    raw words, read in 1.5 us, show whether it moved. Only using up a cached Gaussian changes the
    state without moving them, so with one cached the state is read in full."""
    if np is None:
        return None
    if previous is not None and not previous[2]:
        bits = getattr(getattr(np.random.mtrand, "_rand", None), "_bit_generator", None)
        if type(bits) is np.random.MT19937:
            raw = ctypes.string_at(bits.ctypes.state_address, _MT_STATE_BYTES)
            if (raw[-4:] == previous[1].to_bytes(4, sys.byteorder, signed=True)
                    and raw[:-4] == previous[0]):
                return previous
    _, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return key.tobytes(), pos, has_gauss, gauss


def apply_rng(state: tuple) -> None:
    torch_state, random_state, numpy_state = state
    _set_state(torch.default_generator, torch_state)
    random.setstate(random_state)
    if numpy_state is not None and np is not None:
        key, pos, has_gauss, gauss = numpy_state
        np.random.set_state(("MT19937", np.frombuffer(key, dtype=np.uint32), pos, has_gauss, gauss))


class SentOnChange:
    """A value a worker sends with a batch only when the batch changed it: its RNG states
    (``read`` = capture_rng), its row of skip counts."""

    def __init__(self, read):
        self._read = read  # read(last value) -> value
        self.last = read(None)

    def changed(self):
        now = self._read(self.last)
        if now == self.last:
            return None
        self.last = now
        return now


@functools.lru_cache(maxsize=16)  # (a generator's state, the same from step to step)
def _b64(data: bytes) -> str:
    """Compressed: torch keeps its 32-bit Mersenne Twister words in 64-bit slots (level 1: as
    small as level 6 for these, at a third of the time)."""
    return base64.b64encode(zlib.compress(data, 1)).decode("ascii")


def _unb64(text: str) -> bytes:
    try:
        return zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
    except (ValueError, zlib.error) as e:
        raise ValueError(f"a damaged fastmm DataLoader state: an RNG state ({e})") from None


def encode_rng(state: tuple) -> dict:
    torch_state, (version, words, gauss), numpy_state = state
    out = {
        "torch": _b64(torch_state),
        "random": {"version": version, "words": _b64(struct.pack(f"<{len(words)}I", *words)),
                   "gauss": gauss},
    }
    if numpy_state is not None:
        key, pos, has_gauss, cached = numpy_state
        out["numpy"] = {"key": _b64(key), "pos": pos, "has_gauss": has_gauss, "gauss": cached}
    return out


def _copy_rng(data: dict) -> dict:
    """A fresh copy of ``encode_rng``'s dict (the caller may change the one it is given)."""
    out = data.copy()
    out["random"] = out["random"].copy()
    if "numpy" in out:
        out["numpy"] = out["numpy"].copy()
    return out


def decode_rng(data: dict) -> tuple:
    r = data["random"]
    raw = _unb64(r["words"])
    _check(len(raw) == 4 * 625 and r["version"] == 3 and _real_or_none(r["gauss"]),
           "a worker's random state")
    words = struct.unpack("<625I", raw)
    numpy_state = None
    if "numpy" in data:
        n = data["numpy"]
        numpy_state = (_unb64(n["key"]), n["pos"], n["has_gauss"], n["gauss"])
        _check(len(numpy_state[0]) == 4 * 624 and _count(n["pos"]) and n["pos"] <= 624
               and n["has_gauss"] in (0, 1) and _real_or_none(n["gauss"]),
               "a worker's NumPy state")
    return _torch_state(data["torch"]), (r["version"], words, r["gauss"]), numpy_state


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"a damaged fastmm DataLoader state: {what}")


def _count(x) -> bool:
    return type(x) is int and x >= 0


def _real_or_none(x) -> bool:
    return x is None or type(x) in (int, float)


def _torch_state(text: str) -> bytes:
    """A torch CPU generator's state, checked for size (set_state would fail later)."""
    raw = _unb64(text)
    _check(len(raw) == len(_state_of(torch.default_generator)), "a torch generator state")
    return raw


def _state_of(generator: torch.Generator) -> bytes:
    return generator.get_state().numpy().tobytes()


def _set_state(generator: torch.Generator, state: bytes) -> None:
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


class LoaderParts(NamedTuple):
    """What a state reads of the parts of a loader that torch's DataLoader lets no one set again
    after ``__init__`` (dataset, sampler, batch_sampler): looked up once per loader, not at every
    ``state_dict()`` (a state every step costs under 1% of a loop, issue 54)."""

    iterable: bool
    samplers: tuple  # the batch sampler, the sampler inside it, the loader's sampler
    stateful_sampler: object | None  # the first of them with state_dict/load_state_dict
    world_part: object | None  # where this rank's place is read (_world)
    skip_counts: object | None  # offers.skip_counts of the dataset
    state_getters: list  # the dataset's own state_dict methods (own_state)

    @classmethod
    def of(cls, loader) -> "LoaderParts":
        # (a default sampler when batch_sampler= was given: the one inside draws then)
        batch_sampler = loader.batch_sampler
        samplers = (batch_sampler, getattr(batch_sampler, "sampler", None), loader.sampler)
        return cls(
            iterable=isinstance(loader.dataset, IterableDataset),
            samplers=samplers,
            stateful_sampler=next((s for s in samplers if _stateful(s)), None),
            world_part=next((part for part in (*samplers, loader.dataset)
                             if hasattr(part, "rank") and (hasattr(part, "num_replicas")
                                                           or hasattr(part, "world_size"))),
                            None),
            skip_counts=offers.skip_counts(loader.dataset),
            state_getters=_own(loader.dataset, "state_dict"))


def sampler_generator(loader) -> torch.Generator | None:
    """The sampler's own generator (``RandomSampler(..., generator=g)``), if it is not the
    loader's: its state must travel too, or a resumed epoch repeats the first epoch's order."""
    for sampler in loader._state_parts.samplers[1:]:
        g = getattr(sampler, "generator", None)
        if isinstance(g, torch.Generator) and g is not loader.generator:
            return g
    return None


def _generator_states(generator, own) -> tuple[bytes, bytes | None, bytes | None]:
    """What a sampler can draw from: torch's default RNG, the loader's generator, its own."""
    return (_state_of(torch.default_generator), None if generator is None else _state_of(generator),
            None if own is None else _state_of(own))


def _set_generator_states(states, generator, own) -> None:
    _set_state(torch.default_generator, states[0])
    for g, state in ((generator, states[1]), (own, states[2])):
        if g is not None and state is not None:
            _set_state(g, state)


class KeepRng:
    """Runs a block without trace on the caller's RNGs: the replay of draws that were already
    made before the state was saved must not make them a second time."""

    def __init__(self, generator=None):
        self.generator = generator

    def __enter__(self):
        self.saved = capture_rng(), None if self.generator is None else _state_of(self.generator)
        return self

    def __exit__(self, *exc):
        apply_rng(self.saved[0])
        if self.generator is not None:
            _set_state(self.generator, self.saved[1])


# -- progress --------------------------------------------------------------------------------


@dataclasses.dataclass
class Progress:
    """Where a loader's latest iterator is in its epoch. The loader keeps it (the iterator may be
    gone when state_dict() is called); a restored one is where the next iterator starts."""

    num_workers: int
    base_seed: int | None = None  # persistent workers keep it for every epoch
    sampler_rng: tuple | None = None  # generator states at the epoch's first draw
    sampler_state: dict | None = None  # the sampler's own state_dict() then, if it has one
    dataset_state: object = None  # an IterableDataset's own state_dict() then
    batches: int = 0  # handed out (or raised) this epoch
    # in_order=False: positions (in the sampler's order) handed out ahead of the first not yet
    # handed out; the batches before it number batches - len(ahead)
    ahead: set = dataclasses.field(default_factory=set)
    done: bool = False  # the epoch ran out
    # per worker, its RNG states after its last batch, as encode_rng gives them
    worker_rng: list = dataclasses.field(default_factory=list)
    worker_batches: list = dataclasses.field(default_factory=list)  # IterableDataset: per worker
    # IterableDataset: per worker (or the one process) its iter_state() after its last batch
    worker_iter_states: list = dataclasses.field(default_factory=list)
    # a MultimodalDataset's: per worker, its row of skip counts after its last batch handed out
    # (this process's view, not saved: state_dict() counts by it)
    worker_counts: list = dataclasses.field(default_factory=list)
    last_worker: int | None = None
    # places in the epoch's sampler order handed out by a loader of another batch size this
    # epoch, as sorted [start, end) ranges: this loader's batches are made of the other places
    handed_out_before: list = dataclasses.field(default_factory=list)
    deal: "Deal | None" = None  # this rank's samples, dealt again at another world size
    shape: dict | None = None  # shape() of the loader as its iterator began (not saved)
    # epochs these workers ran before this one with the same base seed (persistent workers):
    # with num_workers="auto", a part of each batch's seed (autotune.batch_seed)
    epoch: int = 0

    def __post_init__(self):
        self.worker_rng = list(self.worker_rng) or [None] * self.num_workers
        self.worker_batches = list(self.worker_batches) or [0] * self.num_workers
        self.worker_iter_states = list(self.worker_iter_states) or [None] * max(1, self.num_workers)
        self.worker_counts = list(self.worker_counts) or [None] * self.num_workers

    @property
    def first_missing(self) -> int:
        """The place of the first batch not handed out yet; the ones before it all were."""
        return self.batches - len(self.ahead)

    @property
    def mid_epoch(self) -> bool:
        """An iterator of this epoch exists (its base seed and maybe its order are drawn)."""
        return not self.done

    @classmethod
    def starting(cls, num_workers: int, base_seed: int, restore: "Progress | None") -> "Progress":
        """A new iterator's progress: from scratch, or where ``restore`` (a loaded state) was."""
        progress = cls(num_workers, base_seed=base_seed)
        if restore is not None:
            if restore.base_seed is not None:
                progress.worker_rng = list(restore.worker_rng)
                progress.epoch = restore.epoch + (0 if restore.mid_epoch else 1)
            if restore.mid_epoch:  # the sampler tap skips what was handed out
                progress.batches, progress.ahead = restore.batches, set(restore.ahead)
                progress.worker_batches = list(restore.worker_batches)
                progress.worker_iter_states = list(restore.worker_iter_states)
                progress.last_worker = restore.last_worker
                progress.handed_out_before = [list(r) for r in restore.handed_out_before]
                progress.deal = restore.deal
                # (the sampler tap sets them again at the first batch: a state taken before it
                # is the same state)
                progress.sampler_rng = restore.sampler_rng
                progress.sampler_state = restore.sampler_state
            elif restore.base_seed is not None:  # the same persistent workers, a new epoch
                progress.worker_iter_states = carried_iter_states(restore.worker_iter_states)
        return progress

    def next_epoch(self) -> None:
        """A persistent iterator's next epoch: the workers and their RNGs carry on."""
        self.sampler_rng = self.sampler_state = self.dataset_state = self.last_worker = None
        self.batches, self.done, self.ahead, self.handed_out_before = 0, False, set(), []
        self.deal = None
        self.epoch += 1
        self.worker_batches = [0] * self.num_workers
        self.worker_iter_states = carried_iter_states(self.worker_iter_states)

    def handed_out(self, worker_id: int, rng: tuple | None, iter_state: tuple | None,
                   position: int | None = None, counts: list | None = None) -> None:
        """A batch handed out.

        Args:
            worker_id: the worker that made it.
            rng: its worker's RNG states after it; None where the batch did not change them.
            iter_state: its worker's iter_state() after it (an IterableDataset's), or None.
            position: its place in the sampler's order, where batches may come back out of it
                (in_order=False); else None.
            counts: its worker's skip counts after it (a MultimodalDataset's), or None.
        """
        self.count(position)
        self.last_worker = worker_id
        self.worker_batches[worker_id] += 1
        if rng is not None:
            self.worker_rng[worker_id] = rng
        if iter_state is not None:
            self.worker_iter_states[worker_id] = iter_state
        if counts is not None:
            self.worker_counts[worker_id] = counts

    def count(self, position: int | None) -> None:
        """One more batch handed out, from ``position`` in the sampler's order (None: the
        first one not handed out yet)."""
        first_missing = self.first_missing
        self.batches += 1
        if position is not None and position != first_missing:
            self.ahead.add(position)
        else:
            while first_missing + 1 in self.ahead:  # they follow on now
                first_missing += 1
                self.ahead.discard(first_missing)

    def first_worker(self, iterable: bool) -> int:
        """The worker the next task goes to, as the round robin of the saved run had it."""
        if not self.num_workers:
            return 0
        if iterable:  # workers that ran out drop out of the round robin, so follow the last one
            return 0 if self.last_worker is None else (self.last_worker + 1) % self.num_workers
        return self.batches % self.num_workers


_SEVERAL = "fastmm_datasets"  # the states of the datasets a ConcatDataset holds, in order


def _own(dataset, name: str) -> list:
    """The dataset's own method ``name`` (state_dict, load_state_dict), or those of the
    datasets it wraps (a Subset's, a ConcatDataset's), one per dataset."""
    methods = []
    for method in all_wrapped(dataset, name):
        owner = getattr(method, "__self__", method)
        if getattr(method, "__func__", None) is getattr(torch.nn.Module, name, None):
            continue  # a module's weights, not the dataset's place (see _stateful)
        if callable(method) and not any(getattr(m, "__self__", m) is owner for m in methods):
            methods.append(method)
    return methods


def own_state(dataset, getters: list | None = None):
    """The dataset's state_dict() (or the one of the dataset it wraps), None if it has none;
    of a ConcatDataset's datasets, {_SEVERAL: [each one's]}. ``getters``: those methods, where
    they were found already (LoaderParts)."""
    if getters is None:
        getters = _own(dataset, "state_dict")
    if len(getters) > 1:
        return {_SEVERAL: [get() for get in getters]}
    return getters[0]() if getters else None


def _own_loads(dataset, state) -> list:
    """(load_state_dict, its state) for own_state()'s datasets, checked before any is run."""
    if state is None:
        return []
    loads = _own(dataset, "load_state_dict")
    if len(loads) < 2:
        return [(load, state) for load in loads]
    several = state.get(_SEVERAL) if isinstance(state, dict) else None
    if not isinstance(several, list) or len(several) != len(loads):
        raise ValueError(f"the saved dataset state is not one for the {len(loads)} datasets "
                         "with a state that this loader's dataset holds")
    return list(zip(loads, several))


def dataset_state(dataset):
    """A copy of own_state() now, or None if it cannot give one now (an iterable dataset whose state
    exists only once iterated, in its workers): then state_dict() asks it again when called,
    and its error, if any, shows there."""
    try:
        return copy.deepcopy(own_state(dataset))
    except Exception:
        return None


def _stateful(obj) -> bool:
    """Whether ``obj`` keeps a state to resume from (torchdata's Stateful). An nn.Module's own
    state_dict() is its weights, not a place in its samples: asked after every batch, it would
    copy them all each time."""
    if isinstance(obj, torch.nn.Module) and type(obj).state_dict is torch.nn.Module.state_dict:
        return False
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None))


class IterState(NamedTuple):
    """Where an IterableDataset's iterator is (``iter_state``). ``kind``: "iterator" (state:
    its state_dict()), "dataset" (the dataset's), "ended" (it ran out; state: the dataset's,
    carried into the next epoch, or None where the iterator kept it), "carried" (an ended one
    a persistent worker goes on from in the next epoch)."""

    kind: str
    state: object


@dataclasses.dataclass(frozen=True)
class Unavailable:
    """A state_dict() that failed (raised, or gave what cannot be pickled) where torch's loader
    would not have called it: the epoch goes on as with torch's loader, and the loader's
    state_dict() raises, since it cannot say where to resume."""

    owner: str  # "the IterableDataset", "the sampler"
    error: str

    @classmethod
    def of(cls, owner: str, error: Exception) -> "Unavailable":
        return cls(owner, f"{type(error).__name__}: {error}"[:500])

    def fail(self):
        raise RuntimeError(f"fastmm cannot save where this loader is: {self.owner}'s "
                           f"state_dict() failed during the epoch ({self.error})")


def usable(state):
    """A saved state to go on from, or None for one that could not be taken."""
    return None if isinstance(state, Unavailable) else state


def iter_state(dataset, fetcher, ran_out: bool = False, *, sent: bool = False
                 ) -> IterState | None:
    """Where an IterableDataset's iterator is, from the state it keeps itself: "iterator" (its
    state_dict()) if the iterator has one, else "dataset" (the dataset's), else None (then a
    resumed loader pulls and drops the samples handed out). Once the iterator ran out (within
    a batch, or ``ran_out``): "ended" (the dataset's state, which a persistent worker's copy
    carries into the next epoch, or None where the iterator kept the state). A state_dict()
    that raises, or whose state cannot be pickled to travel between processes, gives an
    Unavailable: the batch still comes (torch's loader never asks for the state).

    Args:
        dataset: the IterableDataset (this process's copy).
        fetcher: its fetcher; ``dataset_iter`` is the iterator, ``ended`` says it ran out
            within a batch.
        ran_out: the iterator ran out.
        sent: give the state itself, not a copy: a worker pickles it into its message at once.
    """
    def copied(state):
        pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)  # it must travel; nothing is loaded
        return state if sent else copy.deepcopy(state)

    iterator = fetcher.dataset_iter
    if not (_stateful(iterator) or _stateful(dataset)):
        return None
    try:
        if ran_out or fetcher.ended:
            return IterState("ended",
                               None if _stateful(iterator) else copied(dataset.state_dict()))
        if _stateful(iterator):
            return IterState("iterator", copied(iterator.state_dict()))
        return IterState("dataset", copied(dataset.state_dict()))
    except Exception as e:
        return Unavailable.of("the IterableDataset", e)


def carried_iter_states(states: list) -> list:
    """The iterator states persistent workers start an epoch from: a worker whose iterator ran
    out goes on with the dataset copy it had then (an epoch count it keeps, say)."""
    def carried(s):
        if isinstance(s, Unavailable):  # the loader's state_dict() still says so
            return s
        ran_out = s is not None and s[0] in ("ended", "carried") and s[1] is not None
        return IterState("carried", s[1]) if ran_out else None

    return [carried(s) for s in states]


def resumed_fetcher(make_fetcher, dataset, iter_state: tuple | None):
    """A fetcher made by ``make_fetcher()`` whose iterator goes on from ``iter_state`` (an
    iter_state(), or carried_iter_states()' between epochs): the dataset's state is loaded before
    iter() is called, the iterator's after (torchdata's order). The state of a copy whose
    iterator ran out goes, as in torchdata, to an iterator that runs out (pulled once), so a
    dataset that starts its next iterator where its state says (torchdata's and Hugging Face's
    resumable datasets: at the end) uses it up there; a carried one's next epoch then gets an
    iterator of its own (without that, a restored persistent worker's epoch was empty). The
    pull leaves the RNGs as they were."""
    kind, state = iter_state if iter_state is not None else (None, None)
    if kind in ("dataset", "ended", "carried") and state is not None:
        dataset.load_state_dict(state)
    fetcher = make_fetcher()
    if kind == "iterator":
        if not _stateful(fetcher.dataset_iter):
            raise ValueError("the saved state is of the dataset's iterator, but iter(dataset) "
                             "now returns one without load_state_dict()")
        fetcher.dataset_iter.load_state_dict(state)
    if kind in ("ended", "carried"):
        if state is not None:
            with KeepRng():  # the run that saved it drew nothing here
                next(fetcher.dataset_iter, None)
        if kind == "carried":
            return make_fetcher()
        fetcher.ended = True
    return fetcher


class SamplerTap:
    """The epoch's index-sampler iterator. At the first draw it records what the order depends
    on (generator states, the sampler's own state), or, restoring, replays a recorded epoch from
    them and skips the batches already handed out. ``position``: the place of the batch it
    gave last in the epoch's order."""

    def __init__(self, loader, progress: Progress, replay: Progress | None):
        # not the loader itself: a persistent iterator would close a reference cycle through it
        self._generator = loader.generator
        self._own_generator = sampler_generator(loader)
        self._index_sampler = loader._index_sampler
        self._batch_sampler = loader.batch_sampler  # (a BatchSampler where handed_out is kept)
        self._sampler = loader._state_parts.stateful_sampler
        self._progress = progress
        # an epoch whose first index was not drawn yet draws it live, as it would have
        self._replay = replay if replay is not None and replay.sampler_rng is not None else None
        self._it = None
        self.position = -1

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._start()
        self.position, batch = next(self._it)
        return batch

    def _start(self) -> None:
        p, replay, sampler, generator = self._progress, self._replay, self._sampler, self._generator
        if replay is None:
            try:
                p.sampler_state = sampler.state_dict() if sampler is not None else None
            except Exception as e:  # torch's loader never asks: the epoch goes on
                p.sampler_state = Unavailable.of("the sampler", e)
            p.sampler_rng = _generator_states(generator, self._own_generator)
            self._it = enumerate(iter(self._index_sampler))
            return
        p.sampler_rng, p.sampler_state = replay.sampler_rng, replay.sampler_state
        first_missing, ahead = replay.first_missing, replay.ahead
        order = None  # the epoch's sample order, where it is not the batch sampler's
        # the caller's RNGs are kept; the loader's generator and the sampler's own go on from
        # the epoch's draws (a sampler may draw from them as it goes: replacement=True)
        with KeepRng():
            _set_generator_states(replay.sampler_rng, generator, self._own_generator)
            if sampler is not None and replay.sampler_state is not None:
                sampler.load_state_dict(replay.sampler_state)
            if replay.deal is not None:
                order = iter(replay.deal.indices(self._batch_sampler.sampler))
            elif replay.handed_out_before:
                order = iter(self._batch_sampler.sampler)
            it = enumerate(iter(self._index_sampler) if order is None else _rest_batches(
                order, self._batch_sampler, replay.handed_out_before))
            drawn = 0
            for first in it:  # the batches handed out, up to the first one that was not
                drawn = first[0] + 1
                if first[0] >= first_missing and first[0] not in ahead:
                    break
            else:
                if drawn < first_missing:
                    raise ValueError(
                        f"the restored epoch has {drawn} batches, but {first_missing} were handed "
                        f"out before the state was saved: the sampler "
                        f"({type(sampler or self._index_sampler).__name__}) does not replay its "
                        "epoch from the state it had when the epoch began (torchdata's "
                        "StatefulDistributedSampler keeps its place in the epoch instead). Use "
                        "fastmm.DistributedSampler, or resume from a state saved between epochs."
                    )
                first = _END
        self._it = iter(()) if first is _END else _chain(
            first, (b for b in it if b[0] not in ahead))


_END = object()


def _rest_batches(order, batch_sampler, handed_out: list):
    """The batches of an epoch part of which was handed out at another batch size: the
    sample ``order`` without the places in ``handed_out``, in batches as ``batch_sampler``
    makes them (its size, its drop_last)."""
    batch, size = [], batch_sampler.batch_size
    ranges = iter(handed_out)
    start, end = next(ranges, (None, None))
    for place, index in enumerate(order):
        while end is not None and place >= end:
            start, end = next(ranges, (None, None))
        if start is not None and place >= start:
            continue
        batch.append(index)
        if len(batch) == size:
            yield batch
            batch = []
    if batch and not batch_sampler.drop_last:
        yield batch


def _places(handed_out: list, start: int, end: int) -> list[list[int]]:
    """The epoch's places of places ``start`` .. ``end - 1`` of the rest (the places not in
    ``handed_out``), as ranges."""
    out, offset, gap_start = [], 0, 0  # offset: the rest's places before gap_start
    for r_start, r_end in [*handed_out, (None, None)]:
        length = None if r_start is None else r_start - gap_start
        lo, hi = max(start, offset), end if length is None else min(end, offset + length)
        if lo < hi:
            out.append([gap_start + lo - offset, gap_start + hi - offset])
        if r_start is None:
            break
        offset += length
        gap_start = r_end
    return out


def merge_places(ranges: list) -> list[list[int]]:
    """Sorted, disjoint ranges covering ``ranges``."""
    out = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def handed_out_places(p: Progress, batch_size: int) -> list[list[int]]:
    """Every place of the epoch's sampler order handed out so far, as sorted ranges: the
    earlier shapes' and this one's batches (``batch_size`` each; the epoch's last one may be
    shorter, and its range runs past the end harmlessly)."""
    before = p.handed_out_before
    ranges = list(before) + _places(before, 0, p.first_missing * batch_size)
    for position in p.ahead:
        ranges += _places(before, position * batch_size, (position + 1) * batch_size)
    return merge_places(ranges)


def _chain(first, rest):
    yield first
    yield from rest


# -- another world size mid-epoch ------------------------------------------------------------


def _total_size(samples: int, world: int, drop_last: bool) -> int:
    """How many places torch's DistributedSampler deals ``samples`` into for ``world`` ranks:
    padded up to a multiple of ``world`` by repeating its first ones, or (``drop_last``) cut
    down to one."""
    if drop_last and samples % world:
        return math.ceil((samples - world) / world) * world
    return math.ceil(samples / world) * world


def _ranges(mask) -> list[list[int]]:
    """The True places of a boolean array, as sorted [start, end) ranges."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    return [[int(a), int(b)] for a, b in zip(edges[::2], edges[1::2])]


def _mask(ranges: list, size: int):
    mask = np.zeros(size, bool)
    for start, end in ranges:
        mask[start:min(end, size)] = True
    return mask


class Deal(NamedTuple):
    """A rank's samples for the rest of an epoch that a job of another world size began: the
    epoch's places as ``order_world`` ranks' DistributedSampler dealt them, less those
    handed out before (``before``, ranges), dealt again to ``world`` ranks as DistributedSampler
    deals (the rest padded by repeating its first places, or cut, to a multiple of ``world``),
    this one ``rank``."""

    order_world: int
    before: list
    rank: int
    world: int

    def places(self, total: int, drop_last: bool):
        """The epoch's places this rank takes, in order (of ``total``)."""
        rest = np.flatnonzero(~_mask(self.before, total))
        if not len(rest):
            return rest
        dealt = _total_size(len(rest), self.world, drop_last)
        return rest[np.arange(self.rank, dealt, self.world) % len(rest)]

    def indices(self, sampler) -> list[int]:
        """The sample indices this rank takes, from ``sampler`` (a DistributedSampler at the
        epoch): its order as ``order_world`` ranks would split it, then dealt as above. The
        sampler's own pass is taken too, so it moves on to its next epoch as it would have."""
        order = np.empty(_total_size(len(sampler.dataset), self.order_world, sampler.drop_last),
                         np.int64)
        split = copy.copy(sampler)
        split.num_replicas = self.order_world
        split.num_samples, split.total_size = len(order) // self.order_world, len(order)
        for rank in range(self.order_world):
            split.rank = rank
            order[rank::self.order_world] = list(torch.utils.data.DistributedSampler.__iter__(split))
        next(iter(sampler), None)
        return order[self.places(len(order), sampler.drop_last)].tolist()


def _own_deal(state: dict) -> Deal:
    rank, world = state["world"]
    return Deal(*state["deal"]) if state.get("deal") else Deal(world, [], rank, world)


def dealt_anew(loader, states: list) -> dict:
    """This rank's state for the rest of an epoch that ``states`` (one per rank of a job of
    another world size, as each saved it) began: every place any of them handed out stays out,
    the rest is dealt to this loader's ranks (``Deal``), from its first batch."""
    now = _world(loader)
    sampler = getattr(loader.batch_sampler, "sampler", None)
    if (now is None or type(loader.batch_sampler) is not torch.utils.data.BatchSampler
            or not isinstance(sampler, torch.utils.data.DistributedSampler)):
        raise ValueError(
            "resuming mid-epoch at another world size needs a map-style loader whose batches come "
            "from torch's BatchSampler over a DistributedSampler (fastmm's or torch's); this "
            f"one has {type(loader.batch_sampler).__name__} over {type(sampler).__name__}")
    world = _every_rank_once(states)
    deals = {(d.order_world, json.dumps(d.before), d.world) for d in map(_own_deal, states)}
    # (a rank whose epoch drew nothing yet has no sampler state of it)
    epochs = {json.dumps(s["sampler"].get("epoch")) for s in states
              if isinstance(s.get("sampler"), dict)}
    if len(deals) > 1 or len(epochs) > 1 or any(s["epoch_done"] for s in states):
        raise ValueError("the ranks' states are not of one epoch of one job")
    first = _own_deal(states[0])
    total = _total_size(states[0]["samples"], first.order_world, sampler.drop_last)
    handed_out = _mask(first.before, total)
    for state in states:
        places = _own_deal(state).places(total, sampler.drop_last)
        p = Progress(state["num_workers"], batches=state["batches"], ahead=set(state["ahead"]),
                     handed_out_before=state.get("handed_out_before", []))
        for start, end in handed_out_places(p, state["batch_size"]):
            handed_out[places[start:end]] = True
    template = next(s for s in states if s["world"][0] == now[0] % world)
    drawn = next((s for s in states if s["sampler_rng"] is not None), None)
    workers = len(template["workers"])
    return template | {
        "world": now, "batches": 0, "ahead": [], "handed_out_before": [],
        "workers": [None] * workers, "worker_batches": [0] * workers, "last_worker": None,
        # the epoch's order as it was drawn (no rank drew yet: this one draws it, as its own)
        "sampler_rng": None if drawn is None else drawn["sampler_rng"],
        "sampler": template["sampler"] if drawn is None else drawn["sampler"],
        "deal": None if drawn is None else [first.order_world, _ranges(handed_out), *now]}


# -- the state as JSON -----------------------------------------------------------------------


def _world(loader) -> list[int] | None:
    """This rank's place, from a distributed sampler, or an iterable dataset that splits by rank."""
    part = loader._state_parts.world_part
    if part is None:
        return None
    size = part.num_replicas if hasattr(part, "num_replicas") else part.world_size
    return [int(part.rank), int(size)]


def shape(loader) -> dict:
    """What must not change between saving and restoring mid-epoch."""
    iterable = loader._state_parts.iterable
    return {
        "kind": "iterable" if iterable else "map",
        "num_workers": loader.num_workers,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "samples": None if iterable else _len_or_none(loader.dataset),
        "world": _world(loader),
    }


def _len_or_none(dataset) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def encode(loader, progress: Progress | None) -> dict:
    p = progress or Progress(loader.num_workers, done=True)
    parts = loader._state_parts
    sampler, own = parts.stateful_sampler, sampler_generator(loader)
    # the workers that make the next batch: this iterator's, or (between epochs) fresh ones
    same_workers = loader.num_workers > 0 and (p.mid_epoch or loader.persistent_workers)
    needed = [p.sampler_state] if p.mid_epoch else []
    replayed = p.mid_epoch and p.sampler_rng is not None
    if parts.iterable and (p.mid_epoch or same_workers):
        needed += p.worker_iter_states
    for state in needed:
        if isinstance(state, Unavailable):
            state.fail()
    state = {
        "fastmm_loader_state": VERSION,
        **(p.shape if p.mid_epoch and p.shape is not None else shape(loader)),
        "persistent_workers": loader.persistent_workers,
        "epoch_done": not p.mid_epoch,
        "batches": p.batches if p.mid_epoch else 0,
        "ahead": sorted(p.ahead) if p.mid_epoch else [],
        "base_seed": p.base_seed if same_workers else None,
        "seed_epoch": p.epoch,
        "sampler_rng": None if p.sampler_rng is None or not p.mid_epoch else {
            "torch": _b64(p.sampler_rng[0]),
            "generator": None if p.sampler_rng[1] is None else _b64(p.sampler_rng[1]),
            "sampler_generator": None if p.sampler_rng[2] is None else _b64(p.sampler_rng[2]),
        },
        # mid-epoch: the sampler as the epoch began; between epochs: as the next one begins
        "sampler": p.sampler_state if p.mid_epoch else (
            sampler.state_dict() if sampler is not None else None),
        "workers": [None if s is None or not same_workers else _copy_rng(s)
                    for s in p.worker_rng],
        "worker_batches": list(p.worker_batches) if p.mid_epoch else [0] * p.num_workers,
        # an IterableDataset's: mid-epoch, after each worker's last batch; between epochs,
        # persistent workers' dataset copies as their epoch ran out
        "worker_streams": [None if s is None else list(s) for s in p.worker_iter_states]
        if parts.iterable and (p.mid_epoch or same_workers) else None,
        "last_worker": p.last_worker if p.mid_epoch else None,
        "handed_out_before": [list(r) for r in p.handed_out_before] if p.mid_epoch else [],
        "deal": list(p.deal) if p.mid_epoch and p.deal is not None else None,
        # the generators where they are now; mid-epoch, the replay of the epoch's draws puts them
        # there (and not where the draws for batches made ahead put them)
        "generator": None if loader.generator is None or replayed
        else _b64(_state_of(loader.generator)),
        "sampler_generator": None if own is None or replayed else _b64(_state_of(own)),
    }
    # an IterableDataset: its state as the epoch began, as for the sampler; the restored loader
    # pulls the samples handed out again, or loads each worker's iterator state over it
    if p.mid_epoch and p.dataset_state is not None:
        state["dataset"] = p.dataset_state
    elif parts.iterable and loader.num_workers > 0:
        # the workers iterate copies and keep their states; this one, never iterated, may have
        # none to give (torchdata does not ask it)
        state["dataset"] = dataset_state(loader.dataset)
    else:
        counters = parts.skip_counts
        with (counters.handed_out(p.worker_counts) if counters is not None and p.mid_epoch
              else contextlib.nullcontext()):
            state["dataset"] = own_state(loader.dataset, parts.state_getters)
    return state


def decode(loader, state: dict) -> Progress:
    """The Progress a restored loader starts from; raises ValueError where resuming would
    reorder, repeat or skip samples, or where the state is damaged (fuzz/fuzz.py state).
    The whole state is read and checked before anything is applied; the sampler's and the
    dataset's own load_state_dict run last, their errors their own."""
    if isinstance(state, list):  # every rank's, saved at some world size
        state = _this_ranks(loader, state)
    try:
        p, sampler_state, generator_states, stopped = _read(loader, state)
        dataset_loads = _own_loads(loader.dataset, state.get("dataset"))
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise ValueError(f"a damaged fastmm DataLoader state ({type(e).__name__}: {e})") from None
    if sampler_state is not None:
        loader._state_parts.stateful_sampler.load_state_dict(sampler_state)
    for generator, generator_state in generator_states:
        _set_state(generator, generator_state)
    for load, dataset_state_dict in dataset_loads:
        load(dataset_state_dict)
    if stopped is not None:  # a stream's epoch begun at another shape: the rest at this one
        loader.dataset.rest_of_epoch(stopped)
    return p


def _this_ranks(loader, states: list) -> dict:
    """This loader's state from every rank's: its own where the world is the same, else the
    rest of the epoch dealt to it (``dealt_anew``); a single state as it is."""
    for s in states or [None]:
        if not isinstance(s, dict) or s.get("fastmm_loader_state") != VERSION:
            raise ValueError(f"not a fastmm DataLoader state in the list: {s!r:.80}")
    own = [s for s in states if s.get("world") == _world(loader)]
    if len(states) == 1 and (own or (states[0].get("world") or [0, 0])[1] != 1):
        return states[0]  # (a one-rank job's state is every rank's)
    if len(own) == 1 and all(s.get("world", [0, 0])[1] == own[0]["world"][1] for s in states):
        return own[0]
    if all(s.get("epoch_done") for s in states):  # between epochs any shape goes on as it is
        rank = (_world(loader) or [0, 1])[0]
        return next((s for s in states if s.get("world", [0, 1])[0] == rank % len(states)),
                    states[0])
    if all(s.get("kind") == "iterable" for s in states):
        return _stream_anew(loader, states)
    return dealt_anew(loader, states)


def _every_rank_once(states: list) -> int:
    """The saved job's world size, where ``states`` hold each of its ranks once."""
    worlds = sorted(tuple(s["world"]) for s in states)
    world = worlds[0][1]
    if worlds != [(rank, world) for rank in range(world)]:
        raise ValueError(f"resuming at another world size needs the state of every rank of the "
                         f"saved job, once each: got ranks {worlds}")
    return world


def _stopped_place(state: dict) -> dict:
    """A saved rank's place in its stream's epoch, as ``rest_of_epoch`` reads it."""
    return {"rank": state["world"][0], "world": state["world"][1],
            "num_workers": state["num_workers"], "stream": state["dataset"],
            "slots": [None if s is None else "ended" if s[0] == "ended" else s[1]
                      for s in state["worker_streams"]]}


def _stream_anew(loader, states: list) -> dict:
    """This rank's state for the rest of a stream's epoch that ``states`` (every rank's of a
    job of another world size) began: its stream deals out what no rank read (``stopped``)."""
    if not callable(getattr(loader.dataset, "rest_of_epoch", None)) or _world(loader) is None:
        raise ValueError(
            "resuming an IterableDataset mid-epoch at another world size needs one that deals "
            f"out the rest of its epoch (fastmm's ShardStream); this loader has "
            f"{type(loader.dataset).__name__}")
    _every_rank_once(states)
    epochs = {json.dumps(s["dataset"].get("epoch")) for s in states
              if isinstance(s.get("dataset"), dict)}
    if len(epochs) != 1 or any(s["epoch_done"] for s in states):
        raise ValueError("the ranks' states are not of one epoch of one job")
    return states[0] | {"world": _world(loader), "stopped": [_stopped_place(s) for s in states]}


def _elastic(loader, state: dict, now: dict, changed: list[str]) -> bool:
    """Whether the rest of a map-style epoch saved at another shape can be dealt out at this
    one, each sample not handed out once: another worker count (the same batches, fresh worker
    RNGs), another batch size (the sampler's order re-batched, where both loaders' batches
    come from torch's BatchSampler).

    Args:
        loader: the loader restoring.
        state: the saved state.
        now: the loader's own shape (``shape``).
        changed: the keys of the shape that differ.
    """
    if now["kind"] == "iterable":  # a stream that deals out the rest of its epoch
        return (set(changed) <= {"num_workers", "batch_size"}
                and callable(getattr(loader.dataset, "rest_of_epoch", None)))
    if not set(changed) <= {"num_workers", "batch_size"}:
        return False
    return "batch_size" not in changed or (
        state["batch_size"] is not None and now["batch_size"] is not None
        and type(loader.batch_sampler) is torch.utils.data.BatchSampler)


def _read(loader, state: dict) -> tuple[Progress, object, list, list | None]:
    """The Progress in ``state``, and the states to set now (between epochs, the sampler's;
    the loader's generator and the sampler's own, as (generator, state) pairs), checked; and
    where a stream's epoch was begun at another shape, the stopped ranks' places in it (else
    None)."""
    if not isinstance(state, dict) or state.get("fastmm_loader_state") != VERSION:
        raise ValueError(
            "not a fastmm DataLoader state (version "
            f"{state.get('fastmm_loader_state') if isinstance(state, dict) else None!r}, "
            f"expected {VERSION})"
        )
    mid_epoch = not state["epoch_done"]
    now = shape(loader)
    changed = [k for k in now if state[k] != now[k]] if mid_epoch else []
    stopped = state.get("stopped") if mid_epoch else None  # (_stream_anew: every rank's)
    if mid_epoch and now["kind"] == "iterable" and changed and stopped is None:
        stopped = [_stopped_place(state)]
    if changed and not _elastic(loader, state, now, changed):
        raise ValueError(
            "cannot resume mid-epoch with a different loader: " + "; ".join(
                f"{k}: saved {state[k]!r}, now {now[k]!r}" for k in changed)
            + ". The batches left in the epoch would differ (samples repeated, skipped or "
            "reordered, or other augmentation draws). A map-style dataset's loader may change "
            "num_workers, and batch_size where its batches come from torch's BatchSampler; a "
            "ShardStream's, num_workers and batch_size; either, the world size, given every "
            "rank's state (load_state_dict([rank0_state, rank1_state, ...])). Otherwise resume "
            "with the same settings, or from a state saved at an epoch boundary."
        )
    if not mid_epoch and state["kind"] != now["kind"]:
        raise ValueError(f"the state is for a {state['kind']}-style dataset, this loader has a "
                         f"{now['kind']}-style one")
    same_workers = (state["num_workers"] == loader.num_workers
                    and state["persistent_workers"] == loader.persistent_workers)
    p = Progress(loader.num_workers)
    # the saved workers' base seed; mid-epoch at another shape, fresh worker RNGs from it (the
    # same on every resume); else a new worker layout draws one, as a new iterator does
    if same_workers or changed:
        p.base_seed = state["base_seed"]
        p.epoch = state.get("seed_epoch", 0)  # (older states lack it)
        _check((p.base_seed is None or _count(p.base_seed)) and _count(p.epoch), "base_seed")
    if same_workers:
        _check(len(state["workers"]) == loader.num_workers, "workers")
        for rng in state["workers"]:
            if rng is not None:
                decode_rng(rng)  # (checked here; kept as encode_rng gives them, as workers send)
        p.worker_rng = [None if s is None else _copy_rng(s) for s in state["workers"]]
    sampler_state = None
    if mid_epoch:
        p.batches = state["batches"]
        p.ahead = set(state.get("ahead", ()))  # states saved before in_order=False lack it
        p.worker_batches = list(state["worker_batches"])
        p.last_worker = state["last_worker"]
        p.handed_out_before = state.get("handed_out_before", [])  # (older states lack it)
        deal = state.get("deal")
        p.deal = None if deal is None else Deal(int(deal[0]), [list(r) for r in deal[1]],
                                                int(deal[2]), int(deal[3]))
        _check(_count(p.batches) and all(map(_count, p.ahead)) and len(p.ahead) <= p.batches
               and all(a > p.first_missing for a in p.ahead), "ahead")
        before = p.handed_out_before
        _check(isinstance(before, list) and all(
            isinstance(r, list) and len(r) == 2 and all(map(_count, r)) and r[0] < r[1]
            for r in before) and merge_places(before) == before, "handed_out_before")
        if changed or stopped:  # another shape: the rest of the epoch at this one (_elastic)
            if stopped:  # (the stream deals it: rest_of_epoch)
                p.batches, p.ahead, p.handed_out_before = 0, set(), []
            elif "batch_size" in changed:
                p.handed_out_before = handed_out_places(p, state["batch_size"])
                p.batches, p.ahead = 0, set()
            p.worker_batches, p.last_worker = [0] * loader.num_workers, None
            p.worker_rng = [None] * loader.num_workers  # (fresh, from the base seed)
        _check(_count(p.batches) and len(p.worker_batches) == loader.num_workers
               and all(map(_count, p.worker_batches)) and sum(p.worker_batches) <= p.batches
               and (p.last_worker is None or _count(p.last_worker)
                    and p.last_worker < max(1, loader.num_workers)), "batch counts")
        rng = state["sampler_rng"]
        p.sampler_rng = None if rng is None else tuple(
            None if rng.get(k) is None else _torch_state(rng[k])
            for k in ("torch", "generator", "sampler_generator"))
        _check(rng is None or p.sampler_rng[0] is not None, "sampler_rng")
        p.sampler_state = state["sampler"]
        if now["kind"] == "iterable":
            p.dataset_state = state.get("dataset")
    else:
        p.done = True
        if loader._state_parts.stateful_sampler is not None:
            sampler_state = state["sampler"]
    iter_states = state.get("worker_streams")  # (saved under its first name; older states lack it)
    if (iter_states is not None and now["kind"] == "iterable" and (mid_epoch or same_workers)
            and not stopped):
        _check(isinstance(iter_states, list) and len(iter_states) == max(1, loader.num_workers)
               and all(s is None or isinstance(s, (list, tuple)) and len(s) == 2
                       and s[0] in ("iterator", "dataset", "ended", "carried")
                       for s in iter_states),
               "worker_streams")
        p.worker_iter_states = [None if s is None else tuple(s) for s in iter_states]
    # the generators' states now (a mid-epoch replay then sets the sampler's own from the epoch's)
    generator_states = [(g, _torch_state(state[key])) for g, key in (
        (loader.generator, "generator"), (sampler_generator(loader), "sampler_generator"))
        if g is not None and state.get(key) is not None]
    return p, sampler_state, generator_states, stopped
