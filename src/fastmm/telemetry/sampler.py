"""A thread that samples the loader's processes and the host: memory, CPU, reads, network, GPU.

Cheap figures (RSS, CPU times, host memory, network counters) every ``interval_s``. PSS, USS
and Pss_Anon, which make the kernel walk every page table of a process (~3 ms for an idle
torch process, 10-15 ms for a busy worker here), in sweeps: the first FIRST_PSS_S after the
start, then at about twice the time so far (0.5, 1, 2, 4 s, ...) until sweeps are
``pss_interval_s`` apart, so that an epoch of a second or two is swept while its workers live
(torch's iterator ends them before its StopIteration reaches the loop); a sampler stopped
before any sweep sweeps once at its end. Bytes read are counted by the processes themselves
(recorder.py). psutil and /proc do the reading; NVML (nvidia-ml-py) the GPU, when present.
"""

from __future__ import annotations

import os
import threading
import time

import psutil

FIRST_PSS_S = 0.5  # the first PSS sweep: workers have started and made a batch or two


def smaps_rollup(pid: int) -> tuple[int, int | None, int] | None:
    """(PSS, Pss_Anon, USS) of a process in bytes from one read of /proc/PID/smaps_rollup (one
    walk of its page tables; psutil's memory_full_info reads the same file for PSS and USS), or
    None if it cannot be read (gone). USS is Private_Clean + Private_Dirty + Private_Hugetlb,
    as psutil counts it; Pss_Anon is None on kernels older than 5.8, which lack it."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            lines = f.read().splitlines()[1:]  # (the first line is the address range)
    except OSError:
        return None
    kib = {}
    for line in lines:
        name, value = line.split()[:2]
        kib[name] = int(value)
    if b"Pss:" not in kib:  # a zombie: no memory left to read
        return None
    uss = kib.get(b"Private_Clean:", 0) + kib.get(b"Private_Dirty:", 0) + kib.get(
        b"Private_Hugetlb:", 0)
    anon = kib.get(b"Pss_Anon:")
    return kib[b"Pss:"] << 10, None if anon is None else anon << 10, uss << 10


def host_held(anon: int, shmem: int, base: tuple[int, int]) -> int:
    """``loader_host_bytes``: the loader's processes' Pss_Anon (``anon``, summed) over the main
    process's in ``base``, plus the host's Shmem over the level in ``base`` (``baseline()``)."""
    shm_base, anon_base = base
    return anon - anon_base + max(0, shmem - shm_base)


def baseline() -> tuple[int, int | None]:
    """(host Shmem, this process's Pss_Anon) in bytes: what ``loader_host_bytes`` counts from,
    read just before an epoch's iterator is made (before any worker or slab of it exists)."""
    own = smaps_rollup(os.getpid())
    return psutil.virtual_memory().shared, None if own is None else own[1]


class _Nvml:
    """GPU utilisation through NVML, or nothing when NVML or a GPU is missing."""

    def __init__(self, index: int):
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._pynvml = pynvml
        except Exception:  # no nvidia-ml-py, no driver or no GPU: GPU figures stay None
            self.handle = None

    def util_percent(self) -> float | None:
        if self.handle is None:
            return None
        try:
            return float(self._pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
        except Exception:
            return None


class Sampler:
    """Samples until stopped.

    A row (one per tick; timeseries.jsonl holds them): ``t_s`` (seconds since the sampler
    started), ``t_ns`` (time.monotonic_ns, the trace's clock), ``pids`` (main first, then the
    workers), per pid in that order ``rss_bytes`` and ``cpu_percent`` (of one core, since the
    last tick; a worker's first: over its life so far), ``host_used_bytes``, ``shm_bytes``
    (host Shmem over the base), ``net_recv_bytes`` (host, since the start), with NVML
    ``gpu_util_percent``; a sweep's row also has per pid ``pss_bytes``, ``uss_bytes`` and
    ``pss_anon_bytes``, and ``loader_host_bytes`` = sum(pss_anon_bytes) - the main process's
    Pss_Anon in the base + shm_bytes: the host memory the loader added. A value is None where
    its process could not be read (a worker gone; loader_host_bytes then too).

    Args:
        workers: ``workers()`` says which worker pids to watch right now.
        interval_s: seconds between ticks.
        pss_interval_s: seconds between sweeps (rows with PSS, USS and loader_host_bytes)
            once the workers have run a while (the first sweeps come sooner, the gap doubling
            from FIRST_PSS_S); None: one sweep, as the sampler stops.
        gpu_index: the GPU whose utilisation NVML reports; None: no GPU figures.
        record: ``record(row)`` takes each row.
        base: ``baseline()`` as the epoch began (read now if not given).
    """

    def __init__(self, workers, interval_s: float, pss_interval_s: float, gpu_index: int | None,
                 record, base: tuple[int, int | None] | None = None):
        self._workers = workers
        self.interval_s, self.pss_interval_s = interval_s, pss_interval_s
        self._record = record
        self.cpu_s = 0.0  # the sampler's own CPU time
        self._main = psutil.Process()
        self._procs: dict[int, psutil.Process] = {}
        self._last_cpu: dict[int, tuple[float, float]] = {}  # pid -> (when, CPU seconds)
        times = self._main.cpu_times()  # the main process counts from now, workers from birth
        self._last_cpu[os.getpid()] = (time.monotonic(), times.user + times.system)
        self._shm_base, self._anon_base = base if base is not None else baseline()
        self._net_base = _net_recv()
        self._nvml = _Nvml(gpu_index) if gpu_index is not None else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastmm-telemetry", daemon=True)
        self._t0 = time.monotonic()
        # the first PSS sweep once workers have run a while (a sweep costs 3-15 ms a torch
        # process); one that ends sooner gets its sweep at the end
        self._next_pss = (self._t0 + min(FIRST_PSS_S, pss_interval_s)
                          if pss_interval_s is not None else float("inf"))
        self._pss_taken = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._tick(final=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._tick()

    def _proc(self, pid: int) -> psutil.Process | None:
        proc = self._procs.get(pid)
        if proc is None:
            try:
                proc = self._procs[pid] = psutil.Process(pid)
            except psutil.Error:
                return None
        return proc

    def _tick(self, final: bool = False) -> None:
        cpu0 = time.thread_time()
        now = time.monotonic()
        pids = [os.getpid(), *self._workers()]
        for pid in [p for p in self._procs if p not in pids]:  # a worker that ended
            self._procs.pop(pid)
            self._last_cpu.pop(pid, None)
        with_pss = now >= self._next_pss or (final and not self._pss_taken)
        if with_pss:  # the gap doubles (a short epoch gets a few sweeps), up to pss_interval_s
            gap = max(now - self._t0, FIRST_PSS_S)
            if self.pss_interval_s is not None:
                self._next_pss = now + min(gap, self.pss_interval_s)
            self._pss_taken = True
        row = {"t_s": now - self._t0, "t_ns": time.monotonic_ns(), "pids": pids,
               "rss_bytes": [], "cpu_percent": []}
        if with_pss:
            row["pss_bytes"], row["uss_bytes"], row["pss_anon_bytes"] = [], [], []
        for pid in pids:
            proc = self._proc(pid)
            rss = cpu = pss = uss = anon = None
            if proc is not None:
                try:
                    with proc.oneshot():
                        if proc.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped
                            raise psutil.ZombieProcess(pid)
                        rss = proc.memory_info().rss
                        times = proc.cpu_times()
                        used = times.user + times.system
                        prev = self._last_cpu.get(pid)
                        self._last_cpu[pid] = (now, used)
                        if prev is None:  # first sight: its whole life so far
                            age = time.time() - proc.create_time()
                            prev = (now - age, 0.0)
                        if now > prev[0]:
                            cpu = 100.0 * (used - prev[1]) / (now - prev[0])
                        if with_pss:
                            pss, anon, uss = smaps_rollup(pid) or (None, None, None)
                except psutil.Error:
                    pass
            row["rss_bytes"].append(rss)
            row["cpu_percent"].append(cpu)
            if with_pss:
                row["pss_bytes"].append(pss)
                row["uss_bytes"].append(uss)
                row["pss_anon_bytes"].append(anon)
        memory = psutil.virtual_memory()
        row["host_used_bytes"] = memory.used
        row["shm_bytes"] = max(0, memory.shared - self._shm_base)
        if with_pss:
            anon = row["pss_anon_bytes"]
            row["loader_host_bytes"] = (
                host_held(sum(anon), memory.shared, (self._shm_base, self._anon_base))
                if self._anon_base is not None and None not in anon else None)
        row["net_recv_bytes"] = _net_recv() - self._net_base
        if self._nvml is not None:
            row["gpu_util_percent"] = self._nvml.util_percent()
        self._record(row)
        self.cpu_s += time.thread_time() - cpu0


def _net_recv() -> int:
    try:
        return psutil.net_io_counters().bytes_recv
    except Exception:
        return 0

