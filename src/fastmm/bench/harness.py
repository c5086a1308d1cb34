"""One repetition of one arm: build a fresh loader, time the first batch, then time a
steady-state window; optionally sample the PSS of the whole process tree meanwhile.

Timing rules (the same for every arm, so the arms compare like for like):

* ``first_batch_s`` runs from just before the DataLoader is constructed to the moment its first
  batch has been consumed, so worker start-up is in it.
* The throughput window opens once the first ``num_workers`` batches (the first batch of every
  worker) have been consumed, and closes at the first batch boundary after ``min_seconds`` where
  the number of batches in the window is a multiple of ``num_workers``. Only batches inside the
  window count. Workers run in lockstep rounds, so whole rounds on both ends keep a short window
  from being biased by the start-up round or a half-finished last round.
* Teardown (dropping the iterator and joining its workers) is timed separately.
* The first batch's digest (``workloads.digest``, the correctness check) is computed after
  ``first_batch_s`` is taken and before the window's clock starts, so it is in neither figure.
  With ``digest_all`` (an untimed check repetition) every batch is digested.
* The consumer (the training-loop stand-in) is passed in explicitly by the caller.
* Paced repetitions (``step_s``): the loop runs on a fixed clock, one step every ``step_s``
  from the arrival of the first batch. In each step it consumes the batch, sleeps holding it
  until the step's tick, then drops it and fetches the next, so dropping and fetching are inside
  the step too and the loop's period is ``step_s`` for any loader that keeps up: a
  consumer-bound loop, with the loader's prefetch buffers full. A step that overruns its tick
  moves the clock to that moment (no catching up in a burst).
"""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import psutil
import torch
from torch.utils.data import default_collate
from .._torch import pin_memory as torch_pin_memory

from ..telemetry.sampler import baseline as host_baseline
from ..telemetry.sampler import host_held, smaps_rollup
from .workloads import Consumer, batch_len, batch_nbytes, digest

PSS_INTERVAL_S = 0.05


def tree_cpu_s(root: int | None = None) -> float:
    """User + system CPU seconds of a process tree (this process's, or ``root``'s), the
    children it has reaped included: workers that ended during a repetition still count as
    its own, not as another process's."""
    top = psutil.Process(root)
    total = 0.0
    for proc in [top, *top.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def system_busy_s() -> float:
    """CPU seconds all processes on the machine have used (all cores together)."""
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    return sum(times) - idle - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)


class CpuMeter:
    """The CPU a process tree (this process's, or ``root``'s) and the whole machine use from
    now until ``stop()``, and so the cores other processes took meanwhile, on average: on a
    small machine one busy core slows every arm, so a repetition run that way is flagged, not
    silently averaged in."""

    def __init__(self, root: int | None = None) -> None:
        self.root = root
        self.t0 = time.perf_counter()
        self.tree0 = tree_cpu_s(root)
        self.system0 = system_busy_s()

    def stop(self) -> dict:
        seconds = time.perf_counter() - self.t0
        tree, system = tree_cpu_s(self.root) - self.tree0, system_busy_s() - self.system0
        return {"tree_cpu_s": tree, "system_busy_s": system,
                "other_processes_cpu_cores": max(0.0, system - tree) / seconds if seconds > 0
                else None}


class OtherCores:
    """``with OtherCores() as o: ...``; then ``o.cores``: CpuMeter's cores of other processes
    over the block."""

    def __init__(self, root: int | None = None):
        self.root, self.cores = root, None

    def __enter__(self):
        self._meter = CpuMeter(self.root)
        return self

    def __exit__(self, *exc):
        self.cores = self._meter.stop()["other_processes_cpu_cores"]


