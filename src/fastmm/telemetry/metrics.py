"""The metric names (units in the name), one table for every loader, and how series are summed up.

A metric whose value is a distribution is reported as {count, mean, p50, p95, p99, max}; a
metric nothing could measure on this run (no GPU, no NVML) is None, never left out, so the
summaries of two loaders always have the same keys.
"""

from __future__ import annotations

import numpy as np

# name -> what it means (how to read it). Kept in the order the summary table prints.
METRICS: dict[str, str] = {
    "samples_per_s": "data-pipeline throughput: samples / pipeline busy time (worker fetch + "
                     "collate time per worker, or the loop's waits with num_workers=0)",
    "batches_per_s": "data-pipeline throughput in batches, the same way",
    "end_to_end_samples_per_s": "samples / wall time of the loop (data, copies and compute)",
    "first_batch_s": "per epoch: iter(loader) to the first batch in the loop's hands",
    "epoch_start_s": "per epoch: time iter(loader) took (starting workers)",
    "queue_wait_s": "per batch: the loop blocked in next() waiting for it",
    "step_s": "per batch: time between consecutive batches handed to the loop",
    "sample_s": "per sample: the dataset's __getitem__ (or next() of an iterable dataset); "
                "of quick samples, those timed alone",
    "read_s": "per sample: storage reads the dataset marked as stage('read')",
    "decode_s": "per sample: decoding the dataset marked as stage('decode')",
    "augment_s": "per sample: transforms the dataset marked as stage('augment')",
    "collate_s": "per batch: the collate function, in the process that runs it",
    "read_bytes": "bytes the loader's processes read (read()/pread() calls, page cache hits too)",
    "storage_read_bytes_per_s": "read_bytes / wall time",
    "net_bytes_per_s": "host-wide network bytes received / wall time",
    "h2d_s": "per step: host-to-device copy the loop marked with h2d()",
    "h2d_bytes_per_s": "bytes copied in h2d() / time spent in it",
    "gpu_util_percent": "NVML utilisation of the loop's GPU, sampled",
    "gpu_idle_fraction": "1 - GPU time of the marked compute() / loop wall time (CUDA events), "
                         "else the share of NVML samples at 0%",
    "main_pss_bytes": "main process PSS, sampled while its workers live (once one is gone "
                      "the main's PSS takes in the pages they shared)",
    "worker_rss_bytes": "each worker's RSS, sampled (all workers pooled)",
    "worker_pss_bytes": "each worker's PSS, sampled (all workers pooled)",
    "worker_uss_bytes": "each worker's USS (memory only it maps), sampled (all workers pooled)",
    "worker_uss_growth_bytes": "each worker's USS at its last sweep over its first: memory it "
                               "made its own while it ran; reading a dataset's Python objects "
                               "in a forked worker grows it (copy-on-read)",
    "total_pss_bytes": "main + all workers PSS, sampled",
    "loader_host_bytes": "host memory the loader added, sampled with PSS: Pss_Anon of main + "
                         "workers over the main's before the epoch, + shm_bytes (its batches "
                         "and slabs, mapped or not); compare loaders by this, not PSS",
    "host_used_peak_bytes": "host memory in use (psutil's used), highest sample",
    "shm_bytes": "shared memory on the host over what it was when the epoch began (segments "
                 "no process maps included), sampled",
    "cpu_percent": "CPU of main + workers, percent of one core, sampled",
    "main_cpu_percent": "CPU of the main process, percent of one core, sampled",
    "worker_cpu_percent": "CPU of each worker, percent of one core, sampled (pooled)",
    "worker_restarts": "worker processes replaced while an epoch ran",
    "samples_skipped": "samples a dataset left out or replaced under its on_error policy "
                       "while watched",
    "samples_failed": "errors that reached the loop from next()",
    "spans_dropped": "stage spans lost because a worker outran the drain (0 unless overloaded)",
}

DISTRIBUTIONS = {
    "first_batch_s", "epoch_start_s", "queue_wait_s", "step_s", "sample_s", "read_s", "decode_s",
    "augment_s", "collate_s", "h2d_s", "gpu_util_percent", "main_pss_bytes", "worker_rss_bytes",
    "worker_pss_bytes", "worker_uss_bytes", "total_pss_bytes", "loader_host_bytes",
    "shm_bytes", "cpu_percent",
    "main_cpu_percent", "worker_cpu_percent",
}


