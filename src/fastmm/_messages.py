"""Everything that crosses between the loader's main process and its workers, as typed records.

Main process -> worker, on the worker's index queue: ``Task``, ``Resume``, ``Stop``.
Worker -> main process, on its result pipe: ``Result`` for each task (its batch a
``Packed``), ``Resumed`` for each ``Resume``. On the worker's fd socket, both ways: slabs'
descriptors, and from the main process ``SlabNews`` (slabs.py).
A worker starts from a ``WorkerSpec``: what torch passes its worker loop, the channels above,
and ``Restore``, where a restored or replacement worker begins.

NamedTuples where a record is sent per batch (cheap to pickle), frozen dataclasses elsewhere.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal, NamedTuple


class Task(NamedTuple):
    """Fetch and collate one batch (or one sample, without auto-collation)."""

    send_idx: int  # its place in the epoch's order of tasks
    index: object  # the sampler's indices (None for an IterableDataset)
    spare_s: float  # seconds the loop spent outside next() last step (slabs.py)
    seed: int | None = None  # num_workers="auto": the batch's own seed (autotune.batch_seed)


@dataclass(frozen=True)
class Resume:
    """A new epoch on persistent workers."""

    shared_seed: int  # an IterDataPipe's shared seed for it
    epoch: int | None  # the main process's offers.epoch, for this worker's copy (else None)


@dataclass(frozen=True)
class Stop:
    """Exit the worker loop."""


@dataclass(frozen=True)
class Resumed:
    """A worker has begun the new epoch ``Resume`` asked for."""


class Result(NamedTuple):
    """A worker's answer to a task."""

    send_idx: int
    # error: an ExceptionWrapper; end: the worker's IterableDataset ran out
    status: Literal["data", "error", "end"]
    payload: object  # a Packed batch (collate.pack), or None at "end"
    used: list  # the slots of the slabs the payload lies in
    new: list  # NewSlab: slabs created for it (their fds: on the fd socket)
    rng: object  # the worker's RNG states after the task (encode_rng's) if it changed them
    iter_state: object  # an IterableDataset's resume.iter_state() after the task (resume.py)
    counts: object  # its row of the dataset's skip counts (offers.py) if the task changed it
    # seconds it waited for the task after it had sent its last result (it had made every batch
    # it was given: num_workers="auto" prefetches deeper where the loop waits too)
    waited_s: float = 0.0


class Restore(NamedTuple):
    """Where a worker begins: the RNG states to set (encode_rng's; None: seeded as torch
    seeds a new worker), IterableDataset samples to pull and drop, and the iterator state to go on from
    (resume.py)."""

    rng: object = None
    skip: int = 0
    iter_state: object = None


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything a worker process starts from (``_workers.worker_loop``).

    Args:
        dataset_kind: torch's ``_DatasetKind`` (map-style or iterable).
        dataset: the user's dataset (this process's copy: fork shares it, spawn pickles it).
        auto_collation: whether tasks are batches of indices (a batch sampler is in use).
        collate_fn: the loader's collate_fn.
        drop_last: drop an IterableDataset's last, short batch.
        base_seed: the loader's base seed; the worker seeds torch, random and NumPy from it.
        init_fn: the user's worker_init_fn, or None.
        num_workers: how many workers the loader has.
        transport: the loader's TransportConfig.
        worker_id: this worker's id.
        shared_seed: an IterDataPipe's shared seed for the first epoch.
        restore: where this worker begins (``Restore``).
        start_method: the multiprocessing start method ("fork", "spawn", "forkserver").
        main_pid: the loader's process, which the worker must not outlive.
        share: under fork, the dataset's containers shared with the workers, which the
            worker puts in place of its inherited ones (``shared.DatasetShare``); else None
            (a spawned worker's dataset arrives with them in place).
        index_queue, result_conn, fd_sock, done_event: its channels (see the module).
        ready_conn: under spawn and forkserver, where the worker says (its pid) that it has
            started (its imports done): the main process starts no more workers at once than
            there are cores; else None.
    """

    dataset_kind: int
    dataset: object
    auto_collation: bool
    collate_fn: object
    drop_last: bool
    base_seed: int
    init_fn: object
    num_workers: int
    transport: object
    worker_id: int = -1
    shared_seed: int = 0
    restore: Restore = Restore()
    start_method: str = "fork"
    main_pid: int | None = None
    share: object = None
    index_queue: object = None
    result_conn: object = None
    fd_sock: object = None
    done_event: object = None
    ready_conn: object = None


# -- the slab transport ------------------------------------------------------------------------


class NewSlab(NamedTuple):
    """A slab a worker created for a batch (a Result's ``new``; its descriptor travels on the
    worker's fd socket)."""

    slot: int
    generation: int
    capacity: int


class SlabNews(NamedTuple):
    """The main process's news to a worker, on its fd socket, packed to a fixed size. TABLE:
    the slab table's descriptor comes with it (``channel``: the worker's number in the pool);
    FREE: a slab it may claim, its descriptor with it; GONE: the slab of that slot and
    generation is gone."""

    kind: int
    slot: int = -1
    generation: int = 0
    capacity: int = 0
    channel: int = 0

    TABLE, FREE, GONE = 0, 1, 2

    def pack(self) -> bytes:
        return _NEWS.pack(*self)

    @classmethod
    def unpack(cls, data: bytes) -> "SlabNews":
        return cls(*_NEWS.unpack(data))


_NEWS = struct.Struct("<BiIQi")
SLAB_NEWS_BYTES = _NEWS.size


class Inline(NamedTuple):
    """A storage's bytes carried in the batch's message (a small one): ``start`` is the offset
    in the worker's storage of its first byte."""

    start: int
    data: bytes


class InSlab(NamedTuple):
    """A storage's bytes in a slab: ``nbytes`` from ``offset`` of slab ``slab_id``."""

    start: int
    slab_id: int
    offset: int
    nbytes: int


class TensorSpec(NamedTuple):
    """A tensor of a batch: which of its places (Inline or InSlab) holds its storage, and its
    dtype, shape, strides and first byte there."""

    place: int
    dtype: object
    shape: tuple
    stride: tuple
    lo: int


class Packed(NamedTuple):
    """A batch as it travels: where its tensors' bytes are, the tensors, and the pickle of the
    rest, whose tensors refer to ``tensors`` by number (collate.pack)."""

    places: list
    tensors: list
    payload: bytes
