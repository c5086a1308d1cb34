"""``fastmm-bench --dataset TARGET``: the research brief's method on the user's own pipeline.

TARGET is ``package.module:callable`` or ``path/to/file.py:callable``. The dataset callable is
called with no arguments and returns a Dataset (map-style or iterable); the step callable, the
user's training step, is called with each batch; without one, the loop reads every byte of each
batch. Then, on that pipeline:

1. the environment is recorded, and one batch is made in-process and handed to the step, so a
   broken pipeline fails before any measuring, with its own traceback;
2. every arm runs once untimed: the check-and-profile run (every batch digested, telemetry with
   a Perfetto trace and a dense memory series);
3. ``--reps`` rounds of every arm, each round starting one arm later, a fresh loader each time,
   built after ``torch.manual_seed(seed)`` with a generator seeded the same, so every arm draws
   the same sample order and worker seeds. Timed: ``first_batch_s`` (constructor to the first
   batch in the loop's hands), then a window of whole rounds of batches after one batch per
   worker, the step run on each; the telemetry watches every run.

The baseline is torch's DataLoader with the user's settings, untouched. Every other arm changes
one factor from its parent (``fastmm``: the loader; ``num_workers``, ``prefetch_factor``,
``pin_memory`` on the baseline; ``slab_memory=lean``, ``worker_malloc=system`` and
``pure_python`` (the twin in place of fastmm._C) on ``fastmm``; for a MultimodalDataset its
``decoder``, ``source`` and ``reduce``). With a step, torch and fastmm also run with the loop
only reading the batches: data-pipeline throughput apart from end to end. Asked for by name,
``auto``: fastmm with ``num_workers="auto"`` against the best fixed setting of a sweep around
the user's, in rounds of their own (``tuned``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import importlib.util
import itertools
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.utils.data

import fastmm

from ..dataset import MultimodalDataset
from .._native import uses_cpp
from ..telemetry import Telemetry
from . import ab_page, env, harness, options, stats
from .report import BUSY_CORES
from .workloads import batch_len, batch_nbytes, digest, leaves, sum64

QUICK = {"reps": 3, "seconds": 0.5, "auto_seconds": 6.0}
FULL = {"reps": 6, "seconds": 2.0, "auto_seconds": 30.0}
SAME_SEEDS = "the same seeds give the same batches"
MEMORY_BAR = 1.10  # roll out only while the arm holds at most this much of its parent's memory
FACTORS = ("fastmm", "num_workers", "prefetch_factor", "pin_memory", "slab_memory",
           "worker_malloc", "pure_python", "decoder", "source", "reduce", "auto")
DEFAULT_ARMS = FACTORS[:-1]  # "auto" runs a sweep: minutes more, so asked for by name
CALLS = ("roll out", "keep the baseline", "roll back", "undecided")
class TargetError(Exception):
    """A --dataset/--step/--collate that cannot be used: one line, exit code 2."""


# -- targets -------------------------------------------------------------------------------------

def load_target(text: str, flag: str) -> Callable:
    """The callable ``text`` names (``module:name`` or ``file.py:name``)."""
    obj = find_target(text, flag)
    if not callable(obj):
        raise TargetError(f"{flag} {text!r}: {text.rpartition(':')[2]} is not callable (it is "
                          f"{type(obj).__name__} {obj!r:.40})")
    return obj


def find_target(text: str, flag: str):
    """The object ``text`` names (``module:name`` or ``file.py:name``), its module imported
    (a file's put on sys.path), or a TargetError in one line."""
    where, sep, name = text.rpartition(":")
    if not sep or not where or not name:
        raise TargetError(f"{flag} {text!r}: expected MODULE:CALLABLE or path/to/FILE.py:CALLABLE")
    try:
        module = _import(where)
    except TargetError as e:
        raise TargetError(f"{flag} {text!r}: {e}") from None
    except BaseException as e:  # the user's module failed as it ran: one line naming it
        line = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()[-1]
        raise TargetError(f"{flag} {text!r}: importing {where} failed: {line}") from None
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise TargetError(f"{flag} {text!r}: {where} has no {name!r}")
        obj = getattr(obj, part)
    return obj


def _import(where: str):
    """A module by name, or a file by path, loaded once (so a file's dataset and step share its
    state), its directory put on sys.path so that spawned workers can import it too."""
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where).resolve()
    if not path.is_file():
        raise TargetError(f"no such file {where}")
    name = path.stem
    module = sys.modules.get(name)
    if module is not None:
        if Path(getattr(module, "__file__", "") or "").resolve() == path:
            return module
        raise TargetError(f"a module named {name!r} is already imported from "
                          f"{getattr(module, '__file__', '?')}; rename {path.name}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def make_dataset(factory: Callable, text: str):
    dataset = factory()
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    if not iterable and not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TargetError(f"--dataset {text!r}: {text.rpartition(':')[2]}() returned "
                          f"{type(dataset).__name__}, not a Dataset "
                          "(a map-style Dataset with __getitem__ and __len__, or an "
                          "IterableDataset)")
    return dataset


# -- batches -------------------------------------------------------------------------------------

def describe(batch) -> str:
    """The batch's structure in a line: ``dict{video: uint8[32, 8, 3, 112, 112], ...}``."""
    if isinstance(batch, torch.Tensor):
        return f"{str(batch.dtype).removeprefix('torch.')}{list(batch.shape)}"
    if isinstance(batch, np.ndarray):
        return f"ndarray {batch.dtype}{list(batch.shape)}"
    if isinstance(batch, dict):
        return "dict{" + ", ".join(f"{k}: {describe(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, (list, tuple)):
        kinds = {describe(v) for v in batch}
        if len(batch) > 4 and len(kinds) == 1:
            return f"{type(batch).__name__}[{len(batch)} x {kinds.pop()}]"
        return f"{type(batch).__name__}(" + ", ".join(describe(v) for v in batch) + ")"
    return type(batch).__name__


def pixel_difference(a: list, b: list) -> float:
    """Mean |a - b| over every value, as a share of b's value range (inf if shapes differ)."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b):
        x, y = torch.as_tensor(x).double(), torch.as_tensor(y).double()
        span = float(y.max() - y.min()) if y.numel() else 0.0
        diff = float((x - y).abs().mean()) if x.numel() else 0.0
        worst = max(worst, diff / span if span else diff)
    return worst


# -- arms ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Arm:
    """One configuration of the loader: the baseline, or one factor changed from ``parent``."""

    name: str
    loader: str  # "torch" or "fastmm"
    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    step: bool  # the user's step runs on each batch (else the loop only reads it)
    dataset: object
    parent: str | None = None
    factor: str | None = None
    environment: dict = dataclasses.field(default_factory=dict)  # FASTMM_* for this arm
    check: str = "bytes"  # "bytes", "pixels" or "structure": what must equal the parent's
    why: str = ""  # why the check is what it is
    levels: float = 2.0  # "pixels": the mean |difference| allowed, in levels of 255

    def settings(self) -> dict:
        return {"loader": self.loader, "num_workers": self.num_workers,
                "prefetch_factor": self.prefetch_factor, "pin_memory": self.pin_memory,
                "step": self.step, **self.environment}


def arms(args, dataset, has_step: bool, stage_dir: str) -> tuple[list[Arm], list[dict]]:
    """The arms to run, and those that cannot run here with the reason."""
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    nw, pf = args.num_workers, args.prefetch_factor
    base = Arm("torch", "torch", nw, pf if nw else None, args.pin_memory, has_step, dataset)
    out, skipped = [], []
    wanted = set(args.arms)
    if nw == 0 and "fastmm" in wanted:
        wanted -= {"fastmm"}
        skipped.append({"arm": "fastmm", "why": "with num_workers=0 fastmm.DataLoader is torch's "
                        "DataLoader (the same code): give --num-workers to compare the loaders"})
    if has_step and "fastmm" in wanted:  # the loop only reading: data-pipeline throughput
        out.append(dataclasses.replace(base, name="torch, loader alone", step=False))
        out.append(dataclasses.replace(base, name="fastmm, loader alone", loader="fastmm",
                                       step=False, parent="torch, loader alone",
                                       factor="fastmm", why=SAME_SEEDS))
    out.append(base)
    fastmm = dataclasses.replace(base, name="fastmm", loader="fastmm", parent="torch",
                                 factor="fastmm", why=SAME_SEEDS)
    if "fastmm" in wanted:
        out.append(fastmm)
    if "num_workers" in wanted:
        other = (args.try_num_workers if args.try_num_workers is not None
                 else _other_worker_count(nw, env.usable_cores()))
        if other == nw:
            skipped.append({"arm": "num_workers", "why": "no other worker count to try: give "
                            "--try-num-workers"})
        else:
            why = ("each IterableDataset worker iterates its own copy or shard: another count "
                   "changes which samples come, so only the structure can match") if iterable else (
                "byte-identical unless the Dataset draws random numbers: worker i is seeded "
                "base_seed + i, and a batch's worker changes with the count")
            out.append(dataclasses.replace(base, name=f"num_workers={other}", num_workers=other,
                                           prefetch_factor=(pf or 2) if other else None,
                                           parent="torch", factor="num_workers",
                                           check="structure" if iterable else "bytes-or-random",
                                           why=why))
    if "prefetch_factor" in wanted:
        if nw:
            other = args.try_prefetch_factor or 2 * pf
            out.append(dataclasses.replace(base, name=f"prefetch_factor={other}",
                                           prefetch_factor=other, parent="torch",
                                           factor="prefetch_factor",
                                           why="prefetching changes when, not what"))
        else:
            skipped.append({"arm": "prefetch_factor", "why": "no workers: nothing prefetches"})
    if "pin_memory" in wanted:
        if torch.cuda.is_available():
            out.append(dataclasses.replace(base, name=f"pin_memory={not args.pin_memory}",
                                           pin_memory=not args.pin_memory, parent="torch",
                                           factor="pin_memory",
                                           why="page-locked copies of the same bytes"))
        else:
            skipped.append({"arm": "pin_memory", "why": "no CUDA device: nothing to pin for"})
    for factor, variable, value, why in (
            ("slab_memory", "FASTMM_SLAB_MEMORY", "lean",
             "the slabs are unmapped sooner, not written differently"),
            ("worker_malloc", "FASTMM_WORKER_MALLOC", "system",
             "where freed memory goes changes, not what is written"),
            ("pure_python", "FASTMM_PURE_PYTHON", "1",
             "the twin makes the same slabs and copies as fastmm._C")):
        if factor not in wanted:
            continue
        if not nw:
            skipped.append({"arm": factor, "why": "no workers: fastmm's workers' settings"})
            continue
        if factor == "pure_python" and not uses_cpp():
            skipped.append({"arm": factor, "why": "fastmm._C is not built here: fastmm "
                                                  "runs its pure-Python twin already"})
            continue
        out.append(dataclasses.replace(fastmm, name=f"fastmm, {factor}={value}",
                                       environment={variable: value}, parent="fastmm",
                                       factor=factor, why=why))
    out += _dataset_arms(args, base, dataset, wanted, stage_dir, skipped)
    return out, skipped


def _other_worker_count(nw: int, cores: int) -> int:
    """Twice the user's worker count where the cores allow it, else half (at least one); with
    no workers, one per core."""
    if nw == 0:
        return cores
    return 2 * nw if 2 * nw <= cores else max(1, nw // 2)


def _dataset_arms(args, base: Arm, dataset, wanted: set, stage_dir: str,
                  skipped: list) -> list[Arm]:
    """A MultimodalDataset's backends, one at a time: decoder, source, reduce."""
    factors = wanted & {"decoder", "source", "reduce"}
    if not factors:
        return []
    if not isinstance(dataset, MultimodalDataset):
        skipped += [{"arm": f, "why": "not a fastmm.MultimodalDataset: its backends are the "
                     "Dataset's own"} for f in sorted(factors)]
        return []
    out = []
    decoder = getattr(dataset.decoder, "name", None)
    changes = []
    if "decoder" in factors:
        other = {"pil": "torchvision", "torchvision": "pil"}.get(decoder)
        if other and dataset.modality == "image":
            changes.append(("decoder", other, 2.0, "another decoder's pixels differ by "
                            "rounding; the crop planned from the header is the same"))
        else:
            skipped.append({"arm": "decoder", "why": f"no other CPU decoder for {decoder!r} "
                            f"{dataset.modality or 'mixed'} samples"})
    if "source" in factors:
        kind = dataset.source.kind
        if kind in ("posix", "shards"):
            changes.append(("source", "staged", None, "a local copy of the same files"))
        else:
            skipped.append({"arm": "source", "why": f"a {kind} source"})
    if "reduce" in factors:
        changes.append(("reduce", not dataset.reduce, 4.0, "the fast path resizes a "
                        "DCT-reduced decode: small outputs within 4 levels (docs/dataset.md)"))
    for factor, value, levels, why in changes:
        extra = {}
        if factor == "source":
            root = dataset.options["root"]
            # copied as first read (by the check run, untimed): only what the runs read
            extra = {"stage_dir": stage_dir, "inner": dataset.source.kind, "mode": "on_touch"}
            if os.path.isfile(root):  # a manifest: its directory is staged, the copy opened
                extra.update(root=os.path.dirname(root), entry=os.path.basename(root))
        try:
            other = dataset.with_options(**{factor: value}, **extra)
        except (ValueError, OSError) as e:
            skipped.append({"arm": factor, "why": str(e)})
            continue
        out.append(dataclasses.replace(base, name=f"{factor}={value}", dataset=other,
                                       parent="torch", factor=factor, why=why,
                                       check="bytes" if levels is None else "pixels",
                                       levels=levels or 0.0))
    return out


# -- one run -------------------------------------------------------------------------------------

@contextlib.contextmanager
def fastmm_settings(settings: dict[str, str]):
    """FASTMM_* settings for one arm's loader (read when its iterator starts)."""
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclasses.dataclass
class Run:
    """What a run needs besides its arm."""

    batch_size: int
    collate_fn: Callable | None
    step: Callable | None
    seed: int
    warmup: int  # batches before the window: one per worker
    timed: int  # batches in the window


def run_once(arm: Arm, run: Run, profile_dir: str | None = None, check: bool = False) -> dict:
    """One run of an arm: a fresh loader, the first batch timed, then ``run.timed`` batches
    after ``run.warmup``, each handed to the step (or read); telemetry throughout. The first
    batch is digested (after its time is taken); with ``check``, every batch (an untimed run).
    With ``profile_dir``: a trace and a dense memory series exported there."""
    gc.collect()
    harness.wait_for_children()
    map_style = not isinstance(arm.dataset, torch.utils.data.IterableDataset)
    cls = fastmm.DataLoader if arm.loader == "fastmm" else torch.utils.data.DataLoader
    profile = profile_dir is not None
    # the check run (untimed) samples memory densely for the plot; a timed run once, after its
    # window: a walk of every mapped page takes CPU from the workers, more the more is mapped
    tm = (Telemetry(trace=True, interval_s=0.05, pss_interval_s=0.1) if profile
          else Telemetry(pss_interval_s=None))
    digests, kept, waits, gaps = [], None, [], []
    first_s = start = end = meter = None
    samples = batches = 0
    digest_s = 0.0  # digesting inside the window: a check run's extra work
    with fastmm_settings(arm.environment):
        torch.manual_seed(run.seed)
        t0 = time.perf_counter()
        loader = cls(arm.dataset, batch_size=run.batch_size, shuffle=map_style,
                     num_workers=arm.num_workers, prefetch_factor=arm.prefetch_factor,
                     pin_memory=arm.pin_memory, collate_fn=run.collate_fn,
                     generator=torch.Generator().manual_seed(run.seed))
        epoch = iter(tm.watch(loader))
    try:
        last = None
        for n in range(run.warmup + run.timed):
            asked = time.perf_counter()
            try:
                batch = next(epoch)
            except StopIteration:
                break
            got = time.perf_counter()
            if n == 0:
                first_s = got - t0
            if check or n == 0:
                digests.append(digest(batch))
                if check and n == run.warmup:
                    kept = [torch.as_tensor(v).clone() for v in leaves(batch)
                            if not isinstance(v, str)]
                if start is not None:
                    digest_s += time.perf_counter() - got
            if start is not None:
                waits.append(got - asked)
                gaps.append(got - last)
                samples += batch_len(batch)
                batches += 1
            last = got
            if run.step is not None and arm.step:
                with tm.compute():
                    run.step(batch)
            else:
                sum64(batch)
            del batch
            if n + 1 == run.warmup:
                start, meter = time.perf_counter(), harness.CpuMeter()
        end = time.perf_counter()
        cpu = meter.stop() if meter is not None else None  # before the workers go
    finally:
        epoch.close()
    summary = tm.summary()
    if profile:
        tm.export(profile_dir)
    tm.close()
    del loader, epoch
    window = (end - start) if start is not None else 0.0
    m = summary["metrics"]
    memory = m["loader_host_bytes"]
    return {
        "first_batch_s": first_s,
        "batches": batches, "samples": samples, "window_s": window, "digest_s": digest_s,
        "samples_per_s": samples / window if window > 0 and batches else None,
        "queue_wait_share": sum(waits) / window if window > 0 else None,
        "host_bytes_held": memory["max"] if memory else None,  # (one sweep, after the window)
        "other_processes_cpu_cores": cpu["other_processes_cpu_cores"] if cpu else None,
        "waits_s": waits, "steps_s": gaps, "digests": digests, "kept": kept,
        "ran_out": batches < run.timed, "telemetry": summary,
    }


# -- the method ----------------------------------------------------------------------------------

def probe(dataset, args, collate_fn, step) -> dict:
    """One batch made in this process and handed to the step: a broken pipeline fails here,
    with its own traceback, before any measuring; and the batch says what the pipeline is."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size,
                                         collate_fn=collate_fn)
    t0 = time.perf_counter()
    batch = next(iter(loader))
    made = time.perf_counter() - t0
    t0 = time.perf_counter()
    if step is not None:
        step(batch)
    else:
        sum64(batch)
    return {"batch": describe(batch), "batch_samples": batch_len(batch),
            "batch_bytes": batch_nbytes(batch),
            "one_batch_in_process_s": made, "step_s": time.perf_counter() - t0}


def window_size(args, dataset, seconds_per_batch: float) -> tuple[int, int]:
    """(warm-up, timed) batches: one per worker first (start-up), then whole rounds of
    batches lasting about ``--seconds``, within one epoch."""
    rounds = max(1, args.num_workers)
    timed = max(rounds, round(args.seconds / max(seconds_per_batch, 1e-6) / rounds) * rounds)
    try:
        epoch = len(dataset) // args.batch_size
    except TypeError:  # an iterable dataset without a length: it may run out
        epoch = None
    if epoch is not None:
        timed = min(timed, max(1, (epoch - rounds) // rounds * rounds or epoch - rounds))
    return rounds, max(1, timed)


def check(arm: Arm, mine: dict, parent: dict, deterministic: bool) -> dict:
    """Whether an arm's check-and-profile run delivered what its parent's did. A run that
    delivered no batch has nothing to compare: the check fails."""
    if not mine["digests"] or not parent["digests"]:
        return {"check": "every batch compared", "ok": False,
                "why": "a check run delivered no batch: nothing was compared"}
    data = [d for d, _ in mine["digests"]] == [d for d, _ in parent["digests"]]
    shape = [s for _, s in mine["digests"]] == [s for _, s in parent["digests"]]
    if arm.check == "pixels":
        diff = pixel_difference(mine["kept"] or [], parent["kept"] or [])
        return {"check": f"the same batches, pixels within {arm.levels:g} levels of 255 (mean "
                f"|difference| of the first timed batch: {diff * 255:.2f})",
                "ok": shape and diff * 255 <= arm.levels, "why": arm.why}
    if arm.check == "structure" or not deterministic:
        why = arm.why if deterministic else ("the baseline itself gave different batches in "
                                             "runs with the same seeds: only the structure can "
                                             "be compared")
        return {"check": "every batch the same structure (keys, types, dtypes, shapes)",
                "ok": shape, "why": why, "byte_identical": data}
    if arm.check == "bytes-or-random":
        if data:
            return {"check": "every batch byte-identical", "ok": True, "why": arm.why}
        return {"check": "every batch the same structure; bytes differ", "ok": shape,
                "why": arm.why + " (they differ: the Dataset draws random numbers)"}
    return {"check": "every batch byte-identical", "ok": data, "why": arm.why}


def reproducible(warm: dict, check: dict, reps: list[dict]) -> bool:
    """Whether the baseline gave the same batches in every run with the same seeds: its
    untimed warm-up and check runs batch by batch (over the batches both made), and the first
    batch of every timed run. A run with no batch is not reproducible."""
    a, b = warm["digests"], check["digests"]
    n = min(len(a), len(b))
    firsts = [r["digests"][0] if r["digests"] else None for r in reps]
    return n > 0 and a[:n] == b[:n] and all(f == b[0] for f in firsts)


def summarize_arm(arm: Arm, reps: list[dict], parent_reps: list[dict] | None) -> dict:
    rates = [r["samples_per_s"] for r in reps]
    entry = {"settings": arm.settings(), "parent": arm.parent, "factor": arm.factor,
             "samples_per_s": stats.summarize(rates),
             "first_batch_s": stats.summarize([r["first_batch_s"] for r in reps]),
             "host_bytes_held": stats.summarize([r["host_bytes_held"] for r in reps]),
             "queue_wait_share": stats.summarize([r["queue_wait_share"] for r in reps]),
             "busy_reps": sum((r["other_processes_cpu_cores"] or 0) > BUSY_CORES for r in reps),
             "ran_out": any(r["ran_out"] for r in reps)}
    if parent_reps is not None:
        entry["ratio"] = stats.summarize(stats.paired_ratios(
            rates, [r["samples_per_s"] for r in parent_reps]))
        entry["first_batch_ratio"] = stats.summarize(stats.paired_ratios(
            [r["first_batch_s"] for r in reps], [r["first_batch_s"] for r in parent_reps]))
        entry["memory_ratio"] = stats.summarize(stats.paired_ratios(
            [r["host_bytes_held"] for r in reps], [r["host_bytes_held"] for r in parent_reps]))
    return entry


def decide(entry: dict) -> tuple[str, str]:
    """The roll-out / roll-back call on an arm, and what it rests on. A faster arm rolls out
    only where its host memory is shown to stay within MEMORY_BAR of its parent's: the whole
    interval of the memory ratio, not its median, at or under the bar."""
    call, label = stats.decision(entry["ratio"], ok=entry["correctness"]["ok"])
    memory = entry.get("memory_ratio")
    if call == "roll out" and (not memory or memory["ci_high"] > MEMORY_BAR):
        call = "keep the baseline"
        held = (f"it holds {stats.interval(memory, 2, 'x')} the host memory" if memory
                else "its host memory was not measured")
        label += f"; but {held}: not shown within the {MEMORY_BAR:.2f}x bar"
    return call, label


COPY_ON_READ_BYTES = 64 << 20  # a worker's private memory grown by this much: said


def bottleneck(profile: dict, reps: list[dict]) -> dict:
    """The baseline's observed bottleneck, from its measurements only."""
    waited = stats.summarize([r["queue_wait_share"] for r in reps])
    m = profile["metrics"]
    cpu = m.get("worker_cpu_percent")
    observed = []
    if waited and waited["median"] > 0.2:
        observed.append(f"data-bound: the loop waited for batches {waited['median']:.0%} of its "
                        f"time (median over {waited['n']} runs)")
        if cpu:
            observed.append(f"workers at {cpu['p50']:.0f}% of a core each (p50): " + (
                "CPU-bound" if cpu["p50"] >= 80 else "not CPU-bound (storage, locks or too "
                                                     "few samples in flight?)"))
    elif waited:
        observed.append(f"step-bound: the loop waited for batches only {waited['median']:.0%} "
                        "of its time; a faster loader cannot speed this step up much")
    grown = m.get("worker_uss_growth_bytes")
    if grown and grown["max"] >= COPY_ON_READ_BYTES:
        observed.append(
            f"copy-on-read: each worker's private memory (USS) grew by up to "
            f"{grown['max'] / 2**20:,.0f} MiB while it ran: a forked worker copies the pages of "
            "the dataset's Python objects it reads (fastmm shares the dataset's lists, tuples "
            "and dicts instead: docs/loader.md)")
    hypotheses = []
    if not any(m.get(k) for k in ("read_s", "decode_s", "augment_s")):
        hypotheses.append("where inside __getitem__ the time goes is not measured: the Dataset "
                          "marks no stages (fastmm.telemetry.stage)")
    return {"observed": observed, "hypotheses": hypotheses,
            "queue_wait_share": waited}


def measure(args, dataset, step, collate_fn, log) -> dict:
    """Everything but the environment: probe, arms, check runs, timed rounds, summaries."""
    started = time.perf_counter()
    pipeline = probe(dataset, args, collate_fn, step)
    log(f"pipeline: {pipeline['batch']}; one batch in-process "
        f"{pipeline['one_batch_in_process_s']:.2f} s"
        + (f", the step {pipeline['step_s']:.2f} s" if step else ""))
    stage_dir = os.environ.get("FASTMM_STAGE_DIR") or os.path.join(args.out, "stage")
    try:
        return _measure(args, dataset, step, collate_fn, log, pipeline, stage_dir, started)
    finally:  # the copies of the source arm are not results
        if stage_dir != os.environ.get("FASTMM_STAGE_DIR"):
            shutil.rmtree(stage_dir, ignore_errors=True)


def _measure(args, dataset, step, collate_fn, log, pipeline, stage_dir, started) -> dict:
    chosen, skipped = arms(args, dataset, step is not None, stage_dir)
    profile_dir = os.path.join(args.out, "telemetry")
    warmup, timed = window_size(args, dataset, pipeline["one_batch_in_process_s"] /
                                max(1, args.num_workers) + pipeline["step_s"])
    run = Run(args.batch_size, collate_fn, step, args.seed, warmup, timed)
    baseline = next(a for a in chosen if a.name == "torch")
    # untimed: page cache, imports; its pace sets the window, its batches show reproducibility
    warm = run_once(baseline, run, check=True)
    if warm["batches"]:
        run.warmup, run.timed = window_size(args, dataset, (warm["window_s"] - warm["digest_s"])
                                            / warm["batches"])
    checks = {}
    for i, arm in enumerate(chosen, 1):  # the untimed check-and-profile run of each arm
        checks[arm.name] = c = run_once(arm, run, os.path.join(profile_dir, _slug(arm.name)),
                                        check=True)
        log(f"[check {i}/{len(chosen)}] {arm.name:28s} {len(c['digests'])} batches digested, "
            f"first batch {c['first_batch_s']:.2f} s")
    log(f"window: {run.timed} batches after {run.warmup} (about {args.seconds:g} s), "
        f"{args.reps} rounds of {len(chosen)} arms")
    reps = {a.name: [] for a in chosen}
    total, done, t0 = args.reps * len(chosen), 0, time.perf_counter()
    for r in range(args.reps):
        for arm in harness.rotated(chosen, r):
            rep = run_once(arm, run)
            reps[arm.name].append(rep)
            done += 1
            eta = (time.perf_counter() - t0) / done * (total - done)
            busy = rep["other_processes_cpu_cores"]
            log(f"[{done}/{total}] round {r + 1} {arm.name:28s} "
                f"{rep['samples_per_s'] or 0:8.1f} samples/s, "
                f"first batch {rep['first_batch_s']:.2f} s"
                + (f", others busy {busy:.2f} cores" if busy and busy > BUSY_CORES else "")
                + f" (eta {eta:.0f} s)")
    deterministic = reproducible(warm, checks["torch"], reps["torch"])
    out = {}
    for arm in chosen:
        entry = summarize_arm(arm, reps[arm.name], reps[arm.parent] if arm.parent else None)
        if arm.parent:
            entry["correctness"] = check(arm, checks[arm.name], checks[arm.parent], deterministic)
            entry["call"], entry["label"] = decide(entry)
        else:
            entry["correctness"] = {"check": "the same batches in every run (same seeds): "
                                             "its warm-up and check runs batch by batch, the "
                                             "first batch of every timed run",
                                    "ok": deterministic, "why": "the baseline's own "
                                    "reproducibility: what the other arms are checked against"}
        entry["reps"] = [{k: v for k, v in r.items() if k not in ("digests", "kept", "telemetry",
                                                                  "waits_s", "steps_s")}
                         for r in reps[arm.name]]
        entry["waits_s"] = [w for r in reps[arm.name] for w in r["waits_s"]]
        entry["steps_s"] = [s for r in reps[arm.name] for s in r["steps_s"]]
        entry["telemetry"] = checks[arm.name]["telemetry"]
        entry["telemetry_dir"] = os.path.relpath(os.path.join(profile_dir, _slug(arm.name)),
                                                 args.out)
        out[arm.name] = entry
    return {"pipeline": pipeline, "arms": out, "not_run": skipped,
            "method": {"busy_cores": BUSY_CORES, "memory_bar": MEMORY_BAR,
                       "roll_out_bar": stats.ROLL_OUT_BAR, "intervals": stats.CI_METHOD},
            "window": {"warmup_batches": run.warmup, "timed_batches": run.timed,
                       "reps": args.reps, "seconds": args.seconds},
            "deterministic": deterministic,
            "auto": tuned(args, dataset, step, collate_fn, log, deterministic)
            if "auto" in args.arms else None,
            "baseline_profile": reps["torch"][0]["telemetry"],
            "bottleneck": bottleneck(reps["torch"][0]["telemetry"], reps["torch"]),
            "measure_s": time.perf_counter() - started}


def tuned(args, dataset, step, collate_fn, log, deterministic: bool) -> dict:
    """The auto arm: fastmm's loader with num_workers="auto" against the best fixed
    ``(num_workers, prefetch_factor)`` of a sweep around the user's, the method of
    bench.tuning after the other arms: the sweep's rounds, then ``--reps`` rounds of the best,
    auto and the best again."""
    from . import tuning

    pipe = tuning.Pipeline(dataset, args.batch_size, step, collate_fn, args.pin_memory,
                           args.seed)
    settings = list(itertools.product(
        tuning.worker_counts(env.usable_cores(), args.num_workers),
        sorted({2, 4, args.prefetch_factor})))
    sweep_rounds = min(args.reps, tuning.SWEEP_ROUNDS)
    log(f"auto: {sweep_rounds} rounds of {len(settings)} fixed settings (windows of "
        f"{args.seconds:g} s), then {args.reps} of the best, num_workers='auto' "
        f"({args.auto_seconds:g} s) and the best again")
    done = tuning.study(pipe, settings, sweep_rounds, args.reps, args.seconds, args.auto_seconds,
                        say=lambda text: log(f"[auto] {text}"))
    call, label = tuning.call(done["summary"])
    if deterministic and not done["summary"]["same_first_batch"]:
        call, label = "roll back", label + "; but its first batch differed from round to round"
    return {"settings": settings, "seconds": args.seconds, "auto_seconds": args.auto_seconds,
            **done, "call": call, "label": label}


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "=-." else "_" for c in name).strip("_")


# -- the command ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fastmm-bench",
        description="Your own pipeline, torch's DataLoader against fastmm's and one change at a "
                    "time: " + __doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--dataset", required=True, metavar="TARGET",
                   help="module:callable or file.py:callable returning your Dataset")
    p.add_argument("--step", metavar="TARGET",
                   help="your training step, called with each batch (without it the loop reads "
                        "every byte of each batch)")
    p.add_argument("--collate", metavar="TARGET", help="your collate_fn")
    p.add_argument("--batch-size", type=options.whole(1), required=True)
    p.add_argument("--num-workers", type=options.whole(0), required=True)
    p.add_argument("--prefetch-factor", type=options.whole(1), default=2, help="(default 2)")
    p.add_argument("--pin-memory", action="store_true")
    p.add_argument("--out", type=options.directory, default="bench-out",
                   help="where index.html and results.json go (default bench-out)")
    p.add_argument("--reps", type=options.whole(1),
                   help=f"rounds of timed runs (default {FULL['reps']}: the fewest that give a "
                        "95%% CI)")
    p.add_argument("--seconds", type=options.number(0),
                   help=f"about how long a timed window lasts (default {FULL['seconds']})")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK['reps']} rounds of {QUICK['seconds']} s windows (no "
                        "95%% CI: the range of 3)")
    p.add_argument("--arms", type=options.listed(str, FACTORS), default=",".join(DEFAULT_ARMS),
                   help=f"which arms to run, of {','.join(FACTORS)} (default all but auto: "
                        "num_workers='auto' against a sweep of fixed settings, a few minutes "
                        "more)")
    p.add_argument("--auto-seconds", type=options.number(0),
                   help=f"how long the auto arm's loader runs from its constructor (default "
                        f"{FULL['auto_seconds']:g}; --quick {QUICK['auto_seconds']:g})")
    p.add_argument("--try-num-workers", type=options.whole(0),
                   help="the num_workers arm's count (default: twice yours within the cores, "
                        "else half)")
    p.add_argument("--try-prefetch-factor", type=options.whole(1),
                   help="the prefetch_factor arm's value (default twice yours)")
    p.add_argument("--seed", type=options.whole(0), default=0,
                   help="torch.manual_seed and the loaders' generator before every run")
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    parser.set_defaults(**FULL)
    args = options.parse(parser, argv, QUICK)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    try:
        factory = load_target(args.dataset, "--dataset")
        step = load_target(args.step, "--step") if args.step else None
        collate = load_target(args.collate, "--collate") if args.collate else None
    except TargetError as e:
        parser.exit(2, f"fastmm-bench: error: {e}\n")
    os.makedirs(args.out, exist_ok=True)
    for name in ("index.html", "results.json"):  # no earlier run's page may pass for this one's
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(args.out, name))
    started = time.perf_counter()
    try:
        dataset = make_dataset(factory, args.dataset)
    except TargetError as e:
        parser.exit(2, f"fastmm-bench: error: {e}\n")
    environment = env.capture(["fastmm-bench", *argv], loader_config={
        "batch_size": args.batch_size, "num_workers": args.num_workers,
        "prefetch_factor": args.prefetch_factor, "pin_memory": args.pin_memory})
    log(f"fastmm-bench: {args.dataset}: {environment['cpu_count_usable']} cores, "
        f"fastmm C++ path {environment['fastmm_uses_cpp']}, git {environment['git']['commit']}")
    try:
        result = measure(args, dataset, step, collate, log)
    except Exception:  # the user's pipeline raised: its traceback, and no report
        traceback.print_exc()
        print("fastmm-bench: stopped: the pipeline raised (above); no report was written",
              file=sys.stderr)
        return 1
    result.update(environment=environment, settings={k: v for k, v in vars(args).items()},
                  total_s=time.perf_counter() - started)
    result["pipeline"].update(dataset=args.dataset, step=args.step, collate=args.collate,
                              dataset_type=f"{type(dataset).__module__}."
                                           f"{type(dataset).__qualname__}",
                              map_style=not isinstance(dataset, torch.utils.data.IterableDataset))
    result["headline"] = ab_page.headline(result)
    result["answer"] = ab_page.answer(result)
    result["busy"], result["alerts"] = ab_page.busy(result), ab_page.alerts(result)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    page = ab_page.write_page(result, args.out)
    print("\n".join(result["answer"] + result["busy"] + result["alerts"]))
    print(f"report: {os.path.abspath(page)}")
    return 0