def shmem_bytes() -> int | None:
    """Shared memory in use on the whole machine (``Shmem`` in /proc/meminfo: tmpfs, /dev/shm,
    memfd), mapped or not. PSS only counts pages some process maps: a torch batch segment in
    flight between a worker and the main process (its fd passed along, mapped by nobody) is
    in Shmem but in no process's PSS."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Shmem:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PssSampler(threading.Thread):
    """Samples PSS of this process and all its descendants every ``interval`` seconds and keeps
    the peak of their sum; also the peak of the machine's :func:`shmem_bytes` at the same
    moments, and the peak of the host memory the loader holds (telemetry's
    ``loader_host_bytes``: the processes' Pss_Anon over this process's before the sampler was
    made, plus Shmem over its level then), the figure the memory target is judged on: PSS
    misses batches no process maps (torch's queue), Shmem alone the samples a worker holds.

    A sweep is not free: the kernel walks every page table to compute PSS, tens of ms for a
    process with torch loaded. That is why the harness samples in dedicated memory repetitions
    and keeps it out of the timed ones; ``cpu_s`` records what the sampling itself cost.

    With ``max_duty`` the thread sweeps at most that fraction of the time: after a sweep of
    ``t`` seconds it waits ``max(interval - t, t * (1 / max_duty - 1))``, times a random factor
    in [0.5, 1.5] (seeded) so that it does not lock onto the phase of a periodic loop. Without
    it, it sweeps every ``interval`` or back to back, about one core on a loaded machine.
    """

    def __init__(self, interval: float = PSS_INTERVAL_S, max_duty: float | None = None, seed: int = 0):
        super().__init__(name="fastmm-bench-pss", daemon=True)
        self.interval = interval
        self.max_duty = max_duty
        self._random = random.Random(seed)
        self._stop_event = threading.Event()
        self.main_pid = os.getpid()
        self._main = psutil.Process(self.main_pid)
        self.peak_total = 0
        self.peak_main = 0
        self.peak_workers = 0
        self.peak_shmem = None
        self.peak_host_held = None
        self._base = host_baseline()  # (before the loader's processes)
        self.sweeps = 0
        self.sweep_s = 0.0
        self.cpu_s = 0.0
        self.pids_seen: set[int] = set()

    def sweep(self) -> tuple[int, int, int | None]:
        """(main PSS, sum of descendants' PSS, everyone's Pss_Anon or None) now, in bytes."""
        main, anon, _ = smaps_rollup(self.main_pid)
        others = 0
        try:
            children = self._main.children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for child in children:
            figures = smaps_rollup(child.pid)
            if figures is None:  # gone
                continue
            others += figures[0]
            anon = None if anon is None or figures[1] is None else anon + figures[1]
            self.pids_seen.add(child.pid)
        return main, others, anon

    def _record(self, main: int, others: int, anon: int | None) -> None:
        if main + others > self.peak_total:
            self.peak_total, self.peak_main, self.peak_workers = main + others, main, others
        shmem = shmem_bytes()
        if shmem is not None and (self.peak_shmem is None or shmem > self.peak_shmem):
            self.peak_shmem = shmem
        if shmem is not None and anon is not None and self._base[1] is not None:
            held = host_held(anon, shmem, self._base)
            self.peak_host_held = max(held, self.peak_host_held or held)

    def run(self) -> None:
        cpu0 = time.thread_time()
        while not self._stop_event.is_set():
            start = time.perf_counter()
            self._record(*self.sweep())
            took = time.perf_counter() - start
            self.sweeps += 1
            self.sweep_s += took
            wait = max(0.0, self.interval - took)
            if self.max_duty is not None:
                wait = max(wait, took * (1.0 / self.max_duty - 1.0)) * self._random.uniform(0.5, 1.5)
            self._stop_event.wait(wait)
        self.cpu_s = time.thread_time() - cpu0

    def stop(self) -> dict:
        self._stop_event.set()
        self.join()
        self._record(*self.sweep())  # a last look, so a very short run still has a figure
        return {
            "peak_total_pss_bytes": self.peak_total,
            "main_pss_bytes_at_peak": self.peak_main,
            "workers_pss_bytes_at_peak": self.peak_workers,
            "pss_sweeps": self.sweeps,
            "pss_sweep_mean_s": self.sweep_s / max(1, self.sweeps),
            "pss_sampler_cpu_s": self.cpu_s,
            "pss_processes_seen": 1 + len(self.pids_seen),
            "pss_max_duty": self.max_duty,
            "peak_shmem_bytes": self.peak_shmem,
            "peak_host_held_bytes": self.peak_host_held,
        }


def rotated(arms: list, round_index: int) -> list:
    """The arms in the order round ``round_index`` runs them: each round starts one arm later,
    so no arm always runs first (just after another's teardown, or at a quiet spell's start)
    and a position effect falls on every arm alike."""
    k = round_index % len(arms) if arms else 0
    return arms[k:] + arms[:k]


def wait_for_quiet(max_wait_s: float, threshold_cores: float = 0.25, probe_s: float = 0.5) -> dict:
    """Wait (up to ``max_wait_s``) until processes other than this benchmark use less than
    ``threshold_cores`` of CPU over a ``probe_s`` probe, so a repetition does not start while
    something else (a test suite, a build) is running on a small machine."""
    waited = 0.0
    while True:
        meter = CpuMeter()
        time.sleep(probe_s)
        others = meter.stop()["other_processes_cpu_cores"]
        waited += probe_s
        if others < threshold_cores or waited >= max_wait_s:
            return {"quiet_wait_s": waited, "quiet_before_start": others < threshold_cores,
                    "other_processes_cpu_cores_before_start": others}


def wait_for_children(timeout: float = 10.0) -> int:
    """Wait until this process has no live descendants (the last loader's workers); return how
    many were still alive at the deadline."""
    from multiprocessing import forkserver, resource_tracker

    # multiprocessing's own helpers live as long as this process (Mosaic Streaming's shared
    # memory starts the resource tracker): they are nobody's workers
    helpers = {resource_tracker._resource_tracker._pid, forkserver._forkserver._forkserver_pid}
    deadline = time.monotonic() + timeout
    while True:
        alive = [c for c in psutil.Process().children(recursive=True)
                 if c.pid not in helpers and _alive(c)]
        if not alive or time.monotonic() > deadline:
            return len(alive)
        time.sleep(0.01)


def _alive(process: psutil.Process) -> bool:
    """Not a zombie, and not gone since it was listed (a worker exiting as it is looked at)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class _Window:
    """Counts batches and times the steady-state window (see the module docstring)."""

    warm_batches: int
    round_size: int
    min_seconds: float
    t0: float = field(default_factory=time.perf_counter)
    batches_seen: int = 0
    first_batch_s: float | None = None
    start: float | None = None
    end: float | None = None
    batches: int = 0
    samples: int = 0
    nbytes: int = 0
    cpu: CpuMeter | None = None

    def add(self, samples: int, nbytes: int, on_first: Callable[[], None] | None = None) -> bool:
        """Account one consumed batch; True when the window is complete. ``on_first`` runs after
        the first batch's time is taken and before the window's clock can start."""
        now = time.perf_counter()
        self.batches_seen += 1
        if self.batches_seen == 1:
            self.first_batch_s = now - self.t0
            if on_first is not None:
                on_first()
        if self.batches_seen == self.warm_batches:
            self.cpu = CpuMeter()
            self.start = time.perf_counter()
            return False
        if self.start is None:
            return False
        self.batches += 1
        self.samples += samples
        self.nbytes += nbytes
        if now - self.start >= self.min_seconds and self.batches % self.round_size == 0:
            self.end = now
            return True
        return False

    def result(self) -> dict:
        exhausted = self.end is None
        end = self.end if self.end is not None else time.perf_counter()
        window = (end - self.start) if self.start is not None else 0.0
        cpu = self.cpu.stop() if self.cpu is not None else {
            "tree_cpu_s": None, "system_busy_s": None, "other_processes_cpu_cores": None}
        return {
            "first_batch_s": self.first_batch_s,
            "warm_batches": self.warm_batches,
            "batches": self.batches,
            "samples": self.samples,
            "bytes": self.nbytes,
            "window_s": window,
            "samples_per_s": self.samples / window if window > 0 else None,
            "bytes_per_s": self.nbytes / window if window > 0 else None,
            "exhausted": exhausted,
            **cpu,
        }


def run_loader(make_loader, num_workers: int, min_seconds: float, consume: Consumer,
               sample_pss: bool = False, step_s: float | None = None,
               pss_max_duty: float | None = None, digest_all: bool = False) -> dict:
    """One repetition of a multi-process loader arm (torch or fastmm): fresh loader, every
    batch read by ``consume``. With ``step_s`` the repetition is paced (see the module
    docstring); otherwise the loop runs as fast as the loader delivers and drops each batch
    right after consuming it. ``pss_max_duty``: see :class:`PssSampler`. ``digests``: the
    first batch's digest, or with ``digest_all`` every batch's (in order)."""
    gc.collect()
    leftover = wait_for_children()
    sampler = None
    baseline = None
    if sample_pss:
        sampler = PssSampler(max_duty=pss_max_duty)
        baseline = sum(sampler.sweep()[:2])
        baseline_shmem = shmem_bytes()
    load1 = os.getloadavg()[0]
    rounds = max(1, num_workers)
    window = _Window(warm_batches=rounds, round_size=rounds, min_seconds=min_seconds)
    loader = make_loader()
    iterator = iter(loader)  # forks the workers: start the sampler thread only afterwards
    if sampler is not None:
        sampler.start()
    digests = []
    fetch_wait = 0.0  # time the loop spent blocked in next() inside the window
    tick = None  # paced: the end of the current step
    while True:
        asked = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            break
        received = time.perf_counter()
        if window.start is not None:
            fetch_wait += received - asked
        if tick is None:
            tick = received
        consume(batch)
        done = window.add(batch_len(batch), batch_nbytes(batch),
                          on_first=lambda b=batch: digests.append(digest(b)))
        if digest_all and window.batches_seen > 1:
            digests.append(digest(batch))
        if step_s is not None and not done:
            tick += step_s
            remaining = tick - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)  # the step goes on, the batch still held
            else:
                tick = time.perf_counter()  # overran: the clock moves, no catching up
        del batch
        if done:
            break
    result = window.result()
    memory = sampler.stop() if sampler is not None else {}
    start = time.perf_counter()
    del iterator, loader
    gc.collect()
    still_alive = wait_for_children()
    result.update(
        teardown_s=time.perf_counter() - start,
        workers_alive_after_teardown=still_alive,
        workers_alive_before_start=leftover,
        loadavg_1m_at_start=load1,
        digests=digests,
        fetch_wait_s=fetch_wait,
        **memory,
    )
    if baseline is not None:
        result["baseline_pss_bytes"] = baseline
        result["baseline_shmem_bytes"] = baseline_shmem
    if step_s is not None:
        result["pace_step_s"] = step_s
    return result


class _OneThread:
    """torch intra-op threads pinned to 1 for an in-process arm (the loaders' workers also
    run with one thread each), restored afterwards."""

    def __enter__(self):
        self.saved = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)


