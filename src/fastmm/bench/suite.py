"""The README's main job: every part of the bundled benchmark, short enough for a laptop, and
one page at the end, ``index.html``: the answer at the top (fastmm against torch on this
machine, each study's finding with its call), then a section per part with its key plots and a
link to its own report. Parts (each its own process, its own environment record and report):

1. ``loader``: torch's DataLoader and fastmm's side by side on the same Dataset (fastmm-bench:
   batches of clips from memory, where transport is the work; throughput, host memory held, first
   batch);
2. ``pipeline``: a decode-bound image pipeline end to end on a training step, torch's loader
   against fastmm's (fastmm-bench on examples/image_folder.py): the headline figures;
3. ``staging``: study 1, NVMe staging against reading in place from throttled storage (files
   over HTTP, and tar shards in a local S3 store);
4. ``gpu-decode``: study 2, decode in the CPU workers or on the GPU next to a model step (its
   GPU arms only where CUDA is);
5. ``decode-rates``, where CUDA is: nvJPEG and NVDEC against CPU cores (the crossover);
6. ``copy-on-read``: a Dataset holding its index in Python lists (and torchvision's
   ImageFolder), read by 4 workers of each loader: the workers' private memory against the
   dataset's size, and the time to the first batch under spawn and forkserver;
7. ``shards``: study 3, a file per sample against 1 MB tar shards, those shards in a local S3
   store read in place and staged per node, in real torchrun (gloo) jobs at world size 2 on one
   node and as two node launches (the study's own default runs world size 2 and 4).

Run: ``python -m fastmm.bench.suite --out DIR`` (``--quick``: a smoke run of a few minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import time

import torch

from . import ab_page, options, plots, report, stats
from .corpus import default_cache_dir
from .page import Page

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXAMPLE = os.path.join(REPO, "examples", "image_folder.py")


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    title: str
    module: str  # run as ``python -m module``; its ``figures(result)`` gives the index's plots
    results: str  # its JSON and its HTML report, relative to --out
    report: str


PARTS = (
    Part("pipeline", "End to end on a training step: an image pipeline", "fastmm.bench",
         "pipeline/results.json", "pipeline/index.html"),
    Part("loader", "Transport: batches of clips from memory", "fastmm.bench",
         "loader/results.json", "loader/report.html"),
    Part("staging", "Study 1: NVMe staging", "fastmm.bench.study_staging",
         "staging/staging.json", "staging/report.html"),
    Part("gpu-decode", "Study 2: GPU decode placement", "fastmm.bench.study_gpu_decode",
         "gpu-decode/gpu_decode.json", "gpu-decode/report.html"),
    Part("decode-rates", "Decode rates: the GPU decode crossover", "fastmm.bench.decode_rates",
         "decode-rates/decode_rates.json", "decode-rates/report.html"),
    Part("copy-on-read", "Workers' memory with a dataset held in Python objects (copy-on-read)",
         "fastmm.bench.copy_on_read", "copy-on-read/copy_on_read.json",
         "copy-on-read/report.html"),
    Part("shards", "Study 3: sharded storage under torchrun", "fastmm.bench.study_shards",
         "shards/shards.json", "shards/report.html"),
)
# the order they run in; decode-rates only where CUDA is (without a GPU it measures no crossover)
NAMES = ("loader", "pipeline", "staging", "gpu-decode", "decode-rates", "copy-on-read",
         "shards")


# 500,000 paths and labels (the index's growth shows at any size; the 2M is the part's
# own default), the memory of 6 rounds, the first batch under forkserver timed in 2 of them
# (each timing a fresh process; both datasets and both start methods in 3 rounds took 15 min)
COPY_ON_READ = ["--items", "500000", "--rounds", "6", "--first-batch-rounds", "2",
                "--datasets", "lists", "--methods", "forkserver"]
COPY_ON_READ_QUICK = ["--items", "20000", "--rounds", "1", "--datasets", "lists",
                      "--methods"]  # (none timed: each timing starts interpreters)


def arguments(name: str, out: str, cache: str, quick: bool) -> list[str]:
    """A part's command-line arguments. Sized so that the whole job takes about 10 minutes on
    a 2-core machine, the headline figures with 6 repetitions (the fewest that give a 95% CI).
    The defaults took 732 s here on 2026-12-06 at f791ed2 (loader 95, pipeline 144, staging
    93 with its object-store arm, gpu-decode 38, copy-on-read 154, shards 207 with the store's
    layouts, two node launches and each layout's samples read back and compared). Each
    part's own default run is fuller (the loader's decode cases, 400 images to stage, three
    shard sizes)."""
    where = ["--out", os.path.join(out, name), "--cache-dir", cache]
    if quick:
        extra = COPY_ON_READ_QUICK if name == "copy-on-read" else ["--quick"]
    else:
        extra = {
            # the decode case is left to the pipeline part, which measures one end to end
            "loader": ["--workloads", "transport", "--clip-modes", "view", "--reps", "6",
                       "--mem-reps", "1", "--min-seconds", "2"],
            "pipeline": [],
            "staging": ["--images", "160"],
            "gpu-decode": [],
            "decode-rates": [],
            # world 2 on one node and as two node launches (a rank each): what the multi-node
            # arm compares, sized for 2 cores (world 4 there took 262 s of the job's 571)
            "shards": ["--images", "160", "--shard-bytes", "1000000", "--worlds", "2"],
            "copy-on-read": COPY_ON_READ,
        }[name]
    if name == "pipeline":  # the lead's runner: a Dataset and a step from the examples
        where = ["--dataset", f"{EXAMPLE}:dataset", "--step", f"{EXAMPLE}:train_step",
                 "--batch-size", "32", "--num-workers", "2", "--out", os.path.join(out, name)]
    if name == "copy-on-read":  # no corpus: its datasets are built in memory
        where = ["--out", os.path.join(out, name)]
    return where + extra


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _headline_plot(result: dict) -> list[tuple]:
    """The pipeline's headline ratios (fastmm over torch) with their intervals."""
    rows = [(h["what"], {"n": h["n"], "median": h["ratio"], "ci_low": h["ci"][0],
                         "ci_high": h["ci"][1], "ci_level": h["ci_level"]})
            for h in result["headline"]]
    if not rows:
        return []
    return [("headline", plots.rates(rows, "fastmm over torch", ref=1.0),
             "The headline figures, fastmm over torch: median and interval over the paired "
             "repetitions; the dotted line is parity (samples/s: higher is better; memory and "
             "time: lower is better).")]


