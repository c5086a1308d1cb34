"""The README's main job: every part of the bundled benchmark, short enough for a laptop, one
index at the end. Parts (each its own process, its own environment record and report):

1. ``loader``: torch's DataLoader and fastmm's side by side on the same Datasets (fastmm-bench:
   transport-bound clips and a decode-bound JPEG Dataset; throughput, peak PSS, first batch);
2. ``experiment``: the method on a training step (benchmarks/steps/image-224-small.toml):
   environment, baseline profiled with the telemetry, single-factor A/B with CIs and
   correctness, Markdown + HTML report;
3. ``staging``: study 1, NVMe staging against reading in place from throttled storage;
4. ``gpu-decode``: study 2, decode in the CPU workers or on the GPU next to a model step (its
   GPU arms only where CUDA is);
5. ``shards``: study 3, a file per sample against 1 MB tar shards and those shards staged,
   5 interleaved rounds in real torchrun (gloo) jobs at world size 2 and 4 (8 and 64 MB shards
   too when the study runs on its own: ``python -m fastmm.bench.study_shards``).

Run:
``python -m fastmm.bench.suite --out DIR`` (``--quick``: a smoke run of a few minutes).
"""

from __future__ import annotations

import argparse
import html
import os
import subprocess
import sys
import time

from . import options
from .experiment import STEP
from .corpus import default_cache_dir

PARTS = ("loader", "experiment", "staging", "gpu-decode", "shards")


def parts(out: str, cache: str, quick: bool) -> list[tuple[str, list[str], str]]:
    """(name, command, its report file) for every part."""
    py = [sys.executable, "-m"]
    # Sized so that the whole job stays well under 10 minutes on a 2-core machine, slow days
    # included: 545 s on 2026-12-02 from an empty cache, a day this machine ran a Python loop
    # 3-6x slower than on quiet ones, with the loader's transport-clone case (about 60 s; now
    # left to the loader's own run). Each part's own default run is fuller: both transport
    # cases, both decode batch sizes, 400 images to stage, three shard sizes.
    loader = ["--quick"] if quick else ["--reps", "3", "--mem-reps", "2", "--min-seconds", "2",
                                        "--clip-modes", "view", "--num-images", "600",
                                        "--decode-batch-sizes", "32"]
    staging = ["--quick"] if quick else ["--images", "240"]
    gpu_decode = ["--quick"] if quick else []
    shards = ["--quick"] if quick else ["--images", "160", "--shard-bytes", "1000000"]
    return [
        ("loader", py + ["fastmm.bench", "--out", os.path.join(out, "loader"),
                         "--cache-dir", cache, *loader], os.path.join("loader", "summary.md")),
        ("experiment", py + ["fastmm.bench.experiment", "--config", _step_path(quick, out),
                             "--out", os.path.join(out, "experiment"), "--cache-dir", cache],
         os.path.join("experiment", "report.html")),
        ("staging", py + ["fastmm.bench.study_staging", "--out", os.path.join(out, "staging"),
                          "--cache-dir", cache, *staging], os.path.join("staging", "staging.md")),
        ("gpu-decode", py + ["fastmm.bench.study_gpu_decode", "--out",
                             os.path.join(out, "gpu-decode"), "--cache-dir", cache, *gpu_decode],
         os.path.join("gpu-decode", "gpu_decode.md")),
        ("shards", py + ["fastmm.bench.study_shards", "--out", os.path.join(out, "shards"),
                         "--cache-dir", cache, *shards], os.path.join("shards", "shards.md")),
    ]


def _step_path(quick: bool, out: str) -> str:
    """The step config; for --quick, the smaller copy _write_quick_step makes."""
    return os.path.join(out, "quick-step.toml") if quick else STEP


def _write_quick_step(out: str) -> None:
    import tomllib

    with open(STEP) as f:
        text = f.read()
    tomllib.loads(text)  # it must parse before numbers in it are edited
    small = (text.replace("images = 400", "images = 64").replace("batches = 24", "batches = 4")
             .replace("per_device_batch = 32", "per_device_batch = 8"))
    with open(_step_path(True, out), "w") as f:
        f.write(small)


@options.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.suite", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=options.directory, default="bench-out")
    p.add_argument("--cache-dir", type=options.directory, default=str(default_cache_dir()))
    p.add_argument("--quick", action="store_true", help="smoke run of every part")
    p.add_argument("--only", type=options.listed(str, PARTS), default=",".join(PARTS),
                   help=f"comma-separated subset of {','.join(PARTS)} (default: all)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    todo = [x for x in parts(args.out, args.cache_dir, args.quick) if x[0] in args.only]
    if args.quick and "experiment" in args.only:
        _write_quick_step(args.out)
    results, t0 = [], time.perf_counter()
    for i, (name, cmd, report) in enumerate(todo, 1):
        print(f"== [{i}/{len(todo)}] {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        code = subprocess.run(cmd).returncode  # its progress goes straight to the terminal
        results.append((name, code, time.perf_counter() - start, report))
        print(f"== {name}: {'done' if code == 0 else f'FAILED (exit {code})'} in "
              f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    lines = ["# fastmm bundled benchmark", "",
             f"Total {time.perf_counter() - t0:.0f} s. Each part records its own environment "
             "and command.", "", "| part | status | seconds | report |", "|---|---|---|---|"]
    lines += [f"| {n} | {'ok' if c == 0 else f'failed ({c})'} | {s:.0f} | [{r}]({r}) |"
              for n, c, s, r in results]
    with open(os.path.join(args.out, "index.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "index.html"), "w") as f:
        rows = "".join(f"<tr><td>{html.escape(n)}</td><td>{'ok' if c == 0 else 'failed'}</td>"
                       f"<td>{s:.0f}</td><td><a href='{html.escape(r)}'>{html.escape(r)}</a>"
                       f"</td></tr>" for n, c, s, r in results)
        f.write("<!DOCTYPE html><html><head><meta charset='utf-8'><title>fastmm benchmark"
                f"</title></head><body><h1>fastmm bundled benchmark</h1><table>{rows}</table>"
                "</body></html>")
    print("\n".join(lines))
    return 0 if all(c == 0 for _, c, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