class Distribution:
    """{count, mean, p50, p95, p99, max} of a stream in bounded memory, so a session can watch
    a run of weeks: every value is kept up to ``exact_values`` of them (percentiles as
    np.percentile gives them), then values go into log-linear buckets, SUB_BUCKETS per power
    of two (a percentile within 0.4% of the exact one; count, mean and max stay exact)."""

    EXACT_VALUES = 1 << 16
    SUB_BUCKETS = 128
    _MIN_EXP, _MAX_EXP = -40, 64  # values from ~1e-12 (below: the zero bucket) to ~1.8e19

    FLUSH_VALUES = 4096  # values are taken in this many at a time, not a drain's few each time

    def __init__(self, exact_values: int | None = None):
        self._cap = self.EXACT_VALUES if exact_values is None else exact_values
        self._exact: list[np.ndarray] = []
        self._kept = 0  # values in _exact
        self._buckets: np.ndarray | None = None
        # values added and not yet taken in (a scalar each, or arrays): count, mean and max are
        # brought up to date as they are read
        self._scalars: list[float] = []
        self._arrays: list[np.ndarray] = []
        self._waiting = 0  # values in _arrays
        self._count, self._total, self._max = 0, 0.0, -np.inf

    def add(self, value: float) -> None:
        self._scalars.append(value)
        if len(self._scalars) + self._waiting >= self.FLUSH_VALUES:
            self._flush()

    def extend(self, values) -> None:
        a = np.asarray(values, dtype=np.float64).ravel()
        if a.size:
            self._arrays.append(a)
            self._waiting += a.size
            if len(self._scalars) + self._waiting >= self.FLUSH_VALUES:
                self._flush()

    @property
    def count(self) -> int:
        self._flush()
        return self._count

    @property
    def total(self) -> float:
        self._flush()
        return self._total

    @property
    def max(self) -> float:
        self._flush()
        return self._max

    def _flush(self) -> None:
        if not (self._scalars or self._arrays):
            return
        parts = self._arrays + ([np.array(self._scalars, dtype=np.float64)] if self._scalars else [])
        a = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self._scalars, self._arrays, self._waiting = [], [], 0
        self._count += a.size
        self._total += float(a.sum())
        self._max = max(self._max, float(a.max()))
        if self._buckets is None:
            self._exact.append(a)
            self._kept += a.size
            if self._kept <= self._cap:
                return
            a, self._exact = np.concatenate(self._exact), []
            self._buckets = np.zeros(1 + (self._MAX_EXP - self._MIN_EXP) * self.SUB_BUCKETS,
                                     dtype=np.int64)
        self._buckets += np.bincount(self._bucket(a), minlength=self._buckets.size)

    def _bucket(self, a: np.ndarray) -> np.ndarray:
        mantissa, exp = np.frexp(a)  # a = mantissa * 2**exp, mantissa in [0.5, 1)
        sub = ((2 * mantissa - 1) * self.SUB_BUCKETS).astype(np.int64)
        index = 1 + (exp.astype(np.int64) - self._MIN_EXP) * self.SUB_BUCKETS + sub
        index = np.clip(index, 1, self._buckets.size - 1)
        index[~(a > 2.0 ** self._MIN_EXP)] = 0  # zero, negative, tiny
        return index

    def _value(self, index: int) -> float:
        if index == 0:
            return 0.0
        exp, sub = divmod(index - 1, self.SUB_BUCKETS)
        return (1 + (sub + 0.5) / self.SUB_BUCKETS) * 2.0 ** (exp + self._MIN_EXP - 1)

    def summary(self) -> dict | None:
        self._flush()
        if not self.count:
            return None
        if self._buckets is None:
            if len(self._exact) > 1:
                self._exact = [np.concatenate(self._exact)]
            p50, p95, p99 = np.percentile(self._exact[0], [50, 95, 99])
        else:  # the bucket holding each rank as np.percentile counts them, within min..max
            ranks = np.floor(np.array([0.50, 0.95, 0.99]) * (self.count - 1))
            found = np.searchsorted(np.cumsum(self._buckets), ranks, side="right")
            p50, p95, p99 = (min(self._value(int(i)), self.max) for i in found)
        return {"count": int(self.count), "mean": self.total / self.count, "p50": float(p50),
                "p95": float(p95), "p99": float(p99), "max": float(self.max)}
