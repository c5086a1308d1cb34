"""Pre-flight checks: what will make a loader fail or slow down later, said before it does.

``fastmm.DataLoader`` warns of ``copy_on_read_findings`` when its workers start (each finding
once per loader, as a ``FastmmWarning``) and checks shared memory against the slab pool once the
first batch shows its size. ``python -m fastmm.doctor`` (or ``fastmm-doctor``) prints the same
checks for this machine and, given a batch size in bytes, the shared memory a configuration
needs; given ``--dataset``, what the dataset's workers share.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import shutil
import sys
import warnings

from . import config as fastmm_config
from .config import ConfigError, TransportConfig
from .errors import FastmmWarning

LARGE_PYTHON_CONTAINER = 100_000  # items: each one's refcount write in a worker copies a page


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by its cgroup's CPU quota
    (a container's CPU limit, which the affinity does not show), rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return cores if quota is None else max(1, min(cores, math.ceil(quota - 1e-9)))


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup"
                     ) -> float | None:
    """The cores' worth of CPU time a period that this process's cgroup and its ancestors allow
    (the least of their quotas), or None where none sets one: cgroup v2's ``cpu.max``
    ("max 100000" or "200000 100000") or v1's ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``
    (-1: none). A cgroup namespace shows a container's own cgroup as "/"."""
    try:
        with open(self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base, read = root, _v2_quota
            if not os.path.exists(os.path.join(root, "cgroup.controllers")):
                base = os.path.join(root, "unified")
        elif "cpu" in controllers.split(","):  # v1
            base, read = os.path.join(root, controllers), _v1_quota
            if not os.path.isdir(base):
                base = os.path.join(root, "cpu")
        else:
            continue
        parts = [p for p in path.split("/") if p and p not in (".", "..")]
        for depth in range(len(parts), -1, -1):
            quota = read(os.path.join(base, *parts[:depth]))
            if quota is not None:
                quotas.append(quota)
    return min(quotas) if quotas else None


def _read_words(path: str) -> list[str] | None:
    try:
        with open(path) as f:
            return f.read().split()
    except OSError:
        return None


def _v2_quota(directory: str) -> float | None:
    words = _read_words(os.path.join(directory, "cpu.max"))
    try:
        return None if not words or words[0] == "max" else int(words[0]) / int(words[1])
    except (ValueError, IndexError, ZeroDivisionError):
        return None


def _v1_quota(directory: str) -> float | None:
    quota = _read_words(os.path.join(directory, "cpu.cfs_quota_us"))
    period = _read_words(os.path.join(directory, "cpu.cfs_period_us"))
    try:
        return None if not quota or int(quota[0]) <= 0 else int(quota[0]) / int(period[0])
    except (ValueError, IndexError, TypeError, ZeroDivisionError):
        return None


def pool_bytes(num_workers: int, prefetch_factor: int, batch_bytes: int) -> int:
    """Shared memory a steady loop's slab pool holds at most (docs/loader.md): ``prefetch_factor
    + 1`` slabs per worker that are not in the loop's hands, plus the one that is."""
    return (num_workers * (prefetch_factor + 1) + 1) * batch_bytes


def shm_finding(need: int, shm_dir: str | None = None, held: int = 0) -> str | None:
    """Why ``need`` bytes of slabs will not fit in the shared-memory directory, or None."""
    shm_dir = shm_dir or TransportConfig.from_env().shm_dir
    try:
        usage = shutil.disk_usage(shm_dir)
    except OSError as e:
        return f"{shm_dir} is not usable for shared memory: {e}"
    if need <= usage.free + held:
        return None
    return (f"the slab pool will need up to {need / 2**20:,.0f} MiB of shared memory but "
            f"{shm_dir} has {(usage.free + held) / 2**20:,.0f} MiB free (of "
            f"{usage.total / 2**20:,.0f}): a new slab will fail with SharedMemoryError. Give the "
            "container more (docker --shm-size), set FASTMM_SHM_DIR to a larger tmpfs, or lower "
            "batch_size, num_workers or prefetch_factor")


def copy_on_read_findings(dataset, share, limit: int = LARGE_PYTHON_CONTAINER) -> list[str]:
    """Large Python containers of the dataset that its workers will copy as they read them
    (every read writes the objects' refcounts, copying the pages they sit on): those not
    shared (``share``: the loader's ``shared.DatasetShare``; None: sharing is off).

    (More workers than cores: torch's own check already warns. CUDA initialised before workers
    fork is every GPU training loop's normal state, and harmless unless a worker uses CUDA: a
    GPU decoder then raises a DecoderFault naming 'spawn'; no warning here.)"""
    from .shared import containers

    if share is None:
        big = [f"{where} ({type(value).__name__} of {len(value):,} items)"
               for where, _, _, value in containers(dataset, limit)]
        remedy = "FASTMM_SHARE_DATASET=0 turned sharing them with the workers off"
    else:
        big = [f"{n.where} ({n.kind} of {n.items:,} items: {n.why})"
               for n in share.not_shared if n.items >= limit]
        remedy = ("only lists, tuples and dicts of str, bytes, int, float, bool and None are "
                  "shared; keep the others as NumPy arrays, bytes or Arrow")
    if not big:
        return []
    shared = "" if share is None or not share.shared else (
        " (shared, read in place: " + ", ".join(s.where for s in share.shared) + ")")
    return ["the dataset holds large Python containers its workers will copy as they read them: "
            + ", ".join(big) + f". Each worker's memory grows towards their full size; {remedy}"
            + shared]


def warn_once(said: set, findings, stacklevel: int = 4) -> None:
    """Warn of each finding not in ``said`` (a loader's: once per loader), and add it there.
    ``stacklevel``: the user's frame, counted from this function."""
    for finding in findings:
        if finding not in said:
            said.add(finding)
            warnings.warn(f"fastmm: {finding}", FastmmWarning, stacklevel=stacklevel)


def report(num_workers: int | None, prefetch_factor: int, batch_bytes: int | None) -> tuple[str, bool]:
    """The machine's findings as text, and whether any is a problem."""
    lines, problem = [], False
    for read in (fastmm_config.TelemetryConfig.from_env, fastmm_config.SourceConfig.from_env,
                 fastmm_config.DecodeConfig.from_env, fastmm_config.DistConfig.from_env,
                 lambda: fastmm_config.decode_deadline(None)):
        try:  # each variable a loader or dataset would refuse
            read()
        except ConfigError as e:
            lines.append(f"PROBLEM: {e}")
            problem = True
    try:
        config = TransportConfig.from_env()
    except ConfigError as e:
        lines.append(f"PROBLEM: {e}")
        config, problem = TransportConfig(), True
    cores, quota = usable_cores(), cgroup_cpu_quota()
    lines.append(f"cores usable by this process: {cores}" + (
        "" if quota is None else f" (its cgroup's CPU quota: {quota:g} cores' worth)"))
    try:
        usage = shutil.disk_usage(config.shm_dir)
        lines.append(f"shared memory ({config.shm_dir}): {usage.free / 2**20:,.0f} MiB free of "
                     f"{usage.total / 2**20:,.0f} MiB")
    except OSError as e:
        lines.append(f"shared memory ({config.shm_dir}): NOT USABLE: {e}")
        problem = True
    lines.append(f"worker start method: {multiprocessing.get_start_method(allow_none=True) or 'fork'}")
    from ._native import uses_cpp

    lines.append("slab transport: " + ("C++ (fastmm._C)" if uses_cpp(config) else
                                       "pure Python (fastmm._C not importable or disabled)"))
    if num_workers is not None:
        if num_workers > cores:  # slower, not broken: torch warns about it too
            lines.append(f"WARNING: {num_workers} workers for {cores} cores: they will share them")
        if batch_bytes is not None:
            need = pool_bytes(num_workers, prefetch_factor, batch_bytes)
            finding = shm_finding(need, config.shm_dir)
            lines.append(f"slab pool for ({num_workers} workers x (prefetch {prefetch_factor} + 1)"
                         f" + 1) x {batch_bytes / 2**20:,.1f} MiB batches: {need / 2**20:,.0f} MiB")
            if finding:
                lines.append("PROBLEM: " + finding)
                problem = True
    lines.append("OK" if not problem else "problems found")
    return "\n".join(lines), problem


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fastmm-doctor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=None)
    p.add_argument("--prefetch-factor", type=int, default=2)
    p.add_argument("--batch-mb", type=float, default=None,
                   help="bytes of one batch's tensors, in MiB (e.g. 32 clips of 16x3x224x224: 74)")
    p.add_argument("--dataset", metavar="MODULE:NAME|FILE.py:NAME",
                   help="your Dataset (or a function of no arguments that returns one): which of "
                        "its Python containers the workers share, and the memory that saves")
    args = p.parse_args(argv)
    if args.batch_mb is not None and args.num_workers is None:
        p.error("--batch-mb needs --num-workers")
    if (args.num_workers is not None and args.num_workers < 0) or args.prefetch_factor < 1:
        p.error("--num-workers must be at least 0 and --prefetch-factor at least 1")
    if args.batch_mb is not None and not 0 < args.batch_mb < float("inf"):
        p.error(f"--batch-mb must be a finite number above 0, got {args.batch_mb}")
    batch = None if args.batch_mb is None else int(args.batch_mb * 2**20)
    text, problem = report(args.num_workers, args.prefetch_factor, batch)
    print(text)
    if args.dataset is not None:
        print(dataset_report(args.dataset))
    return 1 if problem else 0


def dataset_report(spec: str) -> str:
    """What sharing does for the dataset ``spec`` names (``module:name`` or ``file.py:name``,
    as ``fastmm-bench --dataset`` takes it)."""
    from .bench.ab import TargetError, find_target
    from .shared import DatasetShare

    module, _, name = spec.rpartition(":")
    if not module or not name:
        raise SystemExit(f"fastmm-doctor: --dataset {spec!r}: give it as module:name")
    try:
        dataset = find_target(spec, "--dataset")
    except TargetError as e:
        raise SystemExit(f"fastmm-doctor: {e}") from None
    if isinstance(dataset, type) or (callable(dataset) and not hasattr(dataset, "__getitem__")):
        dataset = dataset()  # (a class, or a function, that makes it)
    share = DatasetShare.build(dataset)
    try:
        findings = copy_on_read_findings(dataset, share)
        return "\n".join([f"dataset {spec}: " + share.describe(),
                          *(f"WARNING: {f}" for f in findings)])
    finally:
        share.close()


if __name__ == "__main__":
    sys.exit(main())
