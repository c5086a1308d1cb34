"""``fastmm-bench``: torch.utils.data.DataLoader and fastmm.DataLoader side by side.

Each case (a workload at one batch size) has arms: the two loaders, plus in-process reference
arms that bound what a loader can reach on this machine. Every arm runs once untimed (warm-up),
then ``--reps`` rounds of every arm, each round starting one arm later (torch, fastmm,
references; fastmm, references, torch; ...), each time with a fresh DataLoader; then
``--mem-reps`` rounds of loader repetitions with the PSS sampler on: torch and fastmm at full
speed, then torch and fastmm paced (every loop step lasts
``PACE_FACTOR`` x torch's median batch interval, so both are consumer-bound with full prefetch
buffers). See ``benchmarks/README.md`` for what is measured and how to read it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.utils.data

from . import env, harness, options, report, stats
from .report import BUSY_CORES
from .corpus import default_cache_dir, ensure_corpus
from .workloads import (
    CONSUMERS,
    DEFAULT_CONSUMER,
    CaptionDataset,
    ClipBankDataset,
    JpegFolderDataset,
    keep_list,
    stack_numpy,
)

WORKLOADS = ("transport", "decode", "captions")
CLIP_MODES = ("view", "clone", "numpy", "bytes")
RESULTS_FORMAT = 3  # 2: consumer choice, consume-alone, paced memory repetitions, Shmem;
# 3: every batch of the warm-up digested (digests, summary.check), verdicts only from a 95% CI
BUSY_RETRIES = 2  # with --wait-quiet, a busy timed or memory repetition is redone at most this often
PACE_FACTOR = 1.5  # paced memory repetitions: step = PACE_FACTOR x torch's median batch interval
KEPT_PACE = 0.90  # a paced repetition kept pace if the loop waited for batches <= 10% of its window
# The PSS sampler sweeps at most this fraction of the time in paced repetitions: at 50 ms it
# takes about a core, which on a small machine keeps the workers from holding the pace at all.
PACED_PSS_MAX_DUTY = 0.2
MEMORY_TARGET = ("fastmm's host memory held no higher than torch's (peak of its processes' "
                 "Pss_Anon + Shmem, over idle; paired per round)")

QUICK = {
    "reps": 2,
    "mem_reps": 1,
    "min_seconds": 0.5,
    "warmup_seconds": 0.25,
    "num_images": 96,
    "decode_batch_sizes": "32",
    "clip_modes": "view",
}
FULL = {
    "reps": 6,
    "mem_reps": 2,
    "min_seconds": 3.0,
    "warmup_seconds": 1.0,
    "num_images": 2000,
    "decode_batch_sizes": "32,256",
    "clip_modes": "view,clone",
}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Arm:
    name: str
    kind: str  # "loader" (a DataLoader, gets memory repetitions) or "reference" (in-process)
    # (min_seconds, sample_pss, step_s or None, check) -> figures of one repetition; a check
    # repetition digests every batch (a loader's), else its first
    run: Callable[[float, bool, float | None, bool], dict]
    description: str


@dataclass
class Case:
    name: str
    workload: str
    batch_size: int
    num_workers: int
    description: str
    arms: list[Arm]
    details: dict = field(default_factory=dict)


def _loader_arm(name: str, loader_class, dataset, batch_size: int, num_workers: int, consume,
                seed: int, collate_fn=None, pin_memory: bool = False) -> Arm:
    def make():
        # The same global seed before every loader: both draw the same base seed, so their
        # workers' random transforms (decode) make the same batches and the digests compare.
        torch.manual_seed(seed)
        return loader_class(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                            collate_fn=collate_fn, pin_memory=pin_memory)

    def run(min_seconds: float, sample_pss: bool, step_s: float | None, check: bool) -> dict:
        return harness.run_loader(make, num_workers, min_seconds, consume, sample_pss=sample_pss,
                                  step_s=step_s,
                                  pss_max_duty=PACED_PSS_MAX_DUTY if step_s is not None else None,
                                  digest_all=check)

    return Arm(
        name,
        "loader",
        run,
        f"{loader_class.__module__}.{loader_class.__qualname__}(batch_size={batch_size}, "
        f"num_workers={num_workers}, shuffle=False"
        + (f", collate_fn={collate_fn.__name__}" if collate_fn else "")
        + (", pin_memory=True" if pin_memory else "")
        + f"; other arguments default), built right after torch.manual_seed({seed})",
    )


def _loader_arms(dataset, batch_size: int, args, collate_fn=None) -> list[Arm]:
    import fastmm

    consume = CONSUMERS[args.consume][0]
    return [
        _loader_arm("torch", torch.utils.data.DataLoader, dataset, batch_size, args.num_workers,
                    consume, args.seed, collate_fn, args.pin_memory),
        _loader_arm("fastmm", fastmm.DataLoader, dataset, batch_size, args.num_workers, consume,
                    args.seed, collate_fn, args.pin_memory),
    ]


def transport_case(args, clip_mode: str) -> Case:
    shape = tuple(args.clip_shape)
    dataset = ClipBankDataset(shape, bank_size=args.clip_bank, mode=clip_mode, seed=args.seed)
    b = args.transport_batch_size
    consume = CONSUMERS[args.consume][0]
    custom_collate = {"numpy": stack_numpy, "bytes": keep_list}.get(clip_mode)
    collate_fn = custom_collate or torch.utils.data.default_collate
    arms = _loader_arms(dataset, b, args, custom_collate) + [
        Arm(
            "single-process",
            "reference",
            lambda s, *_: harness.run_single_process(dataset, b, s, consume,
                                                        collate_fn=collate_fn),
            f"getitem x batch + {collate_fn.__name__} + {args.consume} of the batch, in the "
            "main process, torch on 1 thread",
        ),
        Arm(
            "single-reuse",
            "reference",
            lambda s, *_: harness.run_single_process(dataset, b, s, consume, reuse_batch=True),
            "as single-process, but stacking into one preallocated batch reused every time: "
            "the least work any loader must do per batch",
        ),
        Arm(
            "consume-alone",
            "reference",
            lambda s, *_: harness.run_consume_only(dataset, b, s, consume, collate_fn,
                                                      pin_memory=args.pin_memory),
            f"the loop's consumer ({args.consume}) over one batch already in "
            + ("page-locked " if args.pin_memory else "")
            + "memory, repeatedly, on one thread (the loop's own cost)",
        ),
    ]
    shape_text = "x".join(str(v) for v in shape)
    return Case(
        name=f"transport-{clip_mode}-b{b}",
        workload="transport",
        batch_size=b,
        num_workers=args.num_workers,
        description=(
            f"{shape_text} uint8 clips from a bank of {args.clip_bank} (getitem returns a "
            + {"clone": "fresh clone", "view": "view of the bank, no copy",
               "numpy": "view of the bank as a NumPy array, and collate_fn=stack_numpy keeps "
                        "the batch one",
               "bytes": "its bytes as a read-only flat NumPy array (np.frombuffer), and "
                        "collate_fn=keep_list keeps the samples apart"}[clip_mode]
            + f"); loop: {args.consume} over every byte of each batch"
        ),
        arms=arms,
        details={
            "clip_shape": list(shape),
            "clip_bank": args.clip_bank,
            "clip_mode": clip_mode,
            "sample_bytes": dataset.sample_bytes,
            "batch_bytes": dataset.sample_bytes * b,
        },
    )


def decode_cases(args, corpus) -> list[Case]:
    dataset = JpegFolderDataset(corpus.files)
    cases = []
    for b in args.decode_batch_sizes:
        arms = _loader_arms(dataset, b, args) + [
            Arm(
                "getitem-1-thread",
                "reference",
                lambda s, *_: harness.run_getitem(dataset, s),
                "dataset[i] alone, sequentially, in the main process, torch on 1 thread",
            )
        ]
        cases.append(
            Case(
                name=f"decode-b{b}",
                workload="decode",
                batch_size=b,
                num_workers=args.num_workers,
                description=(
                    f"{corpus.num_images} JPEGs (~{corpus.mean_width:.0f}x{corpus.mean_height:.0f}, "
                    f"q90): PIL open + convert RGB + v2.RandomResizedCrop(224) + "
                    f"RandomHorizontalFlip + PILToTensor; loop: {args.consume} over each batch"
                ),
                arms=arms,
                details={"corpus": corpus.describe()},
            )
        )
    return cases


def captions_cases(args) -> list[Case]:
    cases = []
    b = args.captions_batch_size
    for labels in (False, True):
        dataset = CaptionDataset(labels=labels)
        arms = _loader_arms(dataset, b, args) + [
            Arm(
                "getitem-1-thread",
                "reference",
                lambda s, *_, dataset=dataset: harness.run_getitem(dataset, s),
                "dataset[i] alone, sequentially, in the main process, torch on 1 thread",
            )
        ]
        cases.append(Case(
            name=f"captions{'-labels' if labels else ''}-b{b}",
            workload="captions",
            batch_size=b,
            num_workers=args.num_workers,
            description=(
                "a caption string (~60 characters) per sample" + (
                    " and an int label: a batch is a list of strings and a label tensor"
                    if labels else ": a batch is a list of strings, no tensor at all")
                + f"; each loader's fixed cost per batch; loop: {args.consume} over its bytes"
            ),
            arms=arms,
            details={"labels": labels},
        ))
    return cases


def _progress(case: Case, label: str, arm: Arm, fig: dict) -> None:
    rate = fig.get("samples_per_s")
    parts = [f"[{case.name}] {label:<13} {arm.name:<17}"]
    parts.append(f"{rate:9.1f} samples/s" if rate else "        - samples/s")
    if fig.get("bytes_per_s"):
        parts.append(f"{fig['bytes_per_s'] / 1e9:6.2f} GB/s")
    parts.append(f"window {fig['window_s']:.2f} s / {fig['batches']} batches")
    if fig.get("first_batch_s") is not None:
        parts.append(f"first batch {fig['first_batch_s']:.2f} s")
    if fig.get("peak_host_held_bytes") is not None:
        parts.append(f"host memory held {fig['peak_host_held_bytes'] / 2**20:.0f} MiB")
    if "peak_total_pss_bytes" in fig:
        parts.append(f"peak PSS {fig['peak_total_pss_bytes'] / 2**20:.0f} MiB "
                     f"(+{(fig['peak_total_pss_bytes'] - fig['baseline_pss_bytes']) / 2**20:.0f})")
    if fig.get("pace_step_s"):
        parts.append(f"paced {fig['pace_step_s'] * 1e3:.0f} ms/step, waited "
                     f"{fig['fetch_wait_s']:.2f} s for batches")
    if fig.get("exhausted"):
        parts.append("(dataset ran out before the window closed)")
    _log("  ".join(parts))


def run_case(case: Case, args) -> dict:
    """Warm-up, timed repetitions and memory repetitions of every arm, interleaved."""
    reps: dict[str, list[dict]] = {arm.name: [] for arm in case.arms}
    order = 0

    def one(arm: Arm, phase: str, index: int, min_seconds: float, sample_pss: bool, label: str,
            step_s: float | None = None):
        nonlocal order
        redo = args.wait_quiet > 0 and phase != "warmup"
        for attempt in range(1 + (BUSY_RETRIES if redo else 0)):
            quiet = harness.wait_for_quiet(args.wait_quiet) if args.wait_quiet > 0 else {}
            if quiet and not quiet["quiet_before_start"]:
                _log(f"[{case.name}] the machine stayed busy for {args.wait_quiet:.0f} s "
                     f"(others used {quiet['other_processes_cpu_cores_before_start']:.2f} cores); going on")
            started = time.time()
            fig = arm.run(min_seconds, sample_pss, step_s, phase == "warmup")
            fig = {"phase": phase, "rep": index, "order": order, "started_unix_s": started, **quiet, **fig}
            order += 1
            busy = (fig.get("other_processes_cpu_cores") or 0.0) > BUSY_CORES
            retry = busy and redo and attempt < BUSY_RETRIES
            if retry:  # kept in the record, left out of the statistics, and run again
                fig["phase"] = f"{phase}-busy-discarded"
            reps[arm.name].append(fig)
            _progress(case, label + (" (busy: redo)" if retry else ""), arm, fig)
            if not retry:
                return

    for arm in case.arms:
        one(arm, "warmup", 0, args.warmup_seconds, False, "warm-up")
    for r in range(args.reps):
        for arm in harness.rotated(case.arms, r):
            one(arm, "timed", r, args.min_seconds, False, f"rep {r + 1}/{args.reps}")
    step_s = pace_step_s(case.batch_size, reps["torch"])
    loaders = [arm for arm in case.arms if arm.kind == "loader"]
    for r in range(args.mem_reps):
        for arm in harness.rotated(loaders, r):
            one(arm, "memory", r, args.min_seconds, True, f"mem {r + 1}/{args.mem_reps}")
        for arm in harness.rotated(loaders, r) if step_s else []:
            one(arm, "memory-paced", r, args.min_seconds, True, f"paced {r + 1}/{args.mem_reps}",
                step_s=step_s)
    return {
        "name": case.name,
        "workload": case.workload,
        "description": case.description,
        "batch_size": case.batch_size,
        "num_workers": case.num_workers,
        "details": case.details,
        "arms": {
            arm.name: {"kind": arm.kind, "description": arm.description, "reps": reps[arm.name]}
            for arm in case.arms
        },
        "summary": summarize_case(case, reps, args.cores, step_s),
    }


def pace_step_s(batch_size: int, torch_reps: list[dict]) -> float | None:
    """The paced repetitions' step: PACE_FACTOR x torch's median batch interval in the timed
    repetitions of the case (batch_size / median samples/s), the same for both loaders."""
    rate = stats.summarize(_timed(torch_reps, "samples_per_s"))
    return PACE_FACTOR * batch_size / rate["median"] if rate and rate["median"] else None


def _timed(reps: list[dict], key: str) -> list:
    return [r.get(key) for r in reps if r["phase"] == "timed"]


def _over_idle(reps: list[dict]) -> list[int]:
    return [r["peak_total_pss_bytes"] - r["baseline_pss_bytes"] for r in reps]


def _shmem_over_idle(reps: list[dict]) -> list[int | None]:
    return [
        r["peak_shmem_bytes"] - r["baseline_shmem_bytes"]
        if r.get("peak_shmem_bytes") is not None and r.get("baseline_shmem_bytes") is not None
        else None
        for r in reps
    ]


def _kept_pace(rep: dict) -> bool:
    """A paced repetition kept pace when the loop waited for batches at most 1 - KEPT_PACE of
    its window: the loader had the next batch ready (its buffers full) at nearly every step."""
    return rep["fetch_wait_s"] <= (1.0 - KEPT_PACE) * rep["window_s"]


def _memory_condition(arms: dict, reps: dict[str, list[dict]], phase: str) -> dict | None:
    """Peak PSS of both loaders under one condition (max throughput or paced) and the verdict
    on the memory target (fastmm's peak over idle no higher than torch's), from the ratios of
    the rounds' repetitions, which ran back to back."""
    prefix = "paced_" if phase == "memory-paced" else ""
    torch_reps, fastmm_reps = ([r for r in reps[name] if r["phase"] == phase]
                               for name in ("torch", "fastmm"))
    held = stats.summarize(stats.paired_ratios(
        [r.get("peak_host_held_bytes") for r in fastmm_reps],
        [r.get("peak_host_held_bytes") for r in torch_reps]))
    over_idle = stats.summarize(stats.paired_ratios(_over_idle(fastmm_reps), _over_idle(torch_reps)))
    total = stats.summarize(stats.paired_ratios(
        [r["peak_total_pss_bytes"] for r in fastmm_reps], [r["peak_total_pss_bytes"] for r in torch_reps]))
    t_idle = arms["torch"][prefix + "peak_pss_over_baseline_bytes"]
    f_idle = arms["fastmm"][prefix + "peak_pss_over_baseline_bytes"]
    t_total = arms["torch"][prefix + "peak_total_pss_bytes"]
    f_total = arms["fastmm"][prefix + "peak_total_pss_bytes"]
    t_shm = arms["torch"][prefix + "peak_shmem_over_baseline_bytes"]
    f_shm = arms["fastmm"][prefix + "peak_shmem_over_baseline_bytes"]
    t_held = arms["torch"][prefix + "peak_host_held_bytes"]
    f_held = arms["fastmm"][prefix + "peak_host_held_bytes"]
    if not (t_idle and f_idle):
        return None
    return {
        "torch_samples_per_s": arms["torch"][
            "paced_samples_per_s" if prefix else "samples_per_s_with_pss_sampler"]["median"],
        "fastmm_samples_per_s": arms["fastmm"][
            "paced_samples_per_s" if prefix else "samples_per_s_with_pss_sampler"]["median"],
        "torch_peak_total_pss_bytes": t_total["median"],
        "fastmm_peak_total_pss_bytes": f_total["median"],
        "torch_peak_pss_over_baseline_bytes": t_idle["median"],
        "fastmm_peak_pss_over_baseline_bytes": f_idle["median"],
        "ratio_over_baseline_fastmm_over_torch": (
            f_idle["median"] / t_idle["median"] if t_idle["median"] > 0 else None
        ),
        "paired_ratios_over_baseline": over_idle,
        "torch_host_held_bytes": t_held["median"] if t_held else None,
        "fastmm_host_held_bytes": f_held["median"] if f_held else None,
        "paired_ratios_host_held": held,
        "verdict": stats.verdict(held, 1.0, at_most=True) if held else None,
        "verdict_on_pss": stats.verdict(over_idle, 1.0, at_most=True),
        "verdict_on_total": stats.verdict(total, 1.0, at_most=True),
        "torch_peak_shmem_over_baseline_bytes": t_shm["median"] if t_shm else None,
        "fastmm_peak_shmem_over_baseline_bytes": f_shm["median"] if f_shm else None,
    }


