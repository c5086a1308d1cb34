"""Stage spans from every process of a loader, kept in shared memory (no message per sample).

Each process writes its spans into its own ring (one row: the main process, or worker id + 1),
so no lock is needed; the main process drains the rings while the loader runs. Datasets mark
their stages with ``stage("read" | "decode" | "augment")``; with no telemetry watching, a mark
costs one global lookup.
"""

from __future__ import annotations

import functools
import multiprocessing.context
import multiprocessing.heap
import multiprocessing.sharedctypes
import os
import struct
import time

import numpy as np
import torch

from .._shared import row_of, this_worker
from .._batch_fill import copy_spans, no_batch, sample_by_sample
from .. import offers

STAGES = ("sample", "read", "decode", "augment", "collate")
_CODE = {name: i for i, name in enumerate(STAGES)}
_SAMPLE, _COLLATE = _CODE["sample"], _CODE["collate"]
SAMPLE_COPY = -1  # the value of a collate span that copied one sample into its batch
_FIELDS = 4  # stage code, start ns, end ns, value (bytes read, samples collated)
_RECORD = struct.Struct("=4q")
_records_struct = functools.lru_cache(maxsize=256)(lambda n: struct.Struct(f"={4 * n}q"))
_COUNT = struct.Struct("=q")
ROWS = 65  # the main process and 64 workers (a session watching more makes a row for each)
CAPACITY = 16384  # spans per row between drains

_active: tuple["SpanLog", int] | None = None  # this process's log and row, while watched
_unwritten: "_TimedIterator | None" = None  # holds sample spans the next collate writes
_proc_io: int | None = None  # this process's /proc/self/io, kept open


def _forget_in_child() -> None:
    """A forked worker finds its own row on first use, and opens its own /proc/self/io (the
    parent's file would count the parent's reads)."""
    global _active, _unwritten, _proc_io
    _active = _unwritten = None
    if _proc_io is not None:
        os.close(_proc_io)
        _proc_io = None


os.register_at_fork(after_in_child=_forget_in_child)


