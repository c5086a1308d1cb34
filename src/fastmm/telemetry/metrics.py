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
    "sample_s": "per sample: the dataset's __getitem__ (or next() of an iterable dataset)",
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
    "main_pss_bytes": "main process PSS, sampled",
    "worker_rss_bytes": "each worker's RSS, sampled (all workers pooled)",
    "worker_pss_bytes": "each worker's PSS, sampled (all workers pooled)",
    "worker_uss_bytes": "each worker's USS (memory only it maps), sampled (all workers pooled)",
    "total_pss_bytes": "main + all workers PSS, sampled",
    "host_used_peak_bytes": "host memory in use (psutil's used), highest sample",
    "shm_bytes": "shared memory on the host over what it was when watching began (segments "
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
    "worker_pss_bytes", "worker_uss_bytes", "total_pss_bytes", "shm_bytes", "cpu_percent",
    "main_cpu_percent", "worker_cpu_percent",
}


def distribution(values) -> dict | None:
    """{count, mean, p50, p95, p99, max} of a series, or None when it is empty."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return None
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"count": int(a.size), "mean": float(a.mean()), "p50": float(p50),
            "p95": float(p95), "p99": float(p99), "max": float(a.max())}
