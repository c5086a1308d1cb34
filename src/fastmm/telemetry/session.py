"""A telemetry session: watch a DataLoader (torch's, untouched, or fastmm's), mark the loop's
steps, and get the same metrics for either.

    tm = fastmm.telemetry.Telemetry()
    for batch in tm.watch(loader):                  # queue wait, step time, first batch ...
        with tm.h2d(batch):                         # host-to-device copy (CUDA events on GPU)
            batch = batch.to("cuda", non_blocking=True)
        with tm.compute():                          # the model's step
            ...
    print(tm.table()); tm.export("telemetry/")      # summary.json, timeseries.jsonl, trace.json

Watching swaps the loader's dataset and collate_fn for timing wrappers (the loader object is
otherwise untouched; ``unwatch()`` puts them back). Per-sample stage spans travel through shared
memory (recorder.py); a sampler thread reads processes and host (sampler.py).
"""

from __future__ import annotations

import sys
import threading
import time
import weakref

import numpy as np
import torch

from .. import offers
from . import export
from .metrics import DISTRIBUTIONS, METRICS, Distribution
from .recorder import (_COLLATE, _SAMPLE, SAMPLE_COPY, STAGES, SpanLog, TimedCollate,
                       _Forwarding, deactivate, rchar, wrap_dataset)
from .sampler import Sampler, baseline


def _skipped(dataset) -> int:
    """Samples the datasets ``dataset`` is or wraps (Subset, ShardStream, ConcatDataset) left
    out or replaced so far, in every process, where they count them (offers.py)."""
    counters = offers.skip_counts(dataset)
    return counters.met() if counters is not None else 0


