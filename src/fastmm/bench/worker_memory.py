"""A worker's memory over a long run of varied image sizes, with fastmm's reuse of freed memory
(``FASTMM_WORKER_MALLOC=reuse``, the default) and without it (``system``: glibc's defaults, as
torch's workers run): does the memory a worker keeps for its next samples plateau, or grow?

The Dataset is the typical user one (PIL open, v2 RandomResizedCrop(224) + flip, PILToTensor)
over the multimodal corpus's photos, whose sizes vary from 300 px to 4K on the short side (5%
at 1080-2160 px), drawn in a seeded random order, ``--samples`` of them (default 20,000) per
setting; the loop reads every byte of each batch. The telemetry samples each worker's RSS every
0.5 s. Reported per setting: samples/s, each worker's RSS at each tenth of the run, its peak, and
its growth over the second half (the peak of the second half over the peak of the first).
Run: ``python -m fastmm.bench.worker_memory --out DIR`` (``--quick``: 2,000 samples).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import fastmm

from ..config import WORKER_MALLOC_MODES
from ..telemetry import Telemetry
from . import env, options, plots
from .ab import fastmm_settings
from .corpus import default_cache_dir
from .harness import OtherCores
from .mmcorpus import CorpusSpec
from .pipelines import _files, ensure_mmcorpus
from .report import busy_notes, save_study
from .workloads import JpegFolderDataset, sum64

GROWTH_BAR = 1.05  # a second half whose peak is at most this much the first half's: a plateau


def run(mode: str, files: list[str], args, series_dir: str) -> dict:
    """One long epoch with FASTMM_WORKER_MALLOC=mode; each worker's RSS over it, and the cores
    other processes used meanwhile (a busy machine slows the rate)."""
    dataset = JpegFolderDataset(files, length=args.samples)
    tm = Telemetry(interval_s=0.5)
    with fastmm_settings({"FASTMM_WORKER_MALLOC": mode}), OtherCores() as others:
        loader = fastmm.DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                   num_workers=args.num_workers,
                                   generator=torch.Generator().manual_seed(args.seed))
        start, samples = time.perf_counter(), 0
        for batch in tm.watch(loader):
            sum64(batch)
            samples += len(batch)
        seconds = time.perf_counter() - start
    tm.export(series_dir, trace=False)
    tm.close()
    with open(os.path.join(series_dir, "timeseries.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    workers = {}  # pid -> (seconds, RSS) while it lived
    for row in rows:
        for pid, rss in zip(row["pids"][1:], row["rss_bytes"][1:]):
            if rss is not None:
                workers.setdefault(pid, ([], []))
                workers[pid][0].append(row["t_s"])
                workers[pid][1].append(rss)
    out = {"mode": mode, "samples": samples, "seconds": seconds, "samples_per_s": samples / seconds,
           "other_processes_cpu_cores": others.cores, "workers": []}
    for t, rss in workers.values():
        half = len(rss) // 2
        out["workers"].append({
            "t_s": t, "rss_bytes": rss, "peak_rss_bytes": max(rss),
            "rss_at_tenths_bytes": [rss[min(len(rss) - 1, i * len(rss) // 10)] for i in range(1, 11)],
            "second_half_over_first": max(rss[half:]) / max(rss[:half]) if half else None,
        })
    return out


def _ratio(g: float | None) -> str:
    return "-" if g is None else f"{g:.3f}"


def finding(result: dict) -> dict:
    by = {r["mode"]: r for r in result["runs"]}
    reuse, system = by["reuse"], by["system"]
    growth = [w["second_half_over_first"] for w in reuse["workers"]]
    judged = all(g is not None for g in growth)  # a run too short for two halves is not
    flat = judged and all(g <= GROWTH_BAR for g in growth)
    peak = max(w["peak_rss_bytes"] for w in reuse["workers"]) / 2**20
    base = max(w["peak_rss_bytes"] for w in system["workers"]) / 2**20
    text = (f"Over {reuse['samples']:,} photos of varied sizes, each worker's RSS with freed memory "
            f"reused peaked at {peak:.0f} MiB (glibc's defaults: {base:.0f} MiB); its second "
            f"half's peak over its first: {', '.join(_ratio(g) for g in growth)} "
            f"({'a plateau' if flat else 'still growing' if judged else 'too short to tell'}, "
            f"bar {GROWTH_BAR}). Rate "
            f"{reuse['samples_per_s']:.0f} against {system['samples_per_s']:.0f} samples/s "
            "(one run each: not a speed comparison).")
    if not judged:
        return {"text": text, "call": "undecided", "label": "the run was too short to judge"}
    return {"text": text, "call": "roll out" if flat else "roll back",
            "label": "reuse on by default: a worker's memory plateaus" if flat else
                     "a worker's memory keeps growing with reuse on"}


def figures(result: dict) -> list[tuple]:
    series = {f"{r['mode']}, worker {i}": (w["t_s"], w["rss_bytes"])
              for r in result["runs"] for i, w in enumerate(r["workers"])}
    return [("worker-rss", plots.over_time(series, "worker RSS, MiB", yscale=2**-20),
             "Each worker's RSS over the run (telemetry, every 0.5 s), freed memory reused by "
             "glibc (reuse) or returned as glibc does by default (system).")]


@options.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.worker_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=options.directory,
                   default=os.path.join("bench-out", "worker-memory"))
    p.add_argument("--cache-dir", type=options.directory, default=str(default_cache_dir()))
    p.add_argument("--samples", type=options.whole(1), default=20_000)
    p.add_argument("--images", type=options.whole(1), default=600, help="distinct photos")
    p.add_argument("--batch-size", type=options.whole(1), default=64)
    p.add_argument("--num-workers", type=options.whole(1), default=2)
    p.add_argument("--seed", type=options.whole(0), default=0)
    p.add_argument("--quick", action="store_true", help="2,000 samples of 120 photos")
    args = options.parse(p, argv, {"samples": 2000, "images": 120})
    root = ensure_mmcorpus(CorpusSpec(num_images=args.images, num_videos=0, seed=args.seed),
                           args.cache_dir)
    files = _files(root, ("jpg", "png"))
    runs = []
    for mode in WORKER_MALLOC_MODES:
        print(f"[worker-memory] {mode}: {args.samples} samples ...", file=sys.stderr, flush=True)
        runs.append(run(mode, files, args, os.path.join(args.out, mode)))
    result = {"environment": env.capture(env.module_argv(__spec__, __name__),
                                         paths=[str(args.cache_dir)]),
              "samples": args.samples, "images": len(files), "batch_size": args.batch_size,
              "num_workers": args.num_workers, "growth_bar": GROWTH_BAR, "runs": runs,
              "busy": busy_notes("worker memory",
                                 [r["other_processes_cpu_cores"] for r in runs])}
    result["finding"] = finding(result)
    rows = [[r["mode"], f"{r['samples_per_s']:.0f}",
             ", ".join(f"{w['peak_rss_bytes'] / 2**20:.0f}" for w in r["workers"]),
             ", ".join(_ratio(w["second_half_over_first"]) for w in r["workers"]),
             "; ".join(" ".join(f"{x / 2**20:.0f}" for x in w["rss_at_tenths_bytes"])
                       for w in r["workers"])] for r in runs]
    save_study(args.out, "worker_memory", result, "A worker's memory over a long run",
               ["FASTMM_WORKER_MALLOC", "samples/s", "peak RSS MiB per worker",
                "2nd half / 1st half peak", "RSS MiB at each tenth, per worker"],
               rows, [f"Command: `{result['environment']['command']}`."], figures(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