def findings(part: Part, result: dict, out: str) -> tuple[list[str], list[str], list[tuple]]:
    """A part's (answer sentences, alerts, figures) for the index."""
    if part.name == "pipeline":
        return (list(result["answer"]), result["busy"] + result["alerts"],
                _headline_plot(result) + ab_page.figures(result, os.path.join(out, "pipeline")))
    if part.name == "loader":
        found, busy, figures = report.finding(result), report.busy(result), report.figures(result)
    else:
        module = importlib.import_module(part.module)
        found, busy, figures = result["finding"], result["busy"], module.figures(result)
    said = ([f"**{part.title}**: {found['text']} Call: **{found['call']}** ({found['label']})."]
            if found else [])
    return said, busy, figures


def index(out: str, ran: list[tuple[Part, int, float]], total_s: float) -> tuple[str, str]:
    """Writes ``index.html`` (and ``index.md``, a second export); returns their paths."""
    page = Page("fastmm against torch's DataLoader on this machine")
    md = [f"# {page.title}", ""]
    sections = []
    for part, code, seconds in sorted(ran, key=lambda r: PARTS.index(r[0])):
        result = _load(os.path.join(out, part.results))
        alerts = [] if code == 0 else [
            f"{part.name} failed (exit {code}) after {seconds:.0f} s"
            + ("; its figures below come from what it wrote before failing." if result else
               ": no figures from it; its output is in the console above.")]
        said, figures = [], []
        if result is not None:
            try:
                said, busy, figures = findings(part, result, out)
                alerts += busy
            except (KeyError, TypeError, ValueError, ImportError) as e:  # a part's JSON changed
                alerts.append(f"{part.name}: its results could not be read ({type(e).__name__}: "
                              f"{e}).")
        page.answer(said)
        for a in alerts:
            page.alert(a)
        md += [x + "\n" for x in [*said, *[f"**{a}**" for a in alerts]]]
        sections.append((part, code, seconds, figures))
    page.text(f"Intervals: {stats.CI_METHOD}. Calls: roll out only when the whole interval "
              f"clears the {stats.ROLL_OUT_BAR - 1:.0%} roll-out bar and the output was checked "
              "correct.")
    there = {p.name: os.path.exists(os.path.join(out, p.report)) for p, *_ in sections}
    rows = [[p.name, "ok" if c == 0 else f"failed ({c})", f"{s:.0f}",
             f"[{p.report}]({p.report})" if there[p.name] else "-"] for p, c, s, _ in sections]
    page.table(["part", "status", "seconds", "report"], rows)
    page.text(f"Total {total_s:.0f} s. Each part records its own environment and command.")
    md += [f"Intervals: {stats.CI_METHOD}.", "", "| part | status | seconds | report |",
           "|---|---|---|---|", *["| " + " | ".join(r) + " |" for r in rows], "",
           f"Total {total_s:.0f} s."]
    for part, _, _, figures in sections:
        page.heading(part.title)
        for name, fig, caption in figures:
            page.plot(f"{part.name}-{name}", fig, caption)
        if there[part.name]:
            page.link(part.report, f"The full report: {part.report}")
    return (page.write(os.path.join(out, "index.html")),
            _write(os.path.join(out, "index.md"), "\n".join(md) + "\n"))


def _write(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


@options.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.suite", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=options.directory, default="bench-out")
    p.add_argument("--cache-dir", type=options.directory, default=str(default_cache_dir()))
    p.add_argument("--quick", action="store_true", help="smoke run of every part")
    p.add_argument("--only", type=options.listed(str, NAMES), default=",".join(NAMES),
                   help=f"comma-separated subset of {','.join(NAMES)} (default: all)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    by_name = {part.name: part for part in PARTS}
    todo = [by_name[n] for n in NAMES if n in args.only]
    if not torch.cuda.is_available() and by_name["decode-rates"] in todo:
        todo.remove(by_name["decode-rates"])
        print("== decode-rates: left out: no CUDA device here (the crossover needs a GPU)",
              file=sys.stderr, flush=True)
    ran, t0 = [], time.perf_counter()
    for i, part in enumerate(todo, 1):
        cmd = [sys.executable, "-m", part.module,
               *arguments(part.name, args.out, args.cache_dir, args.quick)]
        print(f"== [{i}/{len(todo)}] {part.name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        # an earlier run's figures must not pass for this one's
        for stale in (part.results, part.report):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(args.out, stale))
        start = time.perf_counter()
        code = subprocess.run(cmd).returncode  # its progress goes straight to the terminal
        ran.append((part, code, time.perf_counter() - start))
        print(f"== {part.name}: {'done' if code == 0 else f'FAILED (exit {code})'} in "
              f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    html_path, md_path = index(args.out, ran, time.perf_counter() - t0)
    with open(md_path) as f:
        print(f.read(), end="")
    print(f"report: {os.path.abspath(html_path)}")
    return 0 if all(code == 0 for _, code, _ in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
