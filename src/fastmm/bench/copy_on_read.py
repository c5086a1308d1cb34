"""Copy-on-read, side by side in one run: a Dataset whose index is plain Python objects, read by
``--num-workers`` workers for one shuffled epoch by torch's DataLoader and by fastmm's.

Two datasets, built once in the main process: ``lists``, ``--items`` paths and labels in two
Python lists (what most custom Datasets hold); ``imagefolder``, torchvision's ImageFolder with
its ``samples`` and ``targets`` set directly (``--items`` of them) and a loader that returns the
path's length instead of opening a file, so the run measures the index, not decoding. Each
worker's private memory (USS, psutil) is sampled every 0.2 s; the finding is the workers'
peak private memory (summed over workers) against the dataset's size (the main process's RSS
growth while it was built). Also the rate, and whether the two loaders gave the same batches.
Then the time to the first batch with ``multiprocessing_context="spawn"`` and
``"forkserver"`` (each worker sent the dataset), each in a fresh process that builds the dataset
first. Loaders alternate in order each round;
ratios are fastmm's over torch's, per round.
Run: ``python -m fastmm.bench.copy_on_read --out DIR`` (``--quick``: 200,000 items, 3 rounds).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import subprocess
import sys
import threading
import time

import psutil
import torch

import fastmm

from . import env, options, stats
from .harness import OtherCores
from ..shared import containers, python_bytes
from .report import busy_notes, save_study

LOADERS = {"torch": torch.utils.data.DataLoader, "fastmm": fastmm.DataLoader}
SHARE_BAR = 0.3  # the workers' peak private memory over the dataset's size, at most
FLOOR_ITEMS = 2_000  # a dataset this small measures what starting the workers costs alone


class PathLabels(torch.utils.data.Dataset):
    """A custom Dataset's usual index: a list of paths and a list of labels."""

    def __init__(self, n: int):
        self.paths = [f"/data/train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG" for i in range(n)]
        self.labels = [i % 1000 for i in range(n)]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i):
        return len(self.paths[i]), self.labels[i]


def path_length(path: str) -> int:
    """ImageFolder's loader here: the index is what is measured, not decoding."""
    return len(path)


def image_folder(n: int):
    """torchvision's ImageFolder holding ``n`` samples, set directly (no tree of files)."""
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder.__new__(ImageFolder)
    dataset.root, dataset.loader, dataset.extensions = "/data/train", path_length, (".jpeg",)
    dataset.transform = dataset.target_transform = None
    dataset.classes = [f"n{c:08d}" for c in range(1000)]
    dataset.class_to_idx = {name: c for c, name in enumerate(dataset.classes)}
    dataset.samples = [(f"/data/train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG", i % 1000)
                       for i in range(n)]
    dataset.targets = [s[1] for s in dataset.samples]
    dataset.imgs = dataset.samples
    return dataset


DATASETS = {"lists": PathLabels, "imagefolder": image_folder}


def _uss(pid: int) -> int | None:
    try:
        return psutil.Process(pid).memory_full_info().uss
    except (psutil.Error, OSError):
        return None