class SpanLog:
    """Rings of (stage, start_ns, end_ns, value) records, one row per process."""

    def __init__(self, rows: int = ROWS, capacity: int = CAPACITY, shared=None):
        self.rows, self.capacity = rows, capacity
        self._row_bytes = 8 * (1 + capacity * _FIELDS)
        if shared is None:
            # A sparse shared file (34 MiB at the defaults): its pages are made as records are
            # written. Only each row's count must start at zero (RawArray would zero-fill it
            # all, ~25 ms and the whole size resident before the first batch).
            self._buffer = multiprocessing.heap.BufferWrapper(rows * self._row_bytes)
            # per row: bytes read by earlier processes of the row, read_chars when this one
            # started recording, and its latest read_chars (updated after each batch it collates)
            self._io = multiprocessing.sharedctypes.RawArray("q", rows * 3)
        else:
            self._buffer, self._io = shared
        # byte view for writing (struct is ~3x cheaper than NumPy per record)
        self._bytes = self._buffer.create_memoryview()
        if shared is None:
            for row in range(rows):
                _COUNT.pack_into(self._bytes, row * self._row_bytes, 0)
        self._view = np.frombuffer(self._bytes, dtype=np.int64).reshape(rows, -1)
        self._drained = np.zeros(rows, dtype=np.int64)
        self.dropped = 0

    def write(self, row: int, code: int, start_ns: int, end_ns: int, value: int = 0) -> None:
        """One record into a row's ring; once the ring is full, over its oldest.

        Args:
            row: the writing process's row (0: the main process; a worker: its id + 1).
            code: the stage, its place in STAGES.
            start_ns: when the stage began (time.monotonic_ns).
            end_ns: when it ended (time.monotonic_ns).
            value: bytes read, or samples collated or timed together; SAMPLE_COPY for a
                collate span that copied one sample into its batch; 0: none.
        """
        head = row * self._row_bytes
        n = _COUNT.unpack_from(self._bytes, head)[0]
        _RECORD.pack_into(self._bytes, head + 8 + (n % self.capacity) * 8 * _FIELDS,
                          code, start_ns, end_ns, value)
        _COUNT.pack_into(self._bytes, head, n + 1)  # published after the record (x86 order)

    def write_records(self, row: int, records: list) -> None:
        """Records given flat (code, start, end, value, code, ...), packed in one call: a
        batch's sample spans cost its worker one write instead of one each."""
        n = len(records) >> 2
        head = row * self._row_bytes
        count = _COUNT.unpack_from(self._bytes, head)[0]
        at = count % self.capacity
        if at + n <= self.capacity:  # the common case: one stretch of the ring
            _records_struct(n).pack_into(self._bytes, head + 8 + at * 8 * _FIELDS, *records)
        else:
            skip = max(0, n - self.capacity)  # more than the ring holds: the oldest are lost
            taken = 4 * skip  # values of ``records`` packed so far (or skipped)
            for first, stop in self._slots(count + skip, count + n):
                m = stop - first
                _records_struct(m).pack_into(self._bytes, head + 8 + first * 8 * _FIELDS,
                                             *records[taken:taken + 4 * m])
                taken += 4 * m
        _COUNT.pack_into(self._bytes, head, count + n)  # published after the records

    def _records(self, row: int) -> np.ndarray:
        return self._view[row, 1:].reshape(self.capacity, _FIELDS)

    def _slots(self, first: int, stop: int) -> list[tuple[int, int]]:
        """Records ``first`` to ``stop`` of a row (counted from its start) as at most two
        slices of its ring."""
        start = first % self.capacity
        end = start + stop - first
        if end <= self.capacity:
            return [(start, end)]
        return [(start, self.capacity), (0, end - self.capacity)]

    def note_reads(self, row: int, first: bool = False, chars: int | None = None) -> None:
        """Publish a read counter in its row (``first``: a new process starts recording): this
        process's, or ``chars`` (the main process counts only its loop's thread: its own
        counter also takes in the reads of every worker it reaps)."""
        chars = _read_chars() if chars is None else chars
        base = 3 * row
        if first:
            self._io[base] += self._io[base + 2] - self._io[base + 1]
            self._io[base + 1] = chars
        self._io[base + 2] = chars

    def read_bytes(self) -> int:
        """Bytes read by the processes that recorded into this log, from when they started."""
        io = self._io
        return sum(io[3 * r] + io[3 * r + 2] - io[3 * r + 1] for r in range(self.rows))

    def drain(self) -> np.ndarray:
        """New records since the last drain, as rows of (process row, stage, start, end, value)."""
        blocks = []
        counts = self._view[:, 0].copy()  # every row's count in one read
        for row in np.flatnonzero(counts != self._drained).tolist():
            written, start = int(counts[row]), int(self._drained[row])
            if written - start > self.capacity:  # the writer lapped us: the oldest are gone
                self.dropped += written - start - self.capacity
                start = written - self.capacity
            records = self._records(row)
            recs = np.concatenate([records[a:b] for a, b in self._slots(start, written)])
            lapped = int(self._view[row, 0]) - self.capacity  # overwritten while we copied
            if lapped > start:
                self.dropped += min(lapped, written) - start
                recs = recs[min(lapped, written) - start:]
            self._drained[row] = written
            blocks.append((row, recs))
        out = np.empty((sum(len(r) for _, r in blocks), 5), dtype=np.int64)
        at = 0
        for row, recs in blocks:
            out[at:at + len(recs), 0], out[at:at + len(recs), 1:] = row, recs
            at += len(recs)
        return out

    def __getstate__(self):
        # Shared with workers as they start (fork or spawn); any other pickle gets a fresh log.
        shared = multiprocessing.context.get_spawning_popen() is not None
        return {"rows": self.rows, "capacity": self.capacity,
                "shared": (self._buffer, self._io) if shared else None}

    def __setstate__(self, state):
        self.__init__(state["rows"], state["capacity"], state["shared"])


def activate(log: SpanLog) -> int:
    """Make ``log`` this process's span log; returns the row this process writes."""
    global _active
    if _active is None or _active[0] is not log:
        row = row_of(this_worker(), log.rows)
        _active = (log, row)
        if row:  # the main process's reads are published by the session
            log.note_reads(row, first=True)
    return _active[1]


def deactivate(log: SpanLog) -> None:
    global _active
    if _active is not None and _active[0] is log:
        _active = None


class _Stage:
    __slots__ = ("code", "start", "bytes")

    def __init__(self, code: int):
        self.code, self.start, self.bytes = code, 0, 0

    def __enter__(self):
        self.start = time.monotonic_ns()
        return self

    def __exit__(self, *exc):
        if _active is not None:
            _active[0].write(_active[1], self.code, self.start, time.monotonic_ns(), self.bytes)
        return False


class _NoStage:
    __slots__ = ("bytes",)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_STAGE = _NoStage()


def stage(name: str):
    """``with stage("decode"): ...`` records how long the block took, in whatever process runs
    it, when a telemetry session watches the loader; otherwise it does nothing. Set ``.bytes``
    on the returned object to record bytes (for "read")."""
    if name not in STAGES[1:4]:  # a sample and the collate_fn are timed already
        raise ValueError(f"unknown stage {name!r}; use one of {STAGES[1:4]}")
    return _stage(_CODE[name])


def sample_stage():
    """The whole of one sample, for a dataset that sets ``fastmm_marks_sample_stage = True`` (then the
    telemetry's wrapper does not time its samples itself, and counts each one once)."""
    return _stage(_SAMPLE)


