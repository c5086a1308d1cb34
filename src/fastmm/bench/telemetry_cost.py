"""What telemetry costs: the same loader with telemetry off, on (summary) and on with the trace,
side by side, for torch's DataLoader and fastmm's, on the image pipelines of
``fastmm.bench.pipelines`` (decode-bound, 2 workers) and on a transport-bound dataset (tiny
samples, so per-sample and per-batch overhead shows). Repetitions interleaved (each round
starting one arm later) after a warm-up; medians with min-max and paired ratios to "off", for
the rate and for the CPU time all the loader's processes spend per sample. Run:
``python -m fastmm.bench.telemetry_cost --out DIR`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.utils.data import Dataset

from ..telemetry import Telemetry
from . import env, harness, options, stats
from .corpus import default_cache_dir
from .mmcorpus import CorpusSpec
from .pipelines import SIZE, TorchImageDataset, _files, ensure_mmcorpus
from .report import save
from .workloads import CONSUMERS

MODES = ("off", "summary", "trace")


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


def run(args) -> dict:
    # the corpus of fastmm.bench.pipelines (same spec: generated once, shared in the cache)
    root = ensure_mmcorpus(CorpusSpec(num_images=args.images, num_videos=args.videos,
                                      seed=args.seed), args.cache_dir)
    consume = CONSUMERS["sum64"][0]
    out = {"command": " ".join(env.module_argv(__spec__, __name__)), "cases": {}}
    for case, loaders in _datasets(root).items():
        if case not in args.workloads:
            continue
        batch = args.batch if case == "images" else 256
        figs: dict[str, list] = {}

        def rep(loader_name, mode, seconds, index):
            loader_class, dataset = loaders[loader_name]
            sessions = []

            def make():
                torch.manual_seed(args.seed + index)
                sampler = torch.utils.data.RandomSampler(dataset, replacement=True,
                                                         num_samples=1 << 40)
                loader = loader_class(dataset, batch_size=batch, sampler=sampler,
                                      num_workers=args.num_workers)
                if mode == "off":
                    return loader
                sessions.append(Telemetry(trace=mode == "trace"))
                return sessions[-1].watch(loader)
            fig = harness.run_loader(make, args.num_workers, seconds, consume)
            for tm in sessions:
                fig["spans_dropped"] = tm.log.dropped
                tm.close()
            print(f"[{case}] rep {index} {loader_name:7s} {mode:8s} "
                  f"{fig['samples_per_s']:10.1f} samples/s", file=sys.stderr, flush=True)
            return fig

        arms = [(loader, mode) for loader in loaders for mode in MODES]
        for loader, mode in arms:
            rep(loader, mode, args.warmup_seconds, -1)
        for r in range(args.reps):
            for loader, mode in harness.rotated(arms, r):
                figs.setdefault(f"{loader} {mode}", []).append(
                    rep(loader, mode, args.min_seconds, r))
        rates = {n: [f["samples_per_s"] for f in fs] for n, fs in figs.items()}
        # CPU time of the whole process tree per sample: what telemetry adds, less swayed by
        # a noisy machine than the rate is
        cpu = {n: [f["tree_cpu_s"] / f["samples"] * 1e6 for f in fs] for n, fs in figs.items()}

        def on_over_off(figure: dict) -> dict:
            return {f"{loader} {mode}": stats.summarize(stats.paired_ratios(
                        figure[f"{loader} {mode}"], figure[f"{loader} off"]))
                    for loader in loaders for mode in MODES[1:]}

        out["cases"][case] = {
            "batch_size": batch, "num_workers": args.num_workers,
            "arms": {n: stats.summarize(v) for n, v in rates.items()},
            "cpu_us_per_sample": {n: stats.summarize(v) for n, v in cpu.items()},
            "on_over_off": on_over_off(rates), "cpu_on_over_off": on_over_off(cpu),
        }
    return out


def report(result: dict) -> str:
    lines = []
    for case, c in result["cases"].items():
        lines.append(f"{case}: batch {c['batch_size']}, {c['num_workers']} workers "
                     "(samples/s median [min-max]; on / off paired per repetition)")
        lines += _arm_lines(c["arms"], c["on_over_off"], ".1f")
        lines.append("  CPU us per sample, all processes (on / off paired)")
        lines += _arm_lines(c["cpu_us_per_sample"], c["cpu_on_over_off"], ".3f")
    return "\n".join(lines)


def _arm_lines(arms: dict, ratios: dict, fmt: str) -> list[str]:
    lines = []
    for name, s in arms.items():
        ratio = ratios.get(name)
        extra = f"   {ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]" if ratio else ""
        lines.append(f"  {name:16s} {s['median']:10{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]{extra}")
    return lines


@options.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.telemetry_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=options.directory, default="bench-out/telemetry-cost")
    p.add_argument("--workloads", type=options.listed(str, ("images", "tiny")), default="images,tiny")
    p.add_argument("--images", type=options.whole(1), default=1500)
    p.add_argument("--videos", type=options.whole(1), default=24)
    p.add_argument("--batch", type=options.whole(1), default=64)
    p.add_argument("--num-workers", type=options.whole(1), default=2)
    p.add_argument("--reps", type=options.whole(1), default=5)
    p.add_argument("--min-seconds", type=options.number(0), default=4.0)
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