def run_single_process(dataset, batch_size: int, min_seconds: float, consume: Consumer,
                       reuse_batch: bool = False, collate_fn=default_collate) -> dict:
    """Everything a loader does for a batch (``__getitem__`` x batch_size, ``collate_fn``)
    plus ``consume``, in this process on one thread: the rate one core reaches alone.

    With ``reuse_batch`` the samples are stacked into one preallocated batch tensor reused for
    every batch instead: the least work any loader must do (make the samples, copy them into
    a batch, read it), with no fresh memory to fault in and no transport."""
    gc.collect()
    load1 = os.getloadavg()[0]
    window = _Window(warm_batches=1, round_size=1, min_seconds=min_seconds)
    index = 0
    digests = []
    out = None
    with _OneThread():
        while True:
            samples = [dataset[i] for i in range(index, index + batch_size)]
            if reuse_batch:
                lib = np if isinstance(samples[0], np.ndarray) else torch
                if out is None:
                    out = lib.empty((batch_size, *samples[0].shape), dtype=samples[0].dtype)
                batch = lib.stack(samples, 0, out=out)
            else:
                batch = collate_fn(samples)
            del samples
            index += batch_size
            consume(batch)
            done = window.add(batch_len(batch), batch_nbytes(batch),
                              on_first=lambda b=batch: digests.append(digest(b)))
            del batch
            if done:
                break
    return {**window.result(), "loadavg_1m_at_start": load1, "digests": digests}