def _stage(code: int):
    if _active is None:
        _NO_STAGE.bytes = 0
        return _NO_STAGE
    return _Stage(code)


def _timed_collate(log: SpanLog, fn, batch):
    row = activate(log)
    if _unwritten is not None:  # the spans of this batch's samples, read from an iterator
        _unwritten.write()
    start = time.monotonic_ns()
    out = fn(batch)
    end = time.monotonic_ns()
    copies = copy_spans()  # samples copied into the batch as they came
    if copies:
        log.write_records(row, [x for i in range(0, len(copies), 2)
                                for x in (_COLLATE, copies[i], copies[i + 1], SAMPLE_COPY)])
    log.write(row, _COLLATE, start, end, len(batch) if hasattr(batch, "__len__") else 0)
    if row:
        log.note_reads(row)  # once a batch: what the worker has read so far
    return out


# Timing a sample on its own costs ~0.5 us timed alone (a clock read, its record) and a few
# us in a busy worker: of samples under ~0.5 ms a batch times one alone per 0.5 ms of its time
# (at least one, from a place in the batch that moves on each batch) and the others as runs.
_BATCH_NS_PER_TIMED_SAMPLE = 500_000
_MIN_TIMED = 1


class _Forwarding:
    """A wrapper whose user-visible attributes are the wrapped object's, read and written: a
    curriculum's ``loader.dataset.epoch = e``, or torch's worker_init_fn recipe setting
    ``get_worker_info().dataset.start``, reach the user's dataset while it is watched. The
    wrapper's own attributes are those named in _OWN (the first is the wrapped object)."""

    _OWN: tuple = ()

    def __getattr__(self, name):
        if name in self._OWN:
            raise AttributeError(name)
        return getattr(getattr(self, self._OWN[0]), name)

    def __setattr__(self, name, value):
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(getattr(self, self._OWN[0]), name, value)

    @property
    def fastmm_wrapped(self):
        """The wrapped object, for what must reach it and not its attributes (shared.py)."""
        return getattr(self, self._OWN[0])


class TimedDataset(_Forwarding, torch.utils.data.Dataset):
    """A map-style dataset that records each __getitem__ as a "sample" span (unless the dataset
    marks its own samples) and makes stage() marks inside it count."""

    _OWN = ("_inner", "_log", "_marks_samples", "_plan")

    def __init__(self, dataset, log: SpanLog):
        self._inner, self._log = dataset, log
        self._marks_samples = offers.marks_sample_stage(dataset)
        # [samples the next batch times alone (the first batch: all), where they start]; a
        # list, not attributes: setting those goes through _Forwarding's __setattr__
        self._plan = [1 << 62, 0]

    def __len__(self):
        return len(self._inner)

    def __getitem__(self, index):
        log = self._log
        row = activate(log)
        if self._marks_samples:
            return self._inner[index]
        start = time.monotonic_ns()
        item = self._inner[index]
        log.write(row, _SAMPLE, start, time.monotonic_ns())
        return item

    def __getitems__(self, indices):
        """torch's fetcher takes a batch through here. A sample timed on its own is a "sample"
        span; a run of n samples timed together is one with value n (it counts in the
        pipeline's busy time, not in sample_s)."""
        log, inner = self._log, self._inner
        row = activate(log)
        if self._marks_samples:
            return [inner[index] for index in indices]
        if not isinstance(indices, (list, tuple)):  # a batch sampler may yield any iterable
            indices = list(indices)
        n = len(indices)
        plan = self._plan
        first = plan[1] % n if plan[0] < n else 0
        stop = min(n, first + plan[0])  # samples first..stop are timed alone
        plan[1] = first + plan[0]
        clock = time.monotonic_ns
        records = []  # flat: (code, start, end, samples timed together or 0), ...
        start = began = clock()
        try:
            if first:  # samples timed together: one span, its value their number
                items = [inner[index] for index in indices[:first]]
                end = clock()
                records += (_SAMPLE, start, end, first)
                start = end
            else:
                items = []
            with sample_by_sample() as put:
                if put is no_batch:  # every sample's time, back to back
                    for index in indices[first:stop]:
                        items.append(inner[index])
                        end = clock()
                        records += (_SAMPLE, start, end, 0)
                        start = end
                else:  # each sample goes into the batch between spans (collate spans of its own)
                    for position in range(first, stop):
                        item = inner[indices[position]]
                        records += (_SAMPLE, start, clock(), 0)
                        items.append(put(item, position))
                        start = clock()
            if stop < n:
                items += [inner[index] for index in indices[stop:]]
                end = clock()
                records += (_SAMPLE, start, end, n - stop)
                start = end
        finally:  # the batch's spans in one write, not one a span (in place, on tiny
            if records:  # samples, that was ~1% of the loader's rate)
                log.write_records(row, records)
        timed = (start - began) // _BATCH_NS_PER_TIMED_SAMPLE
        plan[0] = timed if timed > _MIN_TIMED else _MIN_TIMED
        return items