def batch_check(reps: dict[str, list[dict]]) -> dict:
    """Whether torch and fastmm delivered the same batches. Deterministic data (transport) or
    the same seed before every loader (decode) make every repetition's batches the same: the
    warm-up repetitions (untimed, every batch digested) are compared batch by batch over the
    batches both delivered, and the first batch of every other loader repetition against
    them. A repetition with no digest fails the check, as do check runs with no batch."""
    torch_all, fastmm_all = (next(r["digests"] for r in reps[name] if r["phase"] == "warmup")
                             for name in ("torch", "fastmm"))
    compared = min(len(torch_all), len(fastmm_all))
    differ = next((i for i in range(compared) if torch_all[i] != fastmm_all[i]), None)
    firsts = [r["digests"][0] if r["digests"] else None
              for name in ("torch", "fastmm") for r in reps[name] if r["phase"] != "warmup"]
    first_differs = sum(d != torch_all[0] for d in firsts) if torch_all else len(firsts)
    return {"batches_compared": compared, "first_difference": differ,
            "repetitions_first_batch": len(firsts),
            "repetitions_first_batch_differs": first_differs,
            "ok": compared > 0 and differ is None and first_differs == 0}


def summarize_case(case: Case, reps: dict[str, list[dict]], cores: int,
                   step_s: float | None = None) -> dict:
    arms = {}
    for name, figs in reps.items():
        timed = [r for r in figs if r["phase"] == "timed"]
        memory = [r for r in figs if r["phase"] == "memory"]
        paced = [r for r in figs if r["phase"] == "memory-paced"]
        cpu_per_sample = [
            r["tree_cpu_s"] / r["samples"] * 1e3
            for r in timed
            if r.get("tree_cpu_s") is not None and r["samples"]
        ]
        foreign = [r["other_processes_cpu_cores"] for r in timed]
        arms[name] = {
            "samples_per_s": stats.summarize(_timed(figs, "samples_per_s")),
            "bytes_per_s": stats.summarize(_timed(figs, "bytes_per_s")),
            "first_batch_s": stats.summarize(_timed(figs, "first_batch_s")),
            "teardown_s": stats.summarize(_timed(figs, "teardown_s")),
            "window_s": stats.summarize(_timed(figs, "window_s")),
            "cpu_ms_per_sample": stats.summarize(cpu_per_sample),
            "other_processes_cpu_cores": stats.summarize(foreign),
            "peak_total_pss_bytes": stats.summarize([r.get("peak_total_pss_bytes") for r in memory]),
            "peak_pss_over_baseline_bytes": stats.summarize(_over_idle(memory)),
            "peak_shmem_over_baseline_bytes": stats.summarize(_shmem_over_idle(memory)),
            "peak_host_held_bytes": stats.summarize([r.get("peak_host_held_bytes") for r in memory]),
            "samples_per_s_with_pss_sampler": stats.summarize([r.get("samples_per_s") for r in memory]),
            "paced_peak_total_pss_bytes": stats.summarize([r.get("peak_total_pss_bytes") for r in paced]),
            "paced_peak_pss_over_baseline_bytes": stats.summarize(_over_idle(paced)),
            "paced_peak_shmem_over_baseline_bytes": stats.summarize(_shmem_over_idle(paced)),
            "paced_peak_host_held_bytes": stats.summarize(
                [r.get("peak_host_held_bytes") for r in paced]),
            "paced_samples_per_s": stats.summarize([r.get("samples_per_s") for r in paced]),
            "paced_fetch_wait_s": stats.summarize([r.get("fetch_wait_s") for r in paced]),
        }
    torch_rates = _timed(reps["torch"], "samples_per_s")
    fastmm_rates = _timed(reps["fastmm"], "samples_per_s")
    t_med = arms["torch"]["samples_per_s"]["median"]
    f_med = arms["fastmm"]["samples_per_s"]["median"]
    summary = {
        "arms": arms,
        "ratio_fastmm_over_torch": f_med / t_med if t_med else None,
        "paired_ratios_fastmm_over_torch": stats.summarize(stats.paired_ratios(fastmm_rates, torch_rates)),
    }
    summary["check"] = batch_check(reps)
    paced_rate = case.batch_size / step_s if step_s else None
    paced_reps = {name: [r for r in reps[name] if r["phase"] == "memory-paced"] for name in ("torch", "fastmm")}
    kept_pace = {
        name: all(_kept_pace(r) for r in figs) if figs else None for name, figs in paced_reps.items()
    }
    paced = _memory_condition(arms, reps, "memory-paced")
    if paced is not None:
        # The paced comparison means something only if both loaders held full buffers.
        paced["conclusive"] = all(kept_pace.values())
    summary["memory"] = {
        "target": MEMORY_TARGET,
        "max_throughput": _memory_condition(arms, reps, "memory"),
        "paced": paced,
        "pace_factor": PACE_FACTOR,
        "kept_pace_fraction": KEPT_PACE,
        "paced_step_s": step_s,
        "paced_target_samples_per_s": paced_rate,
        "kept_pace": kept_pace,
    }
    if case.workload == "transport":
        consume_alone = arms["consume-alone"]["samples_per_s"]["median"]
        single = arms["single-process"]["samples_per_s"]["median"]
        reuse = arms["single-reuse"]["samples_per_s"]["median"]
        # The loop reads every byte on one core, so no loader can beat the consumer alone.
        summary["ceiling"] = {
            "consume_alone_samples_per_s": consume_alone,
            "single_process_samples_per_s": single,
            "single_reuse_samples_per_s": reuse,
            "cores": cores,
            "cores_x_single_process_samples_per_s": cores * single,
            "cores_x_single_reuse_samples_per_s": cores * reuse,
            "torch_fraction_of_ceiling": t_med / consume_alone,
            "fastmm_fraction_of_ceiling": f_med / consume_alone,
            "highest_possible_ratio_over_torch": consume_alone / t_med,
        }
        summary["target"] = {
            "description": "fastmm >= 3x torch samples/s",
            "ratio": 3.0,
            "verdict": stats.verdict(summary["paired_ratios_fastmm_over_torch"], 3.0),
        }
    else:
        getitem = _timed(reps["getitem-1-thread"], "samples_per_s")
        limit = cores * arms["getitem-1-thread"]["samples_per_s"]["median"]
        summary["decode_limit"] = {
            "cores": cores,
            "getitem_1_thread_samples_per_s": arms["getitem-1-thread"]["samples_per_s"]["median"],
            "limit_samples_per_s": limit,
            "torch_fraction_of_limit": t_med / limit,
            "fastmm_fraction_of_limit": f_med / limit,
            "torch_fraction_of_limit_per_rep": stats.summarize(
                [t / (cores * g) for t, g in zip(torch_rates, getitem) if t and g]
            ),
            "fastmm_fraction_of_limit_per_rep": stats.summarize(
                [f / (cores * g) for f, g in zip(fastmm_rates, getitem) if f and g]
            ),
        }
        aim = 1.05 if case.batch_size >= 256 else 1.0
        summary["target"] = {
            "description": "fastmm never slower than torch"
            + ("; aim >= 1.05x at batch 256" if aim > 1.0 else ""),
            "ratio": aim,
            "verdict": stats.verdict(summary["paired_ratios_fastmm_over_torch"], aim),
        }
    foreign = [
        a["other_processes_cpu_cores"]["max"] for a in arms.values() if a["other_processes_cpu_cores"]
    ]
    summary["other_processes_cpu_cores_max"] = max(foreign) if foreign else None
    summary["busy_timed_reps"] = sum(
        1
        for figs in reps.values()
        for r in figs
        if r["phase"] == "timed" and (r["other_processes_cpu_cores"] or 0.0) > BUSY_CORES
    )
    summary["timed_reps"] = sum(1 for figs in reps.values() for r in figs if r["phase"] == "timed")
    summary["busy_memory_reps"] = sum(
        1
        for figs in reps.values()
        for r in figs
        if r["phase"] in ("memory", "memory-paced") and (r["other_processes_cpu_cores"] or 0.0) > BUSY_CORES
    )
    summary["discarded_busy_reps"] = sum(
        1 for figs in reps.values() for r in figs if r["phase"].endswith("-busy-discarded")
    )
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastmm-bench",
        description=(
            "Benchmark torch.utils.data.DataLoader and fastmm.DataLoader side by side: same "
            "dataset, batch size and workers, interleaved repetitions, medians and spread."
        ),
        epilog="Your own pipeline instead: fastmm-bench --dataset MODULE:CALLABLE [--step "
               "MODULE:CALLABLE] --batch-size N --num-workers N --out DIR (fastmm-bench "
               "--dataset x --help for its options).",
    )
    parser.add_argument("--out", type=options.directory, default="bench-out", help="output directory (default: bench-out)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: " + ", ".join(f"{k.replace('_', '-')}={v}" for k, v in QUICK.items()))
    parser.add_argument("--workloads", type=options.listed(str, WORKLOADS), default="transport,decode",
                        help=f"comma-separated subset of {','.join(WORKLOADS)} "
                        "(default: transport,decode)")
    parser.add_argument("--reps", type=options.whole(1), help=f"timed repetitions per arm (default {FULL['reps']})")
    parser.add_argument("--mem-reps", type=options.whole(0),
                        help="rounds of memory repetitions with the PSS sampler on, each one "
                        f"max-throughput and one paced repetition per loader (default {FULL['mem_reps']})")
    parser.add_argument("--min-seconds", type=options.number(0),
                        help=f"shortest throughput window of a repetition (default {FULL['min_seconds']})")
    parser.add_argument("--warmup-seconds", type=options.number(0),
                        help=f"window of the untimed warm-up repetition (default {FULL['warmup_seconds']})")
    parser.add_argument("--num-workers", type=options.whole(1), default=2, help="loader workers (default 2)")
    parser.add_argument("--transport-batch-size", type=options.whole(1), default=32, help="(default 32)")
    parser.add_argument("--captions-batch-size", type=options.whole(1), default=32, help="(default 32)")
    parser.add_argument("--clip-shape", type=options.listed(options.whole(1)), default="16,3,224,224",
                        help="transport sample shape, uint8 (default 16,3,224,224)")
    parser.add_argument("--clip-bank", type=options.whole(1), default=8, help="distinct clips preallocated (default 8)")
    parser.add_argument("--clip-modes", type=options.listed(str, CLIP_MODES),
                        help="transport cases to run, comma-separated: 'view' (getitem returns the "
                        "bank's tensor: the batch copy is the only copy, so transport dominates) "
                        "and/or 'clone' (a fresh copy per sample, as a decoder would hand out) "
                        "and/or 'numpy' (the view as a NumPy array, batched by a collate_fn "
                        "that keeps NumPy) and/or 'bytes' (the clip's bytes as a read-only "
                        "array, np.frombuffer's, in a list per batch: raw bytes for a GPU decoder) "
                        f"(default {FULL['clip_modes']})"),
    parser.add_argument("--decode-batch-sizes", type=options.listed(options.whole(1)),
                        help=f"comma-separated (default {FULL['decode_batch_sizes']})")
    parser.add_argument("--num-images", type=options.whole(1),
                        help=f"JPEGs in the decode corpus (default {FULL['num_images']})")
    parser.add_argument("--cache-dir", type=options.directory, default=None,
                        help=f"where the JPEG corpus is generated and reused (default {default_cache_dir()})")
    parser.add_argument("--seed", type=options.whole(0), default=0,
                        help="data seed, and torch.manual_seed before every loader (default 0)")
    parser.add_argument("--consume", choices=sorted(CONSUMERS), default=DEFAULT_CONSUMER,
                        help="the training-loop stand-in that reads every byte of each batch: "
                        "'sum64' (uint64 sum, memory speed on one thread) or 'crc32' (zlib, "
                        f"~3 GB/s) or 'cuda' (copied to the GPU, non_blocking, and synchronized; "
                        f"with --pin-memory, the host-to-device path) (default {DEFAULT_CONSUMER})")
    parser.add_argument("--pin-memory", action="store_true",
                        help="both loaders with pin_memory=True (batches in page-locked memory, "
                        "for --consume cuda's copies; needs CUDA)")
    parser.add_argument("--wait-quiet", type=options.number(0, above=False), default=0.0, metavar="SECONDS",
                        help="before each repetition, wait up to SECONDS until other processes use "
                        f"< {BUSY_CORES} cores, and redo (up to {BUSY_RETRIES} times) a timed or memory repetition "
                        "during which they used more; the busy one stays in the JSON with phase "
                        "'<phase>-busy-discarded' (default 0: neither wait nor redo)")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    parser.set_defaults(**FULL)
    args = options.parse(parser, argv, QUICK)
    if (args.pin_memory or args.consume == "cuda") and not torch.cuda.is_available():
        parser.error("--pin-memory and --consume cuda need a CUDA device; torch sees none")
    args.cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    return args


