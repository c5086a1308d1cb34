"""What resuming a stream mid-epoch costs: the time from ``load_state_dict()`` to the first
batch of a ``ShardStream`` over tar shards, resumed at several points of its epoch, two ways:
the stream going on from each worker's own place (its iterators keep one in their state), and
the same stream behind a plain IterableDataset that keeps none, which the loader can only pull
and drop up to where it was (reading and decoding again every sample handed out). Repetitions
interleaved; medians with min-max. Run: ``python -m fastmm.bench.resume_cost --out DIR``
(``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from . import env, options, stats
from .corpus import default_cache_dir
from .mmcorpus import CorpusSpec
from .pipelines import SIZE, ensure_mmcorpus, media
from .report import save

WAYS = ("own place", "pulled and dropped")


class Unresumable(torch.utils.data.IterableDataset):
    """The stream with its state hidden, as a stream that keeps none would be."""

    def __init__(self, stream):
        self.stream = stream

    def __iter__(self):
        yield from self.stream


def _loader(root: str, way: str, args):
    import fastmm

    dataset = fastmm.MultimodalDataset(os.path.join(root, "shards"), source="shards",
                                       decoder="pil", size=SIZE, modality="image",
                                       transform=media)
    stream = fastmm.ShardStream(dataset, rank=0, world_size=1)
    return fastmm.DataLoader(stream if way == WAYS[0] else Unresumable(stream),
                             batch_size=args.batch, num_workers=args.num_workers)


def _state_after(root: str, way: str, batches: int, args) -> dict:
    loader = _loader(root, way, args)
    it = iter(loader)
    for _ in range(batches):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    return state


def _first_batch_s(root: str, way: str, state: dict, args) -> float:
    loader = _loader(root, way, args)
    start = time.perf_counter()
    loader.load_state_dict(state)
    next(iter(loader))
    return time.perf_counter() - start


def run(args) -> dict:
    spec = CorpusSpec(num_images=args.images, num_videos=0, seed=args.seed,
                      shard_bytes=args.shard_bytes)
    root = ensure_mmcorpus(spec, args.cache_dir)
    per_epoch = sum(1 for _ in _loader(root, WAYS[0], args))
    stops = sorted({max(1, int(per_epoch * f)) for f in args.fractions})
    states = {(way, stop): _state_after(root, way, stop, args) for way in WAYS for stop in stops}
    times = {f"{way} @ {stop}": [] for stop in stops for way in WAYS}
    for rep in range(args.reps):
        for stop in stops:
            for way in WAYS:
                t = _first_batch_s(root, way, states[way, stop], args)
                times[f"{way} @ {stop}"].append(t)
                print(f"rep {rep + 1}/{args.reps}: {way} after {stop} batches: {t:.2f} s",
                      file=sys.stderr, flush=True)
    return {
        "command": " ".join(env.module_argv(__spec__, __name__)), "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "torch": torch.__version__, "images": args.images,
        "shards": json.load(open(os.path.join(root, "composition.json")))["counts"]["shards"],
        "batch_size": args.batch, "num_workers": args.num_workers,
        "batches_per_epoch": per_epoch, "stops": stops,
        "first_batch_s": {k: stats.summarize(v) | {"reps": v} for k, v in times.items()},
        "pulled_over_own": {str(stop): stats.summarize(stats.paired_ratios(
            times[f"{WAYS[1]} @ {stop}"], times[f"{WAYS[0]} @ {stop}"])) for stop in stops},
    }


def report(result: dict) -> str:
    lines = [f"ShardStream, {result['images']} images in {result['shards']} shards, batch "
             f"{result['batch_size']}, {result['num_workers']} workers, "
             f"{result['batches_per_epoch']} batches per epoch",
             "load_state_dict() to first batch, s: median [min-max]"]
    for stop in result["stops"]:
        cells = [result["first_batch_s"][f"{way} @ {stop}"] for way in WAYS]
        ratio = result["pulled_over_own"][str(stop)]
        lines.append(f"  after {stop:4d} batches: " + "   ".join(
            f"{way} {c['median']:.2f} [{c['min']:.2f}-{c['max']:.2f}]"
            for way, c in zip(WAYS, cells)) + f"   ratio {ratio['median']:.1f}x")
    return "\n".join(lines)


@options.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.resume_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=options.directory, default="bench-out/resume-cost")
    p.add_argument("--images", type=options.whole(1), default=1500)
    p.add_argument("--shard-bytes", type=options.whole(1), default=4_000_000)
    p.add_argument("--batch", type=options.whole(1), default=32)
    p.add_argument("--num-workers", type=options.whole(1), default=2)
    p.add_argument("--fractions", type=options.listed(options.number(0, below=1)),
                   default="0.25,0.5,0.75",
                   help="where in the epoch to resume, as fractions of it")
    p.add_argument("--reps", type=options.whole(1), default=3)
    p.add_argument("--seed", type=options.whole(0), default=0)
    p.add_argument("--cache-dir", type=options.directory, default=str(default_cache_dir()))
    p.add_argument("--quick", action="store_true", help="smoke run: small corpus, one rep")
    args = options.parse(p, argv, {"images": 64, "shard_bytes": 400_000, "batch": 8, "reps": 1,
                                   "fractions": [0.5]})
    result = run(args)
    save(args.out, "resume_cost", result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
