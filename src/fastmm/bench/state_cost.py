"""What taking the loader's state every step costs (issue 54): fastmm's DataLoader against
torchdata's StatefulDataLoader (``snapshot_every_n_steps=1``), side by side in one run.

Each round runs, for each loader, ``--batches`` batches of a shuffled map-style dataset with a
``--step-ms`` step (a sleep: the GPU's time, which the loader's work can hide behind) twice:
without ``state_dict()``, and with ``state_dict()`` after every step. Reported: the loop's time
with the state taken over its time without (paired per round, timed after ``--warmup`` batches),
``state_dict()``'s time per call, and the state's size (pickled bytes, as a checkpoint holds it).
Loaders and runs alternate in order each round.
Run: ``python -m fastmm.bench.state_cost --out DIR`` (``--quick``: 3 rounds of 60 batches).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time

import torch

import fastmm

from . import env, options, stats
from .harness import OtherCores
from .report import busy_notes, save_study

OVERHEAD_BAR = 1.01  # the loop's time with a state every step over its time without, at most


class Items(torch.utils.data.Dataset):
    """A small sample per index, with a draw from the worker's RNG (so its state matters)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i, int(torch.randint(0, 1 << 30, ()))])


def _loaders() -> dict:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return {"torch": lambda *a, **k: StatefulDataLoader(*a, snapshot_every_n_steps=1, **k),
            "fastmm": fastmm.DataLoader}


def run(kind: str, with_state: bool, args) -> dict:
    """One loop: its timed seconds, and per state_dict() call its seconds (and the last
    state's pickled bytes)."""
    loader = _loaders()[kind](Items(args.items), batch_size=args.batch_size, shuffle=True,
                              num_workers=args.num_workers,
                              generator=torch.Generator().manual_seed(args.seed))
    calls, state, start = [], None, None
    it = iter(loader)
    for n in range(args.warmup + args.batches):
        if n == args.warmup:
            start = time.perf_counter()
        next(it)
        time.sleep(args.step_ms / 1000)
        if with_state:
            t = time.perf_counter()
            state = loader.state_dict()
            calls.append(time.perf_counter() - t)
    loop_s = time.perf_counter() - start
    del it
    return {"loop_s": loop_s, "calls_s": calls,
            "state_bytes": len(pickle.dumps(state)) if state is not None else None}


def finding(result: dict) -> dict:
    ours, theirs = result["overhead"]["fastmm"], result["overhead"]["torch"]
    met = ours is not None and ours["ci_high"] <= OVERHEAD_BAR
    text = (f"Taking the state after every step of a {result['step_ms']:g} ms step, "
            f"{result['num_workers']} workers, batch {result['batch_size']}: fastmm's loop took "
            f"{stats.interval(ours, 3, 'x')} its time without, StatefulDataLoader's "
            f"(snapshot_every_n_steps=1) {stats.interval(theirs, 3, 'x')}; state_dict() "
            f"{stats.interval(result['call_s']['fastmm'], 2, ' ms', 1e3)} a call against "
            f"{stats.interval(result['call_s']['torch'], 2, ' ms', 1e3)}; the state "
            f"{result['state_bytes']['fastmm']:,} bytes pickled against "
            f"{result['state_bytes']['torch']:,}.")
    label = (f"fastmm's loop at most {OVERHEAD_BAR}x its time without states, the whole "
             "interval" if met else f"fastmm's overhead not shown under {OVERHEAD_BAR}x")
    return {"text": text, "call": "roll out" if met else "undecided", "label": label}


@options.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.state_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=options.directory,
                   default=os.path.join("bench-out", "state-cost"))
    p.add_argument("--items", type=options.whole(1), default=1_000_000)
    p.add_argument("--batches", type=options.whole(1), default=300)
    p.add_argument("--warmup", type=options.whole(0), default=10)
    p.add_argument("--step-ms", type=options.number(0.0, above=False), default=20.0)
    p.add_argument("--rounds", type=options.whole(1), default=6)
    p.add_argument("--batch-size", type=options.whole(1), default=32)
    p.add_argument("--num-workers", type=options.whole(1), default=8)
    p.add_argument("--seed", type=options.whole(0), default=0)
    p.add_argument("--quick", action="store_true", help="3 rounds of 60 batches")
    args = options.parse(p, argv, {"rounds": 3, "batches": 60})
    rounds = []
    for r in range(args.rounds):
        order = ["torch", "fastmm"] if r % 2 == 0 else ["fastmm", "torch"]
        with OtherCores() as others:
            runs = {kind: {with_state: run(kind, with_state, args)
                           for with_state in ((False, True) if r % 2 == 0 else (True, False))}
                    for kind in order}
        rounds.append({"order": order, "other_processes_cpu_cores": others.cores,
                       "runs": {k: {"without": v[False], "with": v[True]}
                                for k, v in runs.items()}})
        print(f"[state-cost] round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} {v[True]['loop_s'] / v[False]['loop_s']:.3f}x" for k, v in runs.items()),
            file=sys.stderr, flush=True)
    kinds = ("torch", "fastmm")
    result = {
        "environment": env.capture(env.module_argv(__spec__, __name__)),
        "num_workers": args.num_workers, "batch_size": args.batch_size, "step_ms": args.step_ms,
        "batches": args.batches, "overhead_bar": OVERHEAD_BAR, "rounds": rounds,
        "overhead": {k: stats.summarize(stats.paired_ratios(
            [r["runs"][k]["with"]["loop_s"] for r in rounds],
            [r["runs"][k]["without"]["loop_s"] for r in rounds])) for k in kinds},
        # (each round's median call: the rounds are the repetitions)
        "call_s": {k: stats.summarize([sorted(r["runs"][k]["with"]["calls_s"])[
            len(r["runs"][k]["with"]["calls_s"]) // 2] for r in rounds]) for k in kinds},
        "state_bytes": {k: rounds[-1]["runs"][k]["with"]["state_bytes"] for k in kinds},
        "busy": busy_notes("state-cost", [r["other_processes_cpu_cores"] for r in rounds]),
    }
    result["finding"] = finding(result)
    rows = [[k, stats.interval(result["overhead"][k], 3, "x"),
             stats.interval(result["call_s"][k], 2, " ms", 1e3), f"{result['state_bytes'][k]:,}",
             ", ".join(f"{r['runs'][k]['without']['loop_s']:.2f}/{r['runs'][k]['with']['loop_s']:.2f}"
                       for r in rounds)] for k in kinds]
    save_study(args.out, "state_cost", result, "What a state every step costs",
               ["loader", "loop with states / without", "state_dict() per call",
                "state bytes (pickled)", "loop s without/with, per round"],
               rows, [f"Command: `{result['environment']['command']}`. torch: torchdata's "
                      "StatefulDataLoader with snapshot_every_n_steps=1."], [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