@options.command
def main(argv=None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if any(a == "--dataset" or a.startswith("--dataset=") for a in given):
        from . import ab

        return ab.main(given)
    args = parse_args(argv)
    args.cores = env.usable_cores()
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    program = [sys.argv[0]] if argv is None and not sys.argv[0].endswith("__main__.py") else [
        "python", "-m", "fastmm.bench"]  # a command that runs it again
    environment = env.capture(
        [*program, *(sys.argv[1:] if argv is None else argv)],
        loader_config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list))},
        paths=[str(args.cache_dir)],
    )
    _log(
        f"fastmm-bench: {environment['cpu_count_usable']} cores, load {os.getloadavg()[0]:.2f}, "
        f"fastmm C++ path: {environment['fastmm_uses_cpp']}, git {environment['git']['commit']}"
    )
    cases = []
    if "transport" in args.workloads:
        cases.extend(transport_case(args, mode) for mode in args.clip_modes)
    if "decode" in args.workloads:
        corpus = ensure_corpus(args.cache_dir, args.num_images, seed=args.seed, log=_log)
        cases.extend(decode_cases(args, corpus))
    if "captions" in args.workloads:
        cases.extend(captions_cases(args))
    results = {
        "format": RESULTS_FORMAT,
        "environment": environment,
        "settings": {
            "quick": args.quick,
            "workloads": args.workloads,
            "reps": args.reps,
            "mem_reps": args.mem_reps,
            "min_seconds": args.min_seconds,
            "warmup_seconds": args.warmup_seconds,
            "num_workers": args.num_workers,
            "transport_batch_size": args.transport_batch_size,
            "captions_batch_size": args.captions_batch_size,
            "decode_batch_sizes": args.decode_batch_sizes,
            "clip_shape": args.clip_shape,
            "clip_bank": args.clip_bank,
            "clip_modes": args.clip_modes,
            "num_images": args.num_images,
            "cache_dir": str(args.cache_dir),
            "seed": args.seed,
            "consume": args.consume,
            "pin_memory": args.pin_memory,
            "pace_factor": PACE_FACTOR,
            "kept_pace_fraction": KEPT_PACE,
            "pss_interval_s": harness.PSS_INTERVAL_S,
            "paced_pss_max_duty": PACED_PSS_MAX_DUTY,
            "wait_quiet_s": args.wait_quiet,
            "busy_threshold_cores": BUSY_CORES,
            "cores_for_limits": args.cores,
        },
        "method": report.method(args.consume),
        "cases": [],
    }
    try:
        for case in cases:
            results["cases"].append(run_case(case, args))
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the finished cases are kept
        if not results["cases"]:
            raise
        results["interrupted"] = f"after {len(results['cases'])} of {len(cases)} cases"
    results["environment"]["loadavg_at_end"] = list(os.getloadavg())
    results["total_s"] = time.perf_counter() - started
    json_path = out / "results.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    md_path = out / "summary.md"
    md_path.write_text(report.markdown(results))
    html_path = report.write_html(results, str(out))
    print(report.text(results))
    _log(f"wrote {json_path} and {md_path} ({results['total_s']:.0f} s)"
         + (f"; interrupted {results['interrupted']}" if "interrupted" in results else ""))
    print(f"report: {os.path.abspath(html_path)}")
    return 130 if "interrupted" in results else 0


if __name__ == "__main__":
    raise SystemExit(main())