class _PrivateMemory:
    """Each worker's USS every ``interval_s`` while the epoch runs; ``peak``: the largest sum."""

    def __init__(self, pids: list[int], interval_s: float = 0.2):
        self.pids, self.interval_s = pids, interval_s
        self.series: list[tuple[float, list[int | None]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = time.perf_counter()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.series.append((time.perf_counter() - self._start, [_uss(p) for p in self.pids]))
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.series.append((time.perf_counter() - self._start, [_uss(p) for p in self.pids]))

    @property
    def peak(self) -> int:
        return max(sum(u or 0 for u in row) for _, row in self.series)


def epoch(kind: str, dataset, args, draws: int | None = None) -> dict:
    """One shuffled epoch: rate, the workers' private memory over it, the batches' digest;
    with ``draws``, that many samples drawn with replacement (a small dataset read as long as
    a large one)."""
    generator = torch.Generator().manual_seed(args.seed)
    order = None if draws is None else torch.utils.data.RandomSampler(
        dataset, replacement=True, num_samples=draws, generator=generator)
    loader = LOADERS[kind](dataset, batch_size=args.batch_size, shuffle=order is None,
                           sampler=order, num_workers=args.num_workers, generator=generator)
    digest, samples = hashlib.sha256(), 0
    start = time.perf_counter()
    it = iter(loader)
    memory = _PrivateMemory([w.pid for w in it._workers])
    for lengths, labels in it:
        digest.update(lengths.numpy().tobytes())
        digest.update(labels.numpy().tobytes())
        samples += len(labels)
    seconds = time.perf_counter() - start
    memory.stop()
    del it
    gc.collect()
    return {"loader": kind, "samples": samples, "seconds": seconds,
            "samples_per_s": samples / seconds, "peak_private_bytes": memory.peak,
            "series": [[t, row] for t, row in memory.series], "digest": digest.hexdigest()}


def first_batch(kind: str, name: str, method: str, args, items: int | None = None) -> float:
    """Seconds from iter() to the first batch, workers started by ``method``, in a process of
    its own (a forkserver, once started, serves every later loader of its process), with the
    dataset at ``items`` (default: ``args.items``)."""
    command = [sys.executable, "-m", "fastmm.bench.copy_on_read", "--first-batch", kind, name,
               method, "--items", str(items or args.items), "--batch-size", str(args.batch_size),
               "--num-workers", str(args.num_workers), "--seed", str(args.seed)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    said = done.stdout.split()
    if not said:  # (the time is said before the workers are shut down: see below)
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    if done.returncode != 0:
        print(f"[copy-on-read] {kind} {name} {method}: timed, then its shutdown failed:\n"
              + done.stderr[-1500:], file=sys.stderr, flush=True)
    return float(said[0])


def _time_first_batch(kind: str, name: str, method: str, args) -> None:
    dataset = DATASETS[name](args.items)
    loader = LOADERS[kind](dataset, batch_size=args.batch_size, shuffle=True,
                           num_workers=args.num_workers, multiprocessing_context=method,
                           generator=torch.Generator().manual_seed(args.seed))
    start = time.perf_counter()
    it = iter(loader)
    next(it)
    print(time.perf_counter() - start, flush=True)  # said first: (a torch worker spawned
    it._shutdown_workers()  # with torchvision has aborted at this shutdown, once in 12 here)


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def objects_bytes(dataset) -> int:
    """About what the dataset's containers take, each once (ImageFolder's imgs is its
    samples)."""
    found = {id(value): value for _, _, _, value in containers(dataset, min_items=1)}
    return sum(map(python_bytes, found.values()))


def run_dataset(name: str, args) -> dict:
    if name == "imagefolder":
        import torchvision.datasets  # noqa: F401 - its import is not the dataset's size
    before = _rss()
    dataset = DATASETS[name](args.items)
    # its RSS growth; a small dataset fits in memory the process held already: its estimate
    size = max(_rss() - before, objects_bytes(dataset))
    small = DATASETS[name](FLOOR_ITEMS)
    rounds = []
    for r in range(args.rounds):
        order = list(LOADERS) if r % 2 == 0 else list(LOADERS)[::-1]
        with OtherCores() as others:  # (the floor runs too: the growth rests on them)
            runs = {kind: epoch(kind, dataset, args) for kind in order}
            # the same loaders over FLOOR_ITEMS for as many samples: what the workers hold
            # whatever the dataset's size
            floor_runs = {kind: epoch(kind, small, args, len(dataset))["peak_private_bytes"]
                          for kind in order}
        ttfb, floor = {}, {}
        timed = args.first_batch_rounds is None or r < args.first_batch_rounds
        for method in args.methods if timed else ():
            ttfb[method] = {kind: first_batch(kind, name, method, args) for kind in order}
            floor[method] = {kind: first_batch(kind, name, method, args, items=FLOOR_ITEMS)
                             for kind in order}
        rounds.append({"order": order, "runs": runs, "floor_peak_private_bytes": floor_runs,
                       "first_batch_s": ttfb,
                       "first_batch_floor_s": floor, "other_processes_cpu_cores": others.cores})
        print(f"[copy-on-read] {name} round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} {v['peak_private_bytes'] / 2**20:.0f} MiB {v['samples_per_s']:.0f}/s"
            for k, v in runs.items()), file=sys.stderr, flush=True)
    out = {"dataset": name, "items": args.items, "dataset_bytes": size, "rounds": rounds,
           "same_batches": all(r["runs"]["torch"]["digest"] == r["runs"]["fastmm"]["digest"]
                               for r in rounds)}
    for kind in LOADERS:
        out[f"{kind}_private_over_dataset"] = stats.summarize(
            [r["runs"][kind]["peak_private_bytes"] / size for r in rounds])
        # what the dataset's size added: copy-on-read's growth, whatever the workers' start-up
        out[f"{kind}_growth_over_dataset"] = stats.summarize(
            [(r["runs"][kind]["peak_private_bytes"] - r["floor_peak_private_bytes"][kind]) / size
             for r in rounds])
    out["rate_ratio"] = stats.summarize(stats.paired_ratios(
        [r["runs"]["fastmm"]["samples_per_s"] for r in rounds],
        [r["runs"]["torch"]["samples_per_s"] for r in rounds]))
    out["first_batch_ratio"] = {m: stats.summarize(stats.paired_ratios(
        [r["first_batch_s"][m]["fastmm"] for r in rounds if m in r["first_batch_s"]],
        [r["first_batch_s"][m]["torch"] for r in rounds if m in r["first_batch_s"]]))
        for m in args.methods}
    # what the dataset's size adds to the first batch: the time over the same loader's with
    # FLOOR_ITEMS items (starting the workers: interpreters importing torch under spawn)
    out["first_batch_growth_s"] = {m: {k: stats.summarize(
        [r["first_batch_s"][m][k] - r["first_batch_floor_s"][m][k]
         for r in rounds if m in r["first_batch_s"]]) for k in LOADERS} for m in args.methods}
    out["first_batch_floor_s"] = {m: {k: stats.summarize(
        [r["first_batch_floor_s"][m][k] for r in rounds if m in r["first_batch_s"]])
                                      for k in LOADERS} for m in args.methods}
    out["first_batch_s"] = {m: {k: stats.summarize(
        [r["first_batch_s"][m][k] for r in rounds if m in r["first_batch_s"]])
                                for k in LOADERS} for m in args.methods}
    return out


def finding(result: dict) -> dict:
    parts, met, less, same = [], True, True, True
    for case in result["datasets"]:
        ours, theirs = case["fastmm_private_over_dataset"], case["torch_private_over_dataset"]
        met = met and ours["max"] <= SHARE_BAR
        less = less and all(r["runs"]["fastmm"]["peak_private_bytes"]
                            < r["runs"]["torch"]["peak_private_bytes"] for r in case["rounds"])
        same = same and case["same_batches"]
        parts.append(
            f"{case['dataset']} ({case['items']:,} items, {case['dataset_bytes'] / 2**20:,.0f} "
            f"MiB in the main process): the workers' peak private memory was "
            f"{stats.interval(ours, 2, 'x')} the dataset's size with fastmm, "
            f"{stats.interval(theirs, 2, 'x')} with torch (the dataset's size added "
            f"{stats.interval(case['fastmm_growth_over_dataset'], 2, 'x')} with fastmm, "
            f"{stats.interval(case['torch_growth_over_dataset'], 2, 'x')} with torch, over the "
            f"same loaders reading {FLOOR_ITEMS:,} items as many times); rate "
            f"{stats.interval(case['rate_ratio'], 2, 'x')} torch's; "
            + "".join(f"first batch with {m} {stats.interval(r, 2, 'x')} torch's time "
                      f"(the dataset's size added "
                      f"{stats.interval(case['first_batch_growth_s'][m]['fastmm'], 2, ' s')} "
                      f"to fastmm's, "
                      f"{stats.interval(case['first_batch_growth_s'][m]['torch'], 2, ' s')} "
                      f"to torch's); " for m, r in case["first_batch_ratio"].items() if r)
            + ("the same batches" if case["same_batches"] else "DIFFERENT batches"))
    text = "; ".join(parts) + "."
    if not same:
        call, label = "roll back", "the loaders gave different batches"
    elif met:
        call, label = "roll out", f"fastmm's workers held at most {SHARE_BAR}x the dataset in every round"
    elif less:  # a small dataset: the workers' own start-up memory is most of what they hold
        call, label = "undecided", (f"fastmm's workers held less than torch's in every round, "
                                    f"but more than {SHARE_BAR}x the dataset: at this size "
                                    "their own start-up is most of it")
    else:
        call, label = "roll back", "fastmm's workers held as much as torch's or more in a round"
    return {"text": text, "call": call, "label": label}


def figures(result: dict) -> list[tuple]:
    """(name, Figure, caption): the workers' private memory over the epoch of the first round,
    both loaders on one plot per dataset (torch's grows as its workers read the index;
    fastmm's should not), and the peak over the dataset's size of every round."""
    from . import plots  # (matplotlib: not for the workers a spawn start imports this into)

    out = []
    for case in result["datasets"]:
        runs = case["rounds"][0]["runs"]
        # (a sweep after every worker exited reads nothing: not a zero)
        live = {kind: [(t, row) for t, row in runs[kind]["series"]
                       if any(u is not None for u in row)] for kind in LOADERS}
        series = {kind: ([t for t, _ in rows], [sum(u or 0 for u in row) for _, row in rows])
                  for kind, rows in live.items()}
        out.append((f"{case['dataset']}-over-time",
                    plots.over_time(series, "workers' private memory, MiB (summed)", 2**-20),
                    f"{case['dataset']}, {case['items']:,} items "
                    f"({case['dataset_bytes'] / 2**20:,.0f} MiB in the main process), "
                    f"{result['num_workers']} workers: the private memory (USS) of all workers "
                    "together while one shuffled epoch ran, first round."))
    rows = [(f"{case['dataset']}: {kind}{what}", case.get(f"{kind}_{key}_over_dataset"))
            for case in result["datasets"] for kind in LOADERS
            for what, key in (("", "private"), (", added by its size", "growth"))]
    out.append(("peak-over-dataset",
                plots.rates(rows, "workers' peak private memory / the dataset's size",
                            ref=result["share_bar"]),
                f"Peak private memory of the workers over the dataset's size, and what the "
                f"dataset's size added to it (over the same loaders reading {FLOOR_ITEMS:,} "
                f"items as many times): median and interval over the rounds "
                f"({stats.CI_METHOD}); the dotted line is "
                f"the {result['share_bar']}x target."))
    return out


@options.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.copy_on_read", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=options.directory,
                   default=os.path.join("bench-out", "copy-on-read"))
    p.add_argument("--items", type=options.whole(1), default=2_000_000)
    p.add_argument("--datasets", nargs="+", choices=sorted(DATASETS), default=list(DATASETS))
    p.add_argument("--methods", nargs="*", choices=["spawn", "forkserver"],
                   default=["spawn", "forkserver"], help="start methods timed to a first batch")
    p.add_argument("--rounds", type=options.whole(1), default=6)
    p.add_argument("--first-batch-rounds", type=options.whole(0), default=None,
                   help="rounds that also time the first batch (default: all)")
    p.add_argument("--batch-size", type=options.whole(1), default=512)
    p.add_argument("--num-workers", type=options.whole(1), default=4)
    p.add_argument("--seed", type=options.whole(0), default=0)
    p.add_argument("--quick", action="store_true", help="200,000 items, 3 rounds")
    p.add_argument("--first-batch", nargs=3, metavar=("LOADER", "DATASET", "METHOD"),
                   help=argparse.SUPPRESS)  # (one timing, in a process of its own)
    args = options.parse(p, argv, {"items": 200_000, "rounds": 3})
    if args.first_batch:
        _time_first_batch(*args.first_batch, args)
        return 0
    cases = []
    for name in args.datasets:
        cases.append(run_dataset(name, args))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{name}.partial.json"), "w") as f:
            json.dump(cases[-1], f)  # (a later failure loses nothing measured)
    result = {"environment": env.capture(env.module_argv(__spec__, __name__)),
              "batch_size": args.batch_size, "num_workers": args.num_workers,
              "share_bar": SHARE_BAR, "datasets": cases,
              "busy": busy_notes("copy-on-read", [r["other_processes_cpu_cores"]
                                                  for c in cases for r in c["rounds"]])}
    result["finding"] = finding(result)
    rows = []
    for c in cases:
        for kind in LOADERS:
            rows.append([c["dataset"], kind,
                         stats.interval(c[f"{kind}_private_over_dataset"], 2, "x"),
                         ", ".join(f"{r['runs'][kind]['peak_private_bytes'] / 2**20:.0f}"
                                   for r in c["rounds"]),
                         ", ".join(f"{r['runs'][kind]['samples_per_s']:.0f}"
                                   for r in c["rounds"]),
                         "; ".join(f"{m} {stats.interval(c['first_batch_s'][m][kind], 2, ' s')}"
                                   f" ({stats.interval(c['first_batch_floor_s'][m][kind], 2, ' s')}"
                                   f" at {FLOOR_ITEMS:,} items)" for m in args.methods)])
    save_study(args.out, "copy_on_read", result, "Workers' memory and a dataset held in Python "
               "objects (copy-on-read)",
               ["dataset", "loader", "peak private / dataset", "peak private MiB per round",
                "samples/s per round", "time to the first batch"],
               rows, [f"Command: `{result['environment']['command']}`."], figures(result))
    for name in dict.fromkeys(args.datasets):  # (all in the result now; each file once)
        os.remove(os.path.join(args.out, f"{name}.partial.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