class Telemetry:
    """One session of measurements over one loader (any number of epochs).

    ``trace``: keep every span for a Chrome/Perfetto trace (export writes trace.json); memory
    then grows with the run (~40 bytes a span). Without it a session's memory is bounded:
    latencies and samples go into ``Distribution``s, and past MAX_SERIES_ROWS the time
    series keeps every other row (then every 4th, ...), evenly over the run.
    ``interval_s``: how often processes and host are sampled; ``pss_interval_s``: how often
    PSS, USS and ``loader_host_bytes`` are, once an epoch has run a while (they cost the kernel
    a page-table walk per process; an epoch's first sweeps come sooner: sampler.py); None:
    only once, as the epoch ends, for runs whose timing a walk of every mapped page would
    disturb."""

    MAX_SERIES_ROWS = 20_000  # ~1.1 h at interval_s=0.2, ~20 MB with a few workers

    def __init__(self, *, trace: bool = False, interval_s: float = 0.2,
                 pss_interval_s: float | None = 5.0):
        self.trace = trace
        self.interval_s, self.pss_interval_s = interval_s, pss_interval_s
        self.log = SpanLog()
        self.loader = None
        self._restore = None
        self._sampler: Sampler | None = None  # runs while an epoch does
        self._base = None  # sampler.baseline() before the workers of the running epoch began
        self._series: list[dict] = []  # the sampler's rows kept for export
        self._row_stride = 1  # keep one row of this many
        self._rows_seen = 0
        self._sampled = _SampledStats()
        self._sampler_cpu_s = 0.0
        self._loop_tid = threading.get_native_id()  # the thread that iterates the loader
        self._iterator = None
        self._epochs = weakref.WeakSet()  # the _EpochIterators running
        self._t0_ns = time.monotonic_ns()
        self._spans: list = []  # drained worker/main spans (numpy blocks), with trace only
        self._stages = {name: Distribution() for name in STAGES}
        self._sample_runs_s = 0.0  # samples fetched together, timed as one (recorder.py)
        self._copies_s: dict[int, float] = {}  # per worker row: copies not yet in a batch
        self._loop = {k: Distribution() for k in (
            "queue_wait_s", "step_s", "first_batch_s", "epoch_start_s", "h2d_s")}
        self._loop_events: list[tuple[str, int, int]] = []  # (name, start ns, end ns) for trace
        self._gpu_pending: list[tuple[str, int, object, object]] = []  # name, start ns, events
        self._gpu: list[tuple[str, int, float]] = []  # (name, host start ns, GPU s) for trace
        self._gpu_compute_s = 0.0
        self._h2d_bytes = 0
        self._samples = self._batches = self._failed = self._restarts = 0
        self._tuning: list[dict] = []  # num_workers="auto": each change, as it was made
        self._settled: dict | None = None  # and where it stands
        self._collated = 0  # samples the collate spans counted (len of each batch's list)
        self._skipped_before = 0
        self._wall_s = 0.0  # of the epochs that ended
        self._epoch_since_ns = None  # when the running epoch began

    # -- watching ----------------------------------------------------------------------------

    def watch(self, loader, *, _iterate=None) -> "Watched":
        """Start measuring ``loader``; iterate the returned object instead of the loader.
        (``_iterate``: how to start an epoch without coming back here; fastmm.DataLoader's
        own FASTMM_TELEMETRY path passes torch's __iter__.)"""
        if self.loader is not None and self.loader is not loader:
            raise ValueError("a Telemetry session watches one loader; start another session")
        if self._restore is None:  # not watching it now (first time, or after unwatch())
            if self.loader is None and loader.num_workers >= self.log.rows:
                self.log = SpanLog(rows=loader.num_workers + 1)  # a ring for every worker
            _restart_persistent_workers(loader)  # started without the wrappers
            dataset, collate_fn = loader.dataset, loader.collate_fn
            object.__setattr__(loader, "dataset", wrap_dataset(dataset, self.log))
            loader.collate_fn = TimedCollate(collate_fn, self.log)
            self._restore = (loader.dataset, loader.collate_fn)  # this session's wrappers
            if self.loader is None:
                self._skipped_before = _skipped(dataset)  # a dataset counts over its life
            self.loader = loader
            self._note_loop_reads(first=True)
        return Watched(self, loader, _iterate or (lambda: iter(loader)))

    def unwatch(self) -> None:
        """Put the loader's own dataset and collate_fn back (this session's wrappers only,
        wherever another session's sit) and stop sampling; persistent workers restart
        without the wrappers."""
        self._stop_sampler()
        if self.loader is not None and self._restore is not None:
            my_dataset, my_collate = self._restore
            _splice_out(self.loader, "dataset", "_inner", my_dataset)
            _splice_out(self.loader, "collate_fn", "fn", my_collate)
            _restart_persistent_workers(self.loader)
            self._restore = None
        deactivate(self.log)

    def _workers(self) -> list[int]:
        workers = getattr(self._iterator, "_workers", None) or []
        # (None: a slot num_workers="auto" has not started)
        return [w.pid for w in workers if w is not None and w.pid is not None]

    def _start_sampler(self) -> None:
        if self._sampler is None:
            gpu = torch.cuda.current_device() if torch.cuda.is_initialized() else None
            self._sampler = Sampler(self._workers, self.interval_s, self.pss_interval_s, gpu,
                                    self._add_row, self._base)
            self._sampler.start()

    def _stop_sampler(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler_cpu_s += self._sampler.cpu_s
            self._sampler = None
            self._sampled.end_sampler()
        self._note_loop_reads()
        self._drain()

    def _note_loop_reads(self, first: bool = False) -> None:
        self.log.note_reads(0, first, _thread_read_chars(self._loop_tid))

    def _add_row(self, row: dict) -> None:
        """A sampler row (its thread): into the summary's figures, and kept for export."""
        self._sampled.add(row)
        if self._rows_seen % self._row_stride == 0:
            self._series.append(row)
            if len(self._series) > self.MAX_SERIES_ROWS:
                del self._series[1::2]
                self._row_stride *= 2
        self._rows_seen += 1

    def _drain(self) -> None:
        block = self.log.drain()
        if len(block):
            if self.trace:
                self._spans.append(block)
            codes, seconds = block[:, 1], (block[:, 3] - block[:, 2]) / 1e9
            self._collated += int(np.maximum(block[codes == _COLLATE, 4], 0).sum())
            runs = (codes == _SAMPLE) & (block[:, 4] > 0)  # samples timed together
            self._sample_runs_s += float(seconds[runs].sum())
            collates = codes == _COLLATE
            self._stages["collate"].extend(self._per_batch(block[collates], seconds[collates]))
            keep = ~runs & ~collates
            codes, seconds = codes[keep], seconds[keep]
            for code in np.flatnonzero(np.bincount(codes, minlength=len(STAGES))).tolist():
                self._stages[STAGES[code]].extend(seconds[codes == code])
        self._resolve_gpu(wait=False)

    def _per_batch(self, spans: np.ndarray, seconds: np.ndarray) -> list[float]:
        """Collate seconds per batch: a worker's spans that copied a sample into its batch as
        it came (SAMPLE_COPY, collate.py) count in its next batch's collate span."""
        out = []
        carry = self._copies_s
        for row, value, s in zip(spans[:, 0].tolist(), spans[:, 4].tolist(), seconds.tolist()):
            if value != SAMPLE_COPY:
                out.append(s + carry.pop(row, 0.0))
            else:
                carry[row] = carry.get(row, 0.0) + s
        return out

    def _epoch(self, loader, iterate) -> "_EpochIterator":
        """The loop's view of one epoch (see _EpochIterator)."""
        if threading.get_native_id() != self._loop_tid:
            self._loop_tid = threading.get_native_id()
            self._note_loop_reads(first=True)
        if self._base is None or getattr(loader, "_iterator", None) is None:
            # before the iterator is made: no worker or slab of it yet (persistent workers
            # alive from an earlier epoch keep the base of the epoch that started them). One
            # walk of this process's page tables (~3 ms), outside the epoch's time.
            self._base = baseline()
        t_iter = self._epoch_since_ns = time.monotonic_ns()
        self._drain()  # spans of earlier epochs are not this one's
        start = (self._samples, self._collated, self.log.dropped)
        it = self._iterator = iterate()
        self._loop["epoch_start_s"].add((time.monotonic_ns() - t_iter) / 1e9)
        return _EpochIterator(self, loader, it, t_iter, start)

    def _end_epoch(self, it, t_iter: int, start: tuple, ran_out: bool) -> None:
        """An epoch's end: its wall time counted, the sampler stopped and its last spans
        drained.

        Args:
            it: the loader's iterator of the epoch.
            t_iter: when the epoch began (time.monotonic_ns, as iter() was called).
            start: (samples, collated, spans dropped) as the epoch began.
            ran_out: the epoch ran to its end (not let go of by the loop): then the collate
                spans' counts may set the sample count exactly.
        """
        self._wall_s += (time.monotonic_ns() - t_iter) / 1e9
        self._epoch_since_ns = None
        self._stop_sampler()  # (it drains the last spans)
        samples, collated, dropped = start
        if (ran_out and getattr(self.loader, "_auto_collation", False)
                and self.log.dropped == dropped and self._collated > collated):
            # every batch made was handed out: the collate spans' counts are exact, where
            # _batch_len guesses from the batch's shape (a custom collate_fn's list of samples)
            self._samples = samples + self._collated - collated
        if self._iterator is it:  # its workers go when the loop lets go of it, as unwatched
            self._iterator = None

    # -- the loop's own marks ----------------------------------------------------------------

    def h2d(self, batch=None):
        """``with tm.h2d(batch):`` times a host-to-device copy; ``batch`` gives its bytes."""
        self._h2d_bytes += _nbytes(batch)
        return _Mark(self, "h2d")

    def compute(self):
        """``with tm.compute():`` marks the model's step (GPU time through CUDA events)."""
        return _Mark(self, "compute")

    # -- results -----------------------------------------------------------------------------

    def summary(self) -> dict:
        """Every metric of METRICS (None where nothing measured it), with the loader's name."""
        for epoch in list(self._epochs):  # those still running: their batches so far
            epoch._flush()
        self._drain()
        self._resolve_gpu(wait=True)
        m: dict[str, object] = {k: None for k in METRICS}
        for name, values in self._stages.items():
            m[f"{name}_s"] = values.summary()
        for name, values in self._loop.items():
            m[name] = values.summary()
        wall_s = self._wall_s  # a summary taken while an epoch runs counts it so far
        if self._epoch_since_ns is not None:
            wall_s += (time.monotonic_ns() - self._epoch_since_ns) / 1e9
        workers = getattr(self.loader, "num_workers", 0) if self.loader is not None else 0
        busy_s = (self._stages["sample"].total + self._sample_runs_s
                  + self._stages["collate"].total) / max(1, workers)
        if not workers:
            busy_s = self._loop["queue_wait_s"].total
        if busy_s > 0:
            m["samples_per_s"] = self._samples / busy_s
            m["batches_per_s"] = self._batches / busy_s
        if wall_s > 0:
            m["end_to_end_samples_per_s"] = self._samples / wall_s
        m["read_bytes"] = self.log.read_bytes()
        if wall_s > 0:
            m["storage_read_bytes_per_s"] = m["read_bytes"] / wall_s
        h2d_total = self._loop["h2d_s"].total
        if h2d_total > 0 and self._h2d_bytes:
            m["h2d_bytes_per_s"] = self._h2d_bytes / h2d_total
        m.update(self._sampled.summary(wall_s))
        if self._gpu_compute_s and wall_s:
            m["gpu_idle_fraction"] = max(0.0, 1.0 - self._gpu_compute_s / wall_s)
        m["worker_restarts"] = self._restarts
        m["samples_failed"] = self._failed
        dataset = (self._restore[0]._inner if self._restore
                   else getattr(self.loader, "dataset", None))
        m["samples_skipped"] = _skipped(dataset) - self._skipped_before
        m["spans_dropped"] = self.log.dropped
        loader = type(self.loader) if self.loader is not None else None
        return {
            "loader": f"{loader.__module__}.{loader.__qualname__}" if loader else None,
            "num_workers": workers,
            # num_workers="auto": where it stands, and each change (when, from, to, why)
            "tuned": None if self._settled is None else {**self._settled,
                                                          "changes": list(self._tuning)},
            "batch_size": getattr(self.loader, "batch_size", None),
            "samples": self._samples, "batches": self._batches, "wall_s": wall_s,
            "sampler_cpu_s": self._sampler_cpu_s,
            "metrics": m,
        }

    def table(self) -> str:
        return export.table(self.summary())

    def export(self, directory: str, *, trace: bool = True) -> dict[str, str]:
        """Write summary.json, timeseries.jsonl and, if the session keeps spans and ``trace``
        is not False, trace.json."""
        summary = self.summary()
        spans = _concat(self._spans) if self.trace and trace else None
        return export.write(directory, summary, list(self._series), spans, self._loop_events,
                            self._gpu, self._t0_ns)

    def _resolve_gpu(self, wait: bool) -> None:
        """CUDA event pairs -> seconds, once each: those done by now (``wait``: all of them)."""
        pending = []
        for mark in self._gpu_pending:
            name, start, ev0, ev1 = mark
            if not (wait or ev1.query()):
                pending.append(mark)
                continue
            seconds = _event_s(ev0, ev1)
            if self.trace:
                self._gpu.append((name, start, seconds))
            if name == "h2d":
                self._loop["h2d_s"].add(seconds)
            else:
                self._gpu_compute_s += seconds
        self._gpu_pending = pending

    def close(self) -> None:
        self.unwatch()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class Watched:
    """The loader, seen through a telemetry session: iterate it as you would the loader."""

    def __init__(self, telemetry: Telemetry, loader, iterate):
        self.telemetry, self.loader, self._iterate = telemetry, loader, iterate

    def __iter__(self):
        return self.telemetry._epoch(self.loader, self._iterate)

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _EpochIterator(_Forwarding):
    """The loader's iterator, seen by the session: times every next() and the gaps between
    them. An iterator object, not a generator, so that it behaves as the loader's own: an error
    from one next() the loop catches leaves the epoch going on, len() works, and its attributes
    (workers, ...) are the loader iterator's. The epoch's figures close when it runs out, or
    when the loop lets go of it.

    A next() only notes its two clock readings and the batch's samples: the figures are made
    from them 64 batches at a time (``_flush``), as a summary asks, and as the epoch ends
    (made a batch at a time, they cost the loop ~13 us a batch in place).

    The session's sampler thread starts at the first next(), once the workers have forked
    (they fork as the loader's iterator is made): with a Python thread alive in this process
    at the fork, every malloc and free in the worker costs more (glibc 2.36), ~4% more CPU a
    batch on tiny samples here; a thread the worker starts itself costs it nothing
    measurable. At the first next(), not as the iterator is made, so that a process making
    several loaders' iterators in turn (a benchmark's arms) forks them all first. Its start
    counts in neither the epoch's time nor its first batch's, as when it started before.

    Args:
        tm: the session.
        loader: the loader watched.
        it: the loader's own iterator of the epoch.
        t_iter: when the epoch began (time.monotonic_ns, as iter() was called).
        start: (samples, collated, spans dropped) as the epoch began, for ``_end_epoch``.
    """

    _OWN = ("_it", "_tm", "_loader", "_t_iter", "_start", "_replaced", "_last", "_ended",
            "_batched", "_times", "_sampling", "_tuned")

    def __init__(self, tm: Telemetry, loader, it, t_iter: int, start: tuple):
        self._tm, self._loader, self._it, self._t_iter = tm, loader, it, t_iter
        self._start = start
        self._replaced = _replacements(it)
        self._tuned = 0  # the iterator's tuning changes taken in
        self._batched = getattr(loader, "_auto_collation", True)
        self._last = None  # when the loop got the last batch flushed
        self._ended = False
        self._times = []  # (when next() was called, when it returned) of each batch, flat
        self._sampling = False
        tm._epochs.add(self)

    def __iter__(self):
        return self

    def __len__(self):
        return len(self._it)

    def __next__(self):
        if self._ended:
            raise StopIteration
        if not self._sampling:
            began = time.monotonic_ns()
            self._tm._start_sampler()
            starting = time.monotonic_ns() - began  # (~0.5 ms) not the epoch's own time
            if self._tm._epoch_since_ns == self._t_iter:  # (a summary's epoch so far too)
                self._tm._epoch_since_ns += starting
            self._t_iter += starting
            self._sampling = True
        t0 = time.monotonic_ns()
        try:
            batch = next(self._it)
        except StopIteration:
            self.close(ran_out=True)
            raise
        except Exception:
            self._tm._failed += 1
            raise
        times = self._times
        times += (t0, time.monotonic_ns())
        self._tm._samples += _batch_len(batch, self._batched, self._loader)
        if len(times) >= 128:
            self._flush()
            self._tm._drain()
        return batch

    def _flush(self) -> None:
        """The batches noted since the last flush, into the session's figures."""
        tm, times = self._tm, self._times
        if times:
            t = np.array(times, dtype=np.int64).reshape(-1, 2)
            times.clear()
            got = t[:, 1]
            tm._loop["queue_wait_s"].extend((got - t[:, 0]) / 1e9)
            if self._last is None:
                tm._loop["first_batch_s"].add(int(got[0] - self._t_iter) / 1e9)
            else:
                tm._loop["step_s"].add(int(got[0] - self._last) / 1e9)
            tm._loop["step_s"].extend(np.diff(got) / 1e9)
            self._last = int(got[-1])
            tm._batches += len(t)
            if tm.trace:
                tm._loop_events += [("wait", int(a), int(b)) for a, b in t]
        replaced = _replacements(self._it)
        if replaced != self._replaced:
            tm._restarts += replaced - self._replaced
            self._replaced = replaced
        self._take_tuning()

    def _take_tuning(self) -> None:
        """num_workers="auto": the changes made since the last flush, into the summary and
        the trace (a mark at each change)."""
        tm, tuning = self._tm, getattr(self._it, "_tuning", None)
        if tuning is None:
            return
        changes = tuning.changes
        for at_ns, change in changes[self._tuned:]:
            tm._tuning.append({"at_s": round((at_ns - tm._t0_ns) / 1e9, 3),
                               "setting": change.setting, "old": change.old, "new": change.new,
                               "why": change.why})
            if tm.trace:
                tm._loop_events.append(
                    (f"{change.setting} {change.old} -> {change.new}", at_ns, at_ns))
        self._tuned = len(changes)
        tm._settled = {"num_workers": tuning.tuner.workers,
                       "prefetch_factor": tuning.tuner.prefetch}

    def close(self, ran_out: bool = False) -> None:
        if not self._ended:
            self._ended = True
            self._flush()
            self._tm._epochs.discard(self)
            self._tm._end_epoch(self._it, self._t_iter, self._start, ran_out)

    def __del__(self):
        if not sys.is_finalizing():  # (too late for the figures: modules are going)
            self.close()


class _Mark:
    """Times a block of the loop: CUDA events when CUDA is in use, else wall time."""

    def __init__(self, telemetry: Telemetry, name: str):
        self.telemetry, self.name = telemetry, name

    def __enter__(self):
        self.start = time.monotonic_ns()
        self.events = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.events = (torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        return self

    def __exit__(self, *exc):
        tm = self.telemetry
        end = time.monotonic_ns()
        if self.events is not None:
            self.events[1].record()
            tm._gpu_pending.append((self.name, self.start, *self.events))
        elif self.name == "h2d":
            tm._loop["h2d_s"].add((end - self.start) / 1e9)
        if tm.trace:
            tm._loop_events.append((self.name, self.start, end))
        return False


def _restart_persistent_workers(loader) -> None:
    """Persistent workers hold the dataset and collate_fn they started with: end them, so the
    next epoch starts workers with the loader's current ones."""
    if getattr(loader, "_iterator", None) is not None:
        loader._iterator._shutdown_workers()
        loader._iterator = None


def _splice_out(loader, attr: str, inner: str, mine) -> None:
    """Take the wrapper ``mine`` out of ``loader.<attr>``: what it wraps now takes its place,
    at the top or under another session's wrapper.

    Args:
        loader: the loader watched.
        attr: the loader's attribute the wrappers sit on ("dataset", "collate_fn").
        inner: the wrappers' attribute holding what each wraps ("_inner", "fn").
        mine: this session's wrapper.
    """
    original = mine.__dict__[inner]
    node = getattr(loader, attr)
    if node is mine:
        object.__setattr__(loader, attr, original)
        return
    while node is not None:
        below = node.__dict__.get(inner) if hasattr(node, "__dict__") else None
        if below is mine:
            object.__setattr__(node, inner, original)
            return
        node = below


def _thread_read_chars(tid: int) -> int:
    """Bytes one thread of this process has read (rchar in /proc/self/task/TID/io; psutil
    has no per-thread I/O counters)."""
    try:
        with open(f"/proc/self/task/{tid}/io", "rb") as f:
            return rchar(f.read(64))
    except OSError:
        return 0


def _event_s(ev0, ev1) -> float:
    ev1.synchronize()
    return ev0.elapsed_time(ev1) / 1e3


def _concat(blocks):
    import numpy as np

    return np.concatenate(blocks) if blocks else np.empty((0, 5), dtype=np.int64)


def _replacements(it) -> int:
    """Workers the loader's iterator has replaced so far (fastmm's respawn and decode deadline:
    torch's loader replaces none)."""
    return getattr(it, "fastmm_worker_replacements", 0)


def _batch_len(batch, batched: bool, loader) -> int:
    """Samples in a batch (``batched``: the loader collates samples into batches): the first
    dimension of its first tensor, else the batch size."""
    if type(batch) is torch.Tensor:  # the common case, without the walk
        return int(batch.shape[0]) if batch.dim() and batched else 1
    stack = [batch]
    while stack:
        x = stack.pop(0)
        if isinstance(x, torch.Tensor):
            return int(x.shape[0]) if x.dim() and batched else 1
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return (getattr(loader, "batch_size", None) or 1) if batched else 1


def _nbytes(batch) -> int:
    stack, total = [batch], 0
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            total += x.nbytes
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


class _SampledStats:
    """Memory, CPU, host and GPU figures, taken in from each sampler row as it comes
    (row[...][0] is the main process, the rest its workers)."""

    _NAMES = ("main_pss_bytes", "worker_rss_bytes", "worker_pss_bytes", "worker_uss_bytes",
              "total_pss_bytes", "loader_host_bytes", "main_cpu_percent", "worker_cpu_percent",
              "cpu_percent", "shm_bytes", "gpu_util_percent")

    def __init__(self):
        self._lock = threading.Lock()  # rows come from the sampler thread
        self._values = {name: Distribution() for name in self._NAMES}
        self._host_peak = None
        self._uss_seen: dict[int, list[int]] = {}  # worker pid -> [first USS, last USS]
        self._gpu_idle = 0
        self._net_done = self._net_now = 0  # bytes received in ended samplers, and this one

    def add(self, row: dict) -> None:
        v = self._values
        with self._lock:
            v["worker_rss_bytes"].extend([x for x in row["rss_bytes"][1:] if x is not None])
            if "pss_bytes" in row:
                pss, uss = row["pss_bytes"], row["uss_bytes"]
                v["worker_pss_bytes"].extend([x for x in pss[1:] if x is not None])
                v["worker_uss_bytes"].extend([x for x in uss[1:] if x is not None])
                for pid, u in zip(row["pids"][1:], uss[1:]):
                    if u is not None:
                        self._uss_seen.setdefault(pid, [u, u])[1] = u
                if None not in pss:  # (a worker gone, the main's PSS takes in what they shared)
                    v["main_pss_bytes"].add(pss[0])
                    v["total_pss_bytes"].add(sum(pss))
                if row["loader_host_bytes"] is not None:
                    v["loader_host_bytes"].add(row["loader_host_bytes"])
            c = row["cpu_percent"]
            if c[0] is not None:
                v["main_cpu_percent"].add(c[0])
            v["worker_cpu_percent"].extend([x for x in c[1:] if x is not None])
            if all(x is not None for x in c):
                v["cpu_percent"].add(sum(c))
            v["shm_bytes"].add(row["shm_bytes"])
            self._host_peak = max(self._host_peak or 0, row["host_used_bytes"])
            if row.get("gpu_util_percent") is not None:
                v["gpu_util_percent"].add(row["gpu_util_percent"])
                self._gpu_idle += row["gpu_util_percent"] == 0
            self._net_now = row["net_recv_bytes"]  # counted from this sampler's start

    def end_sampler(self) -> None:
        with self._lock:
            self._net_done += self._net_now
            self._net_now = 0

    def summary(self, wall_s: float) -> dict:
        with self._lock:
            out = {name: values.summary() for name, values in self._values.items()}
            out["host_used_peak_bytes"] = self._host_peak
            growth = Distribution()  # (a worker swept once has grown by nothing it shows)
            growth.extend([last - first for first, last in self._uss_seen.values()])
            out["worker_uss_growth_bytes"] = growth.summary()
            if self._host_peak is not None and wall_s > 0:
                out["net_bytes_per_s"] = (self._net_done + self._net_now) / wall_s
            gpu = self._values["gpu_util_percent"].count
            if gpu:
                out["gpu_idle_fraction"] = self._gpu_idle / gpu
        return out


assert set(DISTRIBUTIONS) <= set(METRICS)
