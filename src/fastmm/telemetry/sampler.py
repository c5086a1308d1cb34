"""A thread that samples the loader's processes and the host: memory, CPU, reads, network, GPU.

Cheap figures (RSS, CPU times, read counters, host memory) every ``interval_s``; PSS and USS,
which make the kernel walk every page table of a process (~9-13 ms for a torch process here),
every ``pss_interval_s`` from ``pss_interval_s`` after the start (or once at the end, for a
sampler stopped sooner). Bytes read are counted by the processes themselves (recorder.py). psutil
does the reading; NVML (nvidia-ml-py) the GPU, when present.
"""

from __future__ import annotations

import os
import threading
import time

import psutil


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
    """Samples until stopped; ``workers()`` says which worker pids to watch right now, and
    ``record(row)`` takes each row."""


    def __init__(self, workers, interval_s: float, pss_interval_s: float, gpu_index: int | None,
                 record):
        self._workers = workers
        self.interval_s, self.pss_interval_s = interval_s, pss_interval_s
        self._record = record
        self.cpu_s = 0.0  # the sampler's own CPU time
        self._main = psutil.Process()
        self._procs: dict[int, psutil.Process] = {}
        self._last_cpu: dict[int, tuple[float, float]] = {}  # pid -> (when, CPU seconds)
        times = self._main.cpu_times()  # the main process counts from now, workers from birth
        self._last_cpu[os.getpid()] = (time.monotonic(), times.user + times.system)
        self._shm_base = psutil.virtual_memory().shared
        self._net_base = _net_recv()
        self._nvml = _Nvml(gpu_index) if gpu_index is not None else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastmm-telemetry", daemon=True)
        self._t0 = time.monotonic()
        # the first PSS sweep once workers have run a while (a sweep costs ~13 ms a torch
        # process); one that ends sooner gets its sweep at the end
        self._next_pss = self._t0 + pss_interval_s
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
        if with_pss:
            self._next_pss = now + self.pss_interval_s
            self._pss_taken = True
        row = {"t_s": now - self._t0, "t_ns": time.monotonic_ns(), "pids": pids,
               "rss_bytes": [], "cpu_percent": []}
        if with_pss:
            row["pss_bytes"], row["uss_bytes"] = [], []
        for pid in pids:
            proc = self._proc(pid)
            rss = cpu = pss = uss = None
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
                            full = proc.memory_full_info()
                            pss, uss = full.pss, full.uss
                except psutil.Error:
                    pass
            row["rss_bytes"].append(rss)
            row["cpu_percent"].append(cpu)
            if with_pss:
                row["pss_bytes"].append(pss)
                row["uss_bytes"].append(uss)
        memory = psutil.virtual_memory()
        row["host_used_bytes"] = memory.used
        row["shm_bytes"] = max(0, memory.shared - self._shm_base)
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

