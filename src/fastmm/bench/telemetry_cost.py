"""What telemetry costs: the same loader with telemetry off, on (summary) and on with the trace,
side by side, for torch's DataLoader and fastmm's, on the image pipelines of
``fastmm.bench.pipelines`` (decode-bound, 2 workers) and on a transport-bound dataset (tiny
samples, so per-sample and per-batch overhead shows).

A loader's arms run in blocks: each block starts a fresh loader per arm (all alive at once), then
the loop draws from one arm for a short window, then from the next, until each has had
``--min-seconds``. Windows of a fraction of a second cancel the slow drift of a shared machine
that separate runs of seconds each do not (there the same arm's rate ranged 1.6x); fresh loaders
per block average out what one loader's placement does to its speed (two loaders alike differ
by ~5% within a block here). The arm "off again" is a second loader without telemetry: its ratio
to "off" is how far apart two identical arms land, the noise floor the others are read against.
Ratios on / off are paired per block, for the rate and for the CPU time the arm's processes
spend per sample. Run: ``python -m fastmm.bench.telemetry_cost --out DIR`` (``--quick`` for a
smoke run).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import psutil
import torch
from torch.utils.data import Dataset

from ..telemetry import Telemetry
from . import env, harness, options, stats
from .corpus import default_cache_dir
from .mmcorpus import CorpusSpec
from .pipelines import SIZE, TorchImageDataset, _files, ensure_mmcorpus
from .report import save
from .workloads import CONSUMERS, batch_len

MODES = ("off", "off again", "summary", "trace")
AIMS = {"summary": 0.98, "trace": 0.95}  # rate on / off (issue 4)
# one window, and an arm's windows in a block: several batches a window (the first ones are
# skipped); decode-bound images need windows of seconds (1.5 s ones: noise floor 0.8-1.26)
WINDOW_S = {"images": 5.0, "tiny": 0.25}
MIN_S = {"images": 15.0, "tiny": 3.0}


class Tiny(Dataset):
    """Samples that cost almost nothing to make: what telemetry adds per sample shows."""

    def __len__(self):
        return 1 << 30

    def __getitem__(self, i):
        return torch.full((64,), i % 251, dtype=torch.uint8)


def _datasets(root: str) -> dict:
    import fastmm

    manifest = os.path.join(root, "posix", "manifest.jsonl")
    return {
        "images": {
            "torch": (torch.utils.data.DataLoader, TorchImageDataset(_files(root, ("jpg", "png")))),
            "fastmm": (fastmm.DataLoader, fastmm.MultimodalDataset(
                manifest, decoder="torchvision", reduce=True, modality="image", size=SIZE,
                transform=lambda item: item["image"])),
        },
        "tiny": {"torch": (torch.utils.data.DataLoader, Tiny()),
                 "fastmm": (fastmm.DataLoader, Tiny())},
    }


class _Arm:
    """One arm of a block: a fresh loader (watched, unless the mode is off), drawn from a window
    at a time, and what its windows added up to."""

    def __init__(self, loader, mode: str):
        self.session = None if mode.startswith("off") else Telemetry(trace=mode == "trace")
        # batches ready when a window starts were made while other arms ran: skipped
        self.ready = loader.prefetch_factor * loader.num_workers
        self.it = iter(self.session.watch(loader) if self.session else loader)
        self.workers = [psutil.Process(w.pid) for w in self.it._workers]
        self.samples, self.seconds, self.cpu_s = 0, 0.0, 0.0

    def _workers_cpu(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self.workers)

    def window(self, seconds: float, consume, counted: bool = True) -> None:
        for _ in range(self.ready):
            next(self.it)
        cpu0 = time.thread_time() + self._workers_cpu()
        samples, t0 = 0, time.perf_counter()
        while True:
            batch = next(self.it)
            consume(batch)
            samples += batch_len(batch)
            del batch
            t = time.perf_counter()
            if t >= t0 + seconds:
                break
        if counted:
            self.samples += samples
            self.seconds += t - t0
            self.cpu_s += time.thread_time() + self._workers_cpu() - cpu0

    def close(self) -> dict:
        """End the arm's loader; its telemetry's sampler thread CPU seconds and spans lost
        (a ring the drain fell behind on: that arm recorded less than it should have)."""
        if hasattr(self.it, "close"):
            self.it.close()
        self.it = None
        if self.session is None:
            return {"sampler_cpu_s": 0.0, "spans_dropped": 0}
        self.session.close()
        summary = self.session.summary()
        return {"sampler_cpu_s": summary["sampler_cpu_s"],
                "spans_dropped": summary["metrics"]["spans_dropped"]}


def _block(make, window_s: float, min_s: float, warmup_s: float, consume, index: int) -> dict:
    """One block: a fresh loader per mode (made in an order that moves on each block), windows
    in rotated order until every arm has had ``min_s``; per mode its rate, its CPU per sample
    (loop thread and workers in its windows, plus its sampler thread's share) and its sampler's
    CPU as a percentage of one core."""
    arms: dict[str, _Arm] = {}
    started = time.perf_counter()
    for mode in harness.rotated(list(MODES), index):  # every arm's workers fork before any
        arms[mode] = _Arm(make(), mode)  # sampler thread starts (see _EpochIterator)
    for arm in arms.values():
        arm.window(warmup_s, consume, counted=False)
    rounds = 0
    while min(arm.seconds for arm in arms.values()) < min_s:
        for mode in harness.rotated(list(MODES), rounds):
            arms[mode].window(window_s, consume)
        rounds += 1
    block_s = time.perf_counter() - started
    figures = {}
    for mode, arm in arms.items():
        ended = arm.close()
        sampler_s = ended["sampler_cpu_s"]
        cpu_s = arm.cpu_s + sampler_s * arm.seconds / block_s  # the sampler ran all block
        figures[mode] = {"samples": arm.samples, "seconds": arm.seconds,
                         "samples_per_s": arm.samples / arm.seconds,
                         "cpu_us_per_sample": cpu_s / arm.samples * 1e6,
                         "sampler_cpu_percent": 100 * sampler_s / block_s,
                         "spans_dropped": ended["spans_dropped"]}
    del arms
    gc.collect()
    figures["workers_alive_after"] = harness.wait_for_children()
    return figures


def run(args) -> dict:
    # the corpus of fastmm.bench.pipelines (same spec: generated once, shared in the cache)
    root = ensure_mmcorpus(CorpusSpec(num_images=args.images, num_videos=args.videos,
                                      seed=args.seed), args.cache_dir)
    consume = CONSUMERS["sum64"][0]
    out = {"command": " ".join(env.module_argv(__spec__, __name__)), "modes": MODES,
           "aims": AIMS, "cases": {}}
    for case, loaders in _datasets(root).items():
        if case not in args.workloads:
            continue
        batch = args.batch if case == "images" else 256
        window_s = WINDOW_S[case] if args.window_seconds is None else args.window_seconds
        min_s = MIN_S[case] if args.min_seconds is None else args.min_seconds
        blocks: dict[str, list] = {}
        for loader_name, (loader_class, dataset) in loaders.items():
            if loader_name not in args.loaders:
                continue
            for b in range(args.reps):

                def make(b=b):  # every arm of a block draws the same samples
                    torch.manual_seed(args.seed + b)
                    sampler = torch.utils.data.RandomSampler(dataset, replacement=True,
                                                             num_samples=1 << 40)
                    return loader_class(dataset, batch_size=batch, sampler=sampler,
                                        num_workers=args.num_workers)

                figs = _block(make, window_s, min_s, args.warmup_seconds, consume, b)
                blocks.setdefault(loader_name, []).append(figs)
                print(f"[{case}] block {b} {loader_name:7s} " + "  ".join(
                    f"{mode} {figs[mode]['samples_per_s']:.0f}/s" for mode in MODES),
                    file=sys.stderr, flush=True)

        def per_arm(key: str) -> dict:
            return {f"{name} {mode}": [figs[mode][key] for figs in bl]
                    for name, bl in blocks.items() for mode in MODES}

        def on_over_off(figure: dict) -> dict:
            return {f"{name} {mode}": stats.summarize(stats.paired_ratios(
                        figure[f"{name} {mode}"], figure[f"{name} off"]))
                    for name in blocks for mode in MODES[1:]}

        rates, cpu = per_arm("samples_per_s"), per_arm("cpu_us_per_sample")
        ratios = on_over_off(rates)
        out["cases"][case] = {
            "batch_size": batch, "num_workers": args.num_workers, "window_s": window_s,
            "min_s": min_s,
            "blocks": blocks,
            "arms": {n: stats.summarize(v) for n, v in rates.items()},
            "cpu_us_per_sample": {n: stats.summarize(v) for n, v in cpu.items()},
            "sampler_cpu_percent": {n: stats.summarize(v) for n, v in
                                    per_arm("sampler_cpu_percent").items()
                                    if not n.endswith(("off", "off again"))},
            "on_over_off": ratios, "cpu_on_over_off": on_over_off(cpu),
            "verdicts": {f"{name} {mode}": stats.verdict(ratios[f"{name} {mode}"], aim)
                         for name in blocks for mode, aim in AIMS.items()},
        }
    return out


def report(result: dict) -> str:
    lines = []
    for case, c in result["cases"].items():
        blocks = len(next(iter(c["blocks"].values())))
        lines.append(f"{case}: batch {c['batch_size']}, {c['num_workers']} workers, {blocks} "
                     f"blocks of {c['window_s']} s windows in turn (samples/s median [min-max]; "
                     "on / off paired per block: median [interval] (a 95% CI from 6 blocks, "
                     "else the range), the aim's verdict)")
        lines += _arm_lines(c["arms"], c["on_over_off"], ".1f", c["verdicts"])
        lines.append("  CPU us per sample, the arm's processes (on / off paired)")
        lines += _arm_lines(c["cpu_us_per_sample"], c["cpu_on_over_off"], ".3f", {})
        lines.append("  telemetry's sampler thread, % of one core (in the CPU figures above): "
                     + ", ".join(f"{n} {v['median']:.2f}" for n, v in
                                 c["sampler_cpu_percent"].items()))
    aims = ", ".join(f"{mode} >= {aim}" for mode, aim in result["aims"].items())
    lines.append(f"aims (rate on / off): {aims}; 'off again' is a second loader without "
                 "telemetry: its ratio is the noise floor")
    return "\n".join(lines)


def _arm_lines(arms: dict, ratios: dict, fmt: str, verdicts: dict) -> list[str]:
    lines = []
    for name, s in arms.items():
        r, extra = ratios.get(name), ""
        if r:
            extra = f"   {stats.interval(r, 3)}"
            if verdicts.get(name):
                extra += f" {verdicts[name]}"
        lines.append(f"  {name:16s} {s['median']:10{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]"
                     + extra)
    return lines


@options.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.telemetry_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=options.directory, default="bench-out/telemetry-cost")
    p.add_argument("--workloads", type=options.listed(str, ("images", "tiny")), default="images,tiny")
    p.add_argument("--loaders", type=options.listed(str, ("torch", "fastmm")),
                   default="torch,fastmm")
    p.add_argument("--images", type=options.whole(1), default=1500)
    p.add_argument("--videos", type=options.whole(1), default=24)
    p.add_argument("--batch", type=options.whole(1), default=64)
    p.add_argument("--num-workers", type=options.whole(1), default=2)
    p.add_argument("--reps", type=options.whole(1), default=8,
                   help="blocks (fresh loaders each) per loader and workload")
    p.add_argument("--min-seconds", type=options.number(0), default=None,
                   help=f"an arm's windows in a block add up to at least this (default {MIN_S})")
    p.add_argument("--window-seconds", type=options.number(0), default=None,
                   help=f"one window (default {WINDOW_S})")
    p.add_argument("--warmup-seconds", type=options.number(0), default=1.0)
    p.add_argument("--seed", type=options.whole(0), default=0)
    p.add_argument("--cache-dir", type=options.directory, default=str(default_cache_dir()))
    p.add_argument("--quick", action="store_true", help="smoke run: small corpus, short reps")
    args = options.parse(p, argv, {"images": 64, "videos": 4, "reps": 1, "min_seconds": 0.5,
                                   "warmup_seconds": 0.25})
    result = run(args)
    save(args.out, "telemetry_cost", result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
