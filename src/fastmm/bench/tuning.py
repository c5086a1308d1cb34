"""``num_workers="auto"`` against the best fixed setting of a sweep, side by side in one run
(issue 55).

First the sweep: for each workload, ``--sweep-rounds`` rounds of every fixed ``(num_workers,
prefetch_factor)`` for ``--seconds`` each (after one batch per worker and a settling second),
in a new order each round; the best fixed setting is the one with the highest median rate.
Then ``--rounds`` judged rounds, each the best fixed setting, ``num_workers="auto"`` for
``--auto-seconds`` from its constructor (every batch's time kept), and the best fixed setting
again: auto meets the best at the pace the machine has that minute. The finding: auto's rate
over the last ``--seconds`` of its run against the mean of the two runs around it, paired per
round, and when auto's rate over a ``--seconds`` window first reached 95% of it.

Workloads: ``decode`` (PIL + v2 crop and flip over the generated JPEG corpus, batch 32, the
loop reading every byte), ``transport`` (a fresh clone of a 16x3x224x224 uint8 clip per sample,
batch 32), and a pipeline of your own with ``--dataset MODULE:CALLABLE`` (and ``--step``).
``--cpu-budget F --step-ms M`` puts a CPU-bound step after each batch (a pure-Python loop,
holding the GIL, of as many turns as take M ms alone, counted once): the step is timed alone
just before auto runs within the budget, and the fixed settings whose workers used at most
the budget in every second are the ones auto is judged against; the workers' CPU is read once
a second; the step is also timed beside one busy process and no loader (``beside_a_busy_core``:
what the machine's cores do to each other).
Run: ``python -m fastmm.bench.tuning --out DIR`` (``--quick``: 1 round, 1 s windows).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import sys
import time
from typing import Callable

import torch

import fastmm

from ..autotune import read_processes
from . import env, options, stats
from .harness import OtherCores, rotated, wait_for_children
from .report import busy_notes, save_study
from .workloads import digest, sum64

SWEEP_ROUNDS = 3  # rounds of the sweep that choose the best fixed setting, by default
REACH = 0.95  # auto's rate within the time it is given, at least this much of the best fixed
STEP_GROWTH_BAR = 1.10  # with a budget: the step's own time at most this much of it alone
BUDGET_READING = 1.05  # the workers' CPU read in a second counts within the budget up to this
# much of it: one worker busy throughout reads a little over one core (the read's own delay)


def busy_step(ms: float):
    """A training step's CPU work: a pure-Python loop (it holds the GIL, as a Python-heavy step
    does) of as many turns as take about ``ms`` milliseconds on this machine alone, so that
    cores taken by the loader show as a longer step."""
    probe = 200_000
    began = time.perf_counter()
    _turns(probe)
    turns = max(1, int(probe * ms / 1e3 / (time.perf_counter() - began)))

    def step(batch) -> None:
        _turns(turns)
    return step


def _turns(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


@dataclasses.dataclass
class Pipeline:
    """What a loader run needs of a workload: its dataset and how the loop uses each batch
    (the step, else the loop reads every byte)."""

    dataset: object
    batch_size: int
    step: Callable | None = None
    collate_fn: Callable | None = None
    pin_memory: bool = False
    seed: int = 0  # torch.manual_seed and the loader's generator before every run


def _workload(name: str, args) -> Pipeline:
    """A named workload, or the pipeline of ``--dataset``."""
    if name == "decode":
        from .corpus import default_cache_dir, ensure_corpus
        from .workloads import JpegFolderDataset

        corpus = ensure_corpus(default_cache_dir(), args.images)
        return Pipeline(JpegFolderDataset(corpus.files), 32)
    if name == "transport":
        from .workloads import ClipBankDataset

        return Pipeline(ClipBankDataset((16, 3, 224, 224)), 32)
    from .ab import load_target, make_dataset

    dataset = make_dataset(load_target(args.dataset, "--dataset"), args.dataset)
    step = load_target(args.step, "--step") if args.step else None
    return Pipeline(dataset, args.batch_size, step)


class Workers:
    """The CPU the loader's workers used, read at most once a second: the most any second
    used (the first second, while workers start, included), in cores."""

    def __init__(self):
        self.peak = 0.0
        self._last = None  # (when, their CPU seconds then)
        # the epoch's workers' pids, not its iterator: held here, that would keep them alive
        self._pids: list[int] = []
        self._read = read_processes(lambda: self._pids)

    def read(self, it) -> None:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < 1.0:
            return
        self._pids = [w.pid for w in getattr(it, "_workers", None) or [] if w is not None]
        total = self._read().workers_cpu_s
        if self._last is not None:
            self.peak = max(self.peak, (total - self._last[1]) / (now - self._last[0]))
        self._last = (now, total)


def _batches(loader):
    """(the epoch's iterator, a batch), epoch after epoch."""
    while True:
        it = iter(loader)
        for batch in it:
            yield it, batch


def run(pipe: Pipeline, num_workers, prefetch_factor, seconds: float, *,
        auto_seconds: float | None = None, cpu_budget: float | None = None) -> dict:
    """One loader run: batches/s over ``seconds`` after one batch per worker and a settling
    second (fixed), or every batch's time over ``auto_seconds`` from the constructor (auto);
    the step's median time; the workers' peak CPU over a second; the first batch's digest."""
    torch.manual_seed(pipe.seed)
    made = time.perf_counter()
    loader = fastmm.DataLoader(pipe.dataset, batch_size=pipe.batch_size,
                               collate_fn=pipe.collate_fn, pin_memory=pipe.pin_memory,
                               num_workers=num_workers, prefetch_factor=prefetch_factor,
                               cpu_budget=cpu_budget, persistent_workers=True,
                               generator=torch.Generator().manual_seed(pipe.seed))
    workers, times, steps, first = Workers(), [], [], None
    counted_from, count, warm = None, 0, loader.num_workers + 1
    for it, batch in _batches(loader):
        if first is None:
            first = digest(batch)
        if pipe.step is None:
            sum64(batch)
        else:
            t = time.perf_counter()
            pipe.step(batch)
            steps.append(time.perf_counter() - t)
        now = time.perf_counter()
        workers.read(it)
        times.append(now - made)
        if auto_seconds:
            if now - made >= auto_seconds:
                break
        elif len(times) == warm:
            counted_from = now + 1.0  # a settling second, then the window
        elif counted_from is not None and now >= counted_from:
            count += 1
            if now - counted_from >= seconds:
                break
    tuning = getattr(it, "_tuning", None)
    rate = count / (time.perf_counter() - counted_from) if count else None
    del it, batch, loader
    wait_for_children()
    out = {"workers_cpu_peak": workers.peak, "first_batch": list(first),
           "step_s": sorted(steps)[len(steps) // 2] if steps else None}
    if not auto_seconds:
        return out | {"rate": rate}
    tuner = None if tuning is None else tuning.tuner
    return out | {"times": times,
                  "settled": None if tuner is None else {"num_workers": tuner.workers,
                                                         "prefetch_factor": tuner.prefetch},
                  "changes": [] if tuner is None else [c._asdict() for c in tuner.changes]}


def window_rates(times: list[float], seconds: float) -> list[tuple[float, float]]:
    """(t, batches/s over the ``seconds`` up to t) at each batch from ``seconds`` in."""
    out, first = [], 0
    for i, t in enumerate(times):
        while times[first] <= t - seconds:
            first += 1
        if t >= seconds + times[0]:
            out.append((t, (i - first + 1) / seconds))
    return out


def judge_auto(auto: dict, best_rate: float, seconds: float) -> dict:
    """Auto's rate over its last ``seconds``, and when a window first reached REACH of the
    best fixed rate (None: never)."""
    rates = window_rates(auto["times"], seconds)
    reached = next((t for t, r in rates if r >= REACH * best_rate), None)
    end = auto["times"][-1] if auto["times"] else 0.0
    last = sum(1 for t in auto["times"] if t > end - seconds) / seconds if rates else None
    return {"rate": last, "reached_s": reached, "ratio": None if last is None else last / best_rate}


def worker_counts(cores: int, *also: int) -> list[int]:
    """The worker counts a sweep tries: powers of two up to twice the cores, the cores, and
    ``also`` (a user's own count)."""
    counts = {cores, *(n for n in also if n > 0)}
    n = 1
    while n <= 2 * cores:
        counts.add(n)
        n *= 2
    return sorted(counts)


def step_alone(step, batch_size: int, seconds: float = 1.0) -> float:
    """The step's median time with no loader running."""
    batch, times, began = torch.zeros(batch_size), [], time.perf_counter()
    while time.perf_counter() - began < seconds or len(times) < 5:
        t = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def beside_a_busy_core(step, batch_size: int, seconds: float = 2.0) -> float:
    """How much slower the step runs while one other process keeps a core busy (no loader
    at all): its median time beside a spinning child over its median time alone, the two
    interleaved. A budget leaves the step its cores; where the machine's cores slow each other
    (vCPUs sharing a physical core, a shared power budget), this is the least growth any
    loader using one core could give it."""
    import subprocess

    alone, beside = [], []
    for _ in range(3):
        alone.append(step_alone(step, batch_size, seconds / 6))
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.2)
            beside.append(step_alone(step, batch_size, seconds / 6))
        finally:
            spinner.kill()
            spinner.wait()
    return sorted(beside)[1] / sorted(alone)[1]


def sweep_round(pipe: Pipeline, settings: list[tuple[int, int]], r: int, seconds: float,
                say=None) -> dict:
    """One round of the sweep: every fixed ``(num_workers, prefetch_factor)``, in the round's
    order."""
    fixed = {}
    with OtherCores() as others:
        for nw, pf in rotated(settings, r):
            fixed[f"{nw},{pf}"] = one = run(pipe, nw, pf, seconds)
            if say:
                say(f"sweep round {r + 1}: num_workers={nw} prefetch_factor={pf}: "
                    f"{one['rate'] or 0:.1f} batches/s")
    return {"fixed": fixed, "other_processes_cpu_cores": others.cores}


def judged_round(pipe: Pipeline, best: str, r: int, seconds: float, auto_seconds: float,
                 cpu_budget: float | None = None, say=None) -> dict:
    """One judged round: the best fixed setting just before auto and again just after it, so
    that auto meets it at the machine's pace of that minute (a VM's drifts from minute to
    minute by more than the 5% judged). With a budget, the step is also timed beside a busy
    core as the round begins, and alone just before auto runs."""
    nw, pf = (int(x) for x in best.split(","))
    machine = beside_a_busy_core(pipe.step, pipe.batch_size) if cpu_budget is not None else None
    with OtherCores() as others:
        before = run(pipe, nw, pf, seconds)
        alone = step_alone(pipe.step, pipe.batch_size) if cpu_budget is not None else None
        auto = run(pipe, "auto", None, seconds, auto_seconds=auto_seconds, cpu_budget=cpu_budget)
        after = run(pipe, nw, pf, seconds)
    if say:
        last = judge_auto(auto, 1.0, seconds)["rate"] or 0.0
        say(f"round {r + 1}: {setting_name(best)} {before['rate'] or 0:.1f}, then auto "
            f"{last:.1f} over its last window at {settled_name(auto['settled'])}, then "
            f"{after['rate'] or 0:.1f} batches/s")
    return {"before": before, "auto": auto, "after": after, "step_alone_s": alone,
            "step_beside_a_busy_core": machine, "other_processes_cpu_cores": others.cores}


def within_budget(peak: float | None, budget_cores: float | None) -> bool:
    """Whether the workers' CPU at its highest in a second (``peak``) kept to ``budget_cores``
    (where there is one), as read: up to BUDGET_READING of it."""
    return budget_cores is None or (peak is not None and peak <= budget_cores * BUDGET_READING)


def best_setting(sweep: list[dict], budget_cores: float | None) -> str | None:
    """The fixed setting with the highest median rate over the sweep's rounds, among those
    whose workers used at most ``budget_cores`` in any second, in every round."""
    rates = {}
    for key in sweep[0]["fixed"]:
        runs = [r["fixed"][key] for r in sweep]
        if not all(within_budget(run["workers_cpu_peak"], budget_cores) for run in runs):
            continue
        median = stats.summarize(run["rate"] for run in runs)
        if median is not None:
            rates[key] = median["median"]
    return max(rates, key=rates.get) if rates else None


def best_rate(r: dict) -> float | None:
    """A judged round's rate of the best fixed setting: the mean of its run before auto and
    its run after."""
    rates = [r["before"]["rate"], r["after"]["rate"]]
    return None if None in rates else sum(rates) / 2


def study(pipe: Pipeline, settings: list[tuple[int, int]], sweep_rounds: int, rounds: int,
          seconds: float, auto_seconds: float, cpu_budget: float | None = None,
          say=None) -> dict:
    """The sweep's rounds, its best fixed setting (within the budget), then the judged rounds
    of auto against it, and their summary."""
    budget_cores = None if cpu_budget is None else cpu_budget * env.usable_cores()
    sweep = [sweep_round(pipe, settings, r, seconds, say) for r in range(sweep_rounds)]
    best = best_setting(sweep, budget_cores)
    if say:
        say(f"best of the sweep: {setting_name(best)}")
    judged = [judged_round(pipe, best, r, seconds, auto_seconds, cpu_budget, say)
              for r in range(rounds)] if best else []
    return {"sweep": sweep, "rounds": judged,
            "summary": summary_of(sweep, best, judged, seconds, budget_cores)}


def setting_name(key: str | None) -> str:
    """A fixed setting's key in the sweep ("2,4") as the loader's arguments."""
    if key is None:
        return "none"
    workers, prefetch = key.split(",")
    return f"num_workers={workers}, prefetch_factor={prefetch}"


def settled_name(settled: dict | None) -> str:
    """Where one auto run settled: "2 workers, prefetch 4"."""
    if settled is None:
        return "-"
    n = settled["num_workers"]
    return f"{n} worker{'s' * (n != 1)}, prefetch {settled['prefetch_factor']}"


def settled_text(settled: list[dict | None]) -> str:
    """Where auto settled, round by round, counted: "2 workers, prefetch 4 (5 rounds); ..."."""
    counts: dict[str, int] = {}
    for s in settled:
        counts[settled_name(s)] = counts.get(settled_name(s), 0) + 1
    return "; ".join(f"{k} ({n} round{'s' * (n != 1)})"
                     for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def summary_of(sweep: list[dict], best: str | None, rounds: list[dict], seconds: float,
               budget_cores: float | None = None) -> dict:
    """Auto against the best fixed setting, paired per judged round; and whether auto's first
    batch was the same in every round (its seeds are per batch: whatever the tuner did)."""
    bests = [best_rate(r) for r in rounds]
    judged = [judge_auto(r["auto"], rate, seconds) if rate else {}
              for r, rate in zip(rounds, bests)]
    for r, j in zip(rounds, judged):
        r["judged"] = j
    reached = [j.get("reached_s") for j in judged]
    growth = stats.summarize(r["auto"]["step_s"] / r["step_alone_s"] for r in rounds
                             if r["step_alone_s"] and r["auto"]["step_s"])
    machine = stats.summarize(r.get("step_beside_a_busy_core") for r in rounds)
    return {"best": best,
            "best_rate": stats.summarize(bests),
            "fixed_rates": {k: stats.summarize(r["fixed"][k]["rate"] for r in sweep)
                            for k in sweep[0]["fixed"]},
            "auto_rate": stats.summarize(j.get("rate") for j in judged),
            "ratio": stats.summarize(j.get("ratio") for j in judged),
            "reached_s": stats.summarize(reached),
            "never_reached": sum(1 for x in reached if x is None),
            "settled": [r["auto"]["settled"] for r in rounds],
            "settled_text": settled_text([r["auto"]["settled"] for r in rounds]),
            "same_first_batch": len({tuple(r["auto"]["first_batch"]) for r in rounds}) == 1,
            "step_growth": growth,
            "step_beside_a_busy_core": machine,
            "workers_cpu_peak": stats.summarize(r["auto"]["workers_cpu_peak"] for r in rounds),
            "budget_cores": budget_cores}


def call(summary: dict) -> tuple[str, str]:
    """(call, label) on auto against the best fixed setting: "roll out" (use auto) when the
    whole interval of the ratio lies at or above REACH; "roll back" (pin the best fixed
    setting) when the whole interval lies below REACH. Rounds in which no window reached
    REACH are said beside the call, not made to decide it: their ratios are in the interval,
    and on a noisy machine some of a dozen fall short by chance even where auto matches."""
    ratio, shown = summary["ratio"], stats.interval(summary["ratio"], 3, "x")
    bar = f"{REACH:.2f}x"
    if summary["best"] is None:
        return "undecided", "no fixed setting of the sweep stayed within the budget"
    if not ratio:
        return "undecided", "auto made no window to judge"
    if not stats.is_ci95(ratio):
        return "undecided", (f"{shown}: {ratio['n']} rounds; 6 or more make a 95% CI to decide "
                             "on")
    if ratio["ci_low"] >= REACH:
        never = summary["never_reached"]
        return "roll out", (f"{shown}: at least {bar} the best fixed setting, the whole "
                            "interval" + (f" ({never} of {ratio['n']} rounds never reached "
                                          f"{REACH:.0%} of it)" if never else ""))
    if ratio["ci_high"] < REACH:
        return "roll back", f"{shown}: below {bar} the best fixed setting, the whole interval"
    return "undecided", f"{shown}: not shown at or above {bar} the best fixed setting"


def figure(rounds: list[dict], summary: dict, seconds: float) -> tuple | None:
    """(name, Figure, caption): auto's rate over time in each round against the best fixed
    setting's median rate and 95% of it."""
    from . import plots

    if not summary["best_rate"]:
        return None
    series = {f"auto, round {i + 1}": tuple(zip(*window_rates(r["auto"]["times"], seconds)))
              for i, r in enumerate(rounds)}
    best = summary["best_rate"]["median"]
    return ("auto", plots.reaching({k: v for k, v in series.items() if v}, best, REACH,
                                   f"batches/s over the last {seconds:g} s"),
            f"num_workers='auto' from its constructor, each round (batches/s over a sliding "
            f"{seconds:g} s window), against the best fixed setting "
            f"({setting_name(summary['best'])}) at its median rate and {REACH:.0%} of it.")


def finding(summaries: list[dict], auto_seconds: float) -> dict:
    """The sentences, and one call for every workload: each workload's own (``call``), kept
    from "roll out" by a budget exceeded or a step slowed past STEP_GROWTH_BAR."""
    lines, calls, labels = [], [], []
    for s in summaries:
        verdict, label = call(s)
        text = (f"{s['workload']}: auto's rate {stats.interval(s['ratio'], 3, 'x')} that of "
                f"the best fixed setting ({setting_name(s['best'])}, the highest median rate of "
                f"the sweep), 95% of it "
                f"reached at {stats.interval(s['reached_s'], 1, ' s')} "
                f"({s['never_reached']} round(s) never) within {auto_seconds:g} s; settled "
                f"at {s['settled_text']}")
        if s["budget_cores"] is not None:
            peak = s["workers_cpu_peak"]["max"] if s["workers_cpu_peak"] else None
            within = within_budget(peak, s["budget_cores"])
            step_kept = (s["step_growth"] is not None
                         and s["step_growth"]["ci_high"] <= STEP_GROWTH_BAR)
            text += (f"; the workers' CPU at most {peak or 0:.2f} cores in a second (budget "
                     f"{s['budget_cores']:.2f}); the step's time "
                     f"{stats.interval(s['step_growth'], 3, 'x')} its time alone, and "
                     f"{stats.interval(s['step_beside_a_busy_core'], 3, 'x')} beside one busy "
                     "process and no loader (what this machine's cores do to each other)")
            if verdict == "roll out" and not (within and step_kept):
                verdict = "undecided"
                label += ("; but the budget was exceeded" if not within else
                          f"; but the step's time not shown within {STEP_GROWTH_BAR:.2f}x")
        calls.append(verdict)
        labels.append(f"{s['workload']}: {label}")
        lines.append(text + ".")
    overall = calls[0] if len(set(calls)) == 1 else "undecided"
    return {"text": " ".join(lines), "call": overall, "label": "; ".join(labels)}


def _say(workload: str, text: str) -> None:
    print(f"[tuning] {workload} {text}", file=sys.stderr, flush=True)


@options.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.tuning", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=options.directory, default=os.path.join("bench-out", "tuning"))
    p.add_argument("--workloads", type=options.listed(str, ("decode", "transport", "dataset")),
                   default=["decode", "transport"])
    p.add_argument("--dataset", help="MODULE:CALLABLE returning your Dataset (workload "
                   "'dataset')")
    p.add_argument("--step", help="MODULE:CALLABLE, your training step, called with each batch")
    p.add_argument("--batch-size", type=options.whole(1), default=32)
    p.add_argument("--num-workers", type=options.listed(int), default=None,
                   help="the fixed worker counts to sweep (default: powers of two up to twice "
                        "the cores, and the cores)")
    p.add_argument("--prefetch-factors", type=options.listed(int), default=[2, 4])
    p.add_argument("--seconds", type=options.number(0.0), default=5.0)
    p.add_argument("--auto-seconds", type=options.number(0.0), default=30.0)
    p.add_argument("--sweep-rounds", type=options.whole(1), default=SWEEP_ROUNDS,
                   help="rounds of the sweep that choose the best fixed setting")
    p.add_argument("--rounds", type=options.whole(1), default=6,
                   help="judged rounds: the best fixed setting, auto, the best again")
    p.add_argument("--images", type=options.whole(1), default=500)
    p.add_argument("--cpu-budget", type=options.number(0.0, below=1.0 + 1e-9), default=None,
                   help="a CPU-bound step of --step-ms beside the loader, auto within this "
                   "fraction of the cores")
    p.add_argument("--step-ms", type=options.number(0.0), default=20.0)
    p.add_argument("--quick", action="store_true", help="1 round, 1 s windows, auto 6 s")
    args = options.parse(p, argv, {"rounds": 1, "sweep_rounds": 1, "seconds": 1.0,
                                   "auto_seconds": 6.0, "images": 64})
    if "dataset" in args.workloads and not args.dataset:
        p.error("the 'dataset' workload needs --dataset MODULE:CALLABLE")
    cores = env.usable_cores()
    settings = list(itertools.product(args.num_workers or worker_counts(cores),
                                      args.prefetch_factors))
    busy = busy_step(args.step_ms) if args.cpu_budget is not None else None
    per, summaries, figures = {}, [], []
    for name in args.workloads:
        pipe = _workload(name, args)
        if busy is not None:
            pipe.step = busy
        per[name] = done = study(pipe, settings, args.sweep_rounds, args.rounds, args.seconds,
                                 args.auto_seconds, args.cpu_budget,
                                 functools.partial(_say, name))
        summaries.append({"workload": name} | done.pop("summary"))
        plot = figure(done["rounds"], summaries[-1], args.seconds)
        if plot:
            figures.append((f"{name}-{plot[0]}", *plot[1:]))
    result = {"environment": env.capture(env.module_argv(__spec__, __name__)),
              "sweep": settings, "seconds": args.seconds, "auto_seconds": args.auto_seconds,
              "cpu_budget": args.cpu_budget, "step_ms": args.step_ms if args.cpu_budget else None,
              "rounds": per, "summaries": summaries,
              "busy": busy_notes("tuning", [r["other_processes_cpu_cores"]
                                            for done in per.values()
                                            for r in done["sweep"] + done["rounds"]])}
    result["finding"] = finding(summaries, args.auto_seconds)
    rows = [[s["workload"], stats.interval(s["ratio"], 3, "x"),
             stats.interval(s["reached_s"], 1, " s"), str(s["never_reached"]),
             f"{s['best']}: {stats.interval(s['best_rate'], 1)}",
             stats.interval(s["auto_rate"], 1), s["settled_text"]] for s in summaries]
    save_study(args.out, "tuning", result, "num_workers='auto' against a sweep of fixed settings",
               ["workload", "auto / best fixed", "95% of best reached at", "rounds never",
                "best fixed (num_workers,prefetch_factor): batches/s", "auto: batches/s",
                "auto settled at"],
               rows, [f"Command: `{result['environment']['command']}`. Sweep: "
                      f"{', '.join(f'{w},{p}' for w, p in settings)}, {args.sweep_rounds} "
                      f"rounds; windows of {args.seconds:g} s; then {args.rounds} rounds of "
                      f"the best, auto for {args.auto_seconds:g} s from its constructor, and "
                      "the best again."], figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