class TimedBatchDataset(TimedDataset):
    """For datasets with __getitems__ (torch's fetcher calls it for a whole batch): the call is
    one run of len(indices) samples, unless the dataset marks its own."""

    def __getitems__(self, indices):
        log = self._log
        row = activate(log)
        if self._marks_samples:
            return self._inner.__getitems__(indices)
        samples = max(1, len(indices)) if hasattr(indices, "__len__") else 1  # a run, always
        start = time.monotonic_ns()
        try:
            return self._inner.__getitems__(indices)
        finally:
            log.write(row, _SAMPLE, start, time.monotonic_ns(), samples)


class TimedIterableDataset(_Forwarding, torch.utils.data.IterableDataset):
    """An iterable dataset whose every next() is recorded as a "sample" span (unless the dataset
    it reads, a ShardStream's say, marks its own samples)."""

    _OWN = ("_inner", "_log", "_marks_samples")

    def __init__(self, dataset, log: SpanLog):
        self._inner, self._log = dataset, log
        self._marks_samples = offers.marks_sample_stage(dataset)

    def __iter__(self):
        row = activate(self._log)
        if self._marks_samples:
            return iter(self._inner)
        return _TimedIterator(iter(self._inner), self._log, row)

    def __len__(self):
        return len(self._inner)


class _TimedIterator(_Forwarding):
    """The dataset's iterator, each next() a "sample" span; its own attributes (a resumable
    stream's state_dict) stay reachable. Spans are written a batch at a time (at collate, at
    the iterator's end, or every 64 samples)."""

    _OWN = ("_it", "_log", "_row", "_records")

    def __init__(self, it, log: SpanLog, row: int):
        self._it, self._log, self._row = it, log, row
        self._records = []  # flat, as write_records takes them

    def __iter__(self):
        return self

    def __next__(self):
        global _unwritten
        start = time.monotonic_ns()
        try:
            item = next(self._it)
        except BaseException:  # StopIteration included
            self.write()
            raise
        self._records += (_SAMPLE, start, time.monotonic_ns(), 0)
        if len(self._records) >= 4 * 64:
            self.write()
        else:
            _unwritten = self
        return item

    def write(self) -> None:
        global _unwritten
        if self._records:
            self._log.write_records(self._row, self._records)
            self._records = []
        if _unwritten is self:  # the user's iterator is not kept alive for nothing
            _unwritten = None


class TimedCollate:
    """A collate function recorded as one "collate" span per batch."""

    def __init__(self, fn, log: SpanLog):
        self.fn, self.log = fn, log

    def __call__(self, batch):
        return _timed_collate(self.log, self.fn, batch)

    def rewrap(self, fn) -> "TimedCollate":
        """The same timing around another function (fastmm's workers swap in their own
        collation for torch's default_collate)."""
        return TimedCollate(fn, self.log)


def unwatched(dataset):
    """The dataset under any telemetry wrappers (for type checks: attributes pass through)."""
    while isinstance(dataset, (TimedDataset, TimedIterableDataset)):
        dataset = dataset._inner
    return dataset


def wrap_dataset(dataset, log: SpanLog):
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return TimedIterableDataset(dataset, log)
    if _fetched_item_by_item(dataset):
        return TimedDataset(dataset, log)
    return TimedBatchDataset(dataset, log)


def _fetched_item_by_item(dataset) -> bool:
    """Whether a batch of ``dataset`` is its items one by one, so that each can be timed: no
    ``__getitems__``, or torch's ``Subset`` (``random_split``) over such a dataset, whose
    ``__getitems__`` indexes its dataset item by item."""
    if not getattr(dataset, "__getitems__", None):  # torch's fetcher skips a falsy one too
        return True
    if type(dataset) is TimedDataset:  # watched by another session as well
        return True
    return (type(dataset).__getitems__ is torch.utils.data.Subset.__getitems__
            and _fetched_item_by_item(dataset.dataset))


def _read_chars() -> int:
    """Bytes this process has read so far (``rchar``); 0 where it cannot be known. The file
    stays open: a pread costs 2 us, where psutil's io_counters (it parses the whole file)
    cost workers 18 us a batch."""
    global _proc_io
    try:
        if _proc_io is None:
            _proc_io = os.open("/proc/self/io", os.O_RDONLY | os.O_CLOEXEC)
        return rchar(os.pread(_proc_io, 64, 0))
    except OSError:
        return 0


def rchar(io_head: bytes) -> int:
    """``rchar`` from the start of a /proc .../io file (its first line: "rchar: N")."""
    return int(io_head[6:io_head.index(b"\n")])