def run_consume_only(dataset, batch_size: int, min_seconds: float, consume: Consumer,
                     collate_fn=default_collate, pin_memory: bool = False) -> dict:
    """``consume`` alone over one batch already in memory (page-locked with ``pin_memory``, as
    a pinning loader's batches are), on one thread: the rate the training loop's own reading
    allows, the ceiling for any loader."""
    gc.collect()
    load1 = os.getloadavg()[0]
    batch = collate_fn([dataset[i] for i in range(batch_size)])
    if pin_memory:
        batch = torch_pin_memory(batch)
    window = _Window(warm_batches=1, round_size=1, min_seconds=min_seconds)
    with _OneThread():
        while not window.add(batch_len(batch), batch_nbytes(batch)):
            consume(batch)
    result = window.result()
    result["first_batch_s"] = None  # nothing is loaded
    return {**result, "loadavg_1m_at_start": load1}


def run_getitem(dataset, min_seconds: float, start_index: int = 0) -> dict:
    """``dataset[i]`` alone, sequentially, on one thread: the per-core rate of the sample work.
    Reported per sample (a "batch" here is one sample)."""
    gc.collect()
    load1 = os.getloadavg()[0]
    window = _Window(warm_batches=4, round_size=1, min_seconds=min_seconds)
    index = start_index
    with _OneThread():
        while True:
            sample = dataset[index]
            index += 1
            if window.add(1, batch_nbytes(sample)):
                break
    result = window.result()
    result["first_batch_s"] = None
    return {**result, "loadavg_1m_at_start": load1}
