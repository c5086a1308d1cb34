"""The page and the answer of ``fastmm-bench --dataset``: the figures it leads with, a few
sentences with numbers, what a reader must know before trusting them, and the HTML report with
its plots (ab.py measures; this says what was measured)."""

from __future__ import annotations

import contextlib
import json
import os

from . import stats

ROLLBACK = ("roll back a change that was rolled out when, in production telemetry, end-to-end "
            "samples/s falls below 0.97x the A/B median, a batch differs from what the "
            "baseline would give, or loader_host_bytes exceeds 1.25x the baseline's")
SOURCES = [  # (what it supports, where, when it was read)
    ("DataLoader semantics: workers, seeding, prefetch_factor, pin_memory",
     "https://docs.pytorch.org/docs/stable/data.html", "2026-12-01"),
    ("PSS, Pss_Anon, smaps_rollup and Shmem: what the memory figures mean",
     "https://docs.kernel.org/filesystems/proc.html", "2026-12-01"),
    ("Trace Event Format (the trace files), opened by Perfetto",
     "https://perfetto.dev/docs/", "2026-12-01"),
    ("Distribution-free confidence intervals for a median from order statistics: W. J. "
     "Conover, Practical Nonparametric Statistics, 3rd ed., Wiley, 1999, section 3.2",
     "ISBN 978-0471160687", "2026-12-05"),
]


# -- the answer ----------------------------------------------------------------------------------

def _figure(what: str, arm: dict, key: str, unit: str, higher_is_better: bool = True,
            call: str | None = None) -> dict | None:
    """An arm's ratio ``key`` with its label; the label rests on the arm's check of its
    batches against its parent's, as the arm's own call does."""
    s = arm[key]
    if not s:
        return None
    label = stats.decision(s, ok=arm["correctness"]["ok"], higher_is_better=higher_is_better)[1]
    return {"what": what, "ratio": s["median"], "ci": [s["ci_low"], s["ci_high"]],
            "ci_level": s["ci_level"], "n": s["n"], "unit": unit, "call": call, "label": label}


def headline(result: dict) -> list[dict]:
    """The figures the page leads with: fastmm over torch's loader, each with its interval."""
    arms = result["arms"]
    data = arms.get("fastmm, loader alone") or arms.get("fastmm")
    e2e = arms.get("fastmm") if "fastmm, loader alone" in arms else None
    if data is None:
        return []
    out = [_figure("fastmm / torch samples/s, data pipeline (the loop only reads each batch)",
                   data, "ratio", "x samples/s", call=None if e2e else data["call"])]
    if e2e:
        out.append(_figure("fastmm / torch samples/s, end to end on your step", e2e, "ratio",
                           "x samples/s", call=e2e["call"]))
    main = e2e or data
    out.append(_figure("fastmm / torch host memory held (loader_host_bytes after the window)",
                       main, "memory_ratio", "x bytes", higher_is_better=False))
    out.append(_figure("fastmm / torch time to the first batch", main, "first_batch_ratio",
                       "x seconds", higher_is_better=False))
    return [f for f in out if f]


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.0f} MiB"


def answer(result: dict) -> list[str]:
    """The answer in a few sentences with numbers."""
    e, arms = result["environment"], result["arms"]
    gpus = ", ".join(d["name"] for d in e["gpus"]["devices"]) or "no GPU"
    data = arms.get("fastmm, loader alone") or arms.get("fastmm")
    lines = []
    if data:
        e2e = arms.get("fastmm") if "fastmm, loader alone" in arms else None
        text = (f"On this machine ({e['cpu_model']}, {e['cpu_count_usable']} cores, {gpus}), "
                "fastmm.DataLoader delivers your batches at "
                f"{stats.interval(data['ratio'], 2, 'x')}"
                " torch's DataLoader's rate with the loop only reading them")
        if e2e:
            text += f", and runs your step end to end at {stats.interval(e2e['ratio'], 2, 'x')}"
        lines.append(text + f" (paired runs; {data['ratio']['n']} rounds).")
        main, base = e2e or data, arms["torch"]
        if main.get("memory_ratio") and (base["host_bytes_held"] or {}).get("median", 0) > 2**20:
            lines.append(
                f"Running flat out it holds {_mib(main['host_bytes_held']['median'])} of host memory "
                f"against torch's {_mib(base['host_bytes_held']['median'])} "
                f"({stats.interval(main['memory_ratio'], 2, 'x')}), and hands out its first batch "
                f"in {main['first_batch_s']['median']:.2f} s against "
                f"{base['first_batch_s']['median']:.2f} s.")
        lines.append(f"Call: {main['call']} ({main['label']}).")
    lines += [f"fastmm was not run: {x['why']}." for x in result["not_run"] if x["arm"] == "fastmm"]
    observed = result["bottleneck"]["observed"]
    if observed:
        lines.append("torch's loader, untouched: " + "; ".join(observed) + ".")
    others = [f"{name}: {a['call']} ({stats.interval(a['ratio'], 2, 'x')})"
              for name, a in arms.items() if a.get("parent") and a["factor"] != "fastmm"]
    if others:
        lines.append("One change at a time: " + "; ".join(others) + ".")
    if result.get("auto"):
        lines.append(auto_answer(result["auto"]))
    return lines


def auto_answer(auto: dict) -> str:
    from .tuning import setting_name

    s = auto["summary"]
    return (f"num_workers='auto' (fastmm): {stats.interval(s['ratio'], 3, 'x')} the rate of the "
            f"best fixed setting of a sweep of {len(auto['settings'])} ({setting_name(s['best'])}: "
            f"{stats.interval(s['best_rate'], 1)} batches/s, run just before and just after "
            f"auto) over its last {auto['seconds']:g} s, 95% of it reached at "
            f"{stats.interval(s['reached_s'], 1, ' s')} ({s['never_reached']} of "
            f"{len(auto['rounds'])} rounds never within {auto['auto_seconds']:g} s); settled at "
            f"{s['settled_text']}. Call: {auto['call']} ({auto['label']}).")


def busy(result: dict) -> list[str]:
    """Timed runs during which other processes used the CPU, next to the figures they touch."""
    arms, bar = result["arms"], result["method"]["busy_cores"]
    counts = {n: a["busy_reps"] for n, a in arms.items() if a["busy_reps"]}
    rounds = (result.get("auto") or {}).get("rounds", [])
    busy_rounds = sum(1 for r in rounds if (r["other_processes_cpu_cores"] or 0) > bar)
    if busy_rounds:
        counts["auto's rounds"] = busy_rounds
    if not counts:
        return []
    runs = sum(len(a["reps"]) for a in arms.values()) + len(rounds)
    worst = max((r["other_processes_cpu_cores"] or 0)
                for r in [*rounds, *(r for a in arms.values() for r in a["reps"])])
    return [f"{sum(counts.values())} of {runs} timed runs ran while other processes used more "
            f"than {bar} cores (up to {worst:.2f}): "
            + ", ".join(f"{n} ({k})" for n, k in counts.items())
            + ". Their rates may be low; run again on a quiet machine."]


def alerts(result: dict) -> list[str]:
    """Failed checks and short windows: what a reader must know before trusting the figures."""
    arms, out = result["arms"], []
    failed = [n for n, a in arms.items() if not a["correctness"]["ok"]]
    if failed:
        out.append("Correctness check FAILED for " + ", ".join(failed) + ": see Correctness.")
    short = [n for n, a in arms.items() if a["ran_out"]]
    if short:
        out.append("The dataset ran out before the window closed in " + ", ".join(short)
                   + ": those windows hold fewer batches.")
    return out


# -- the page ------------------------------------------------------------------------------------

def _series(out: str, entry: dict) -> tuple[list[float], list[float]]:
    """(seconds, host bytes the loader held) from an arm's check run's telemetry series."""
    path = os.path.join(out, entry["telemetry_dir"], "timeseries.jsonl")
    t, y = [], []
    with contextlib.suppress(OSError):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                value = row.get("loader_host_bytes")
                if value is not None:
                    t.append(row["t_s"])
                    y.append(value)
    return t, y


def figures(result: dict, out: str) -> list[tuple]:
    """(name, Figure, caption) of every plot: each arm against its parent, samples/s per arm,
    torch's and fastmm's queue waits and step times, their memory over time; then the auto
    arm's."""
    from . import plots

    arms = result["arms"]
    auto = _auto_figures(result["auto"]) if result.get("auto") else []
    ratios = [(n, a["ratio"]) for n, a in arms.items() if a.get("ratio")]
    out_figures = [
        ("ratios", plots.rates(ratios, "samples/s, ratio to the arm it changes one thing of",
                               ref=1.0),
         "Each arm against its parent (the arm it differs from by one factor): median of the "
         "paired ratios, whiskers at its interval."),
    ] if ratios else []
    out_figures += [
        ("rates", plots.rates([(n, a["samples_per_s"]) for n, a in arms.items()], "samples/s"),
         "Samples per second in each arm's timed windows (end to end where the step runs)."),
    ]
    if "fastmm" not in arms:
        return out_figures + auto
    pair = ("torch", "fastmm")
    out_figures += [
        ("queue-wait", plots.distributions({n: arms[n]["waits_s"] for n in pair},
                                           "seconds the loop waited for a batch"),
         "The loop blocked in next(), every timed batch of every run."),
        ("step-time", plots.distributions({n: arms[n]["steps_s"] for n in pair},
                                          "seconds from one batch to the next"),
         "The loop's step time: batch to batch, the step included."),
    ]
    series = {n: _series(out, arms[n]) for n in pair}
    if all(t for t, _ in series.values()):
        out_figures.append((
            "memory", plots.over_time(series, "host memory the loader holds, MiB", yscale=2**-20),
            "loader_host_bytes over each loader's check run: Pss_Anon of its processes over the "
            "main process's before the loader, plus shared memory over idle."))
    return out_figures + auto


def _auto_figures(auto: dict) -> list[tuple]:
    """Auto's rate over time against the best fixed setting, and the sweep's rates."""
    from . import plots, tuning

    s = auto["summary"]
    rows = [(tuning.setting_name(k), v) for k, v in s["fixed_rates"].items()]
    out = [("auto-sweep", plots.rates(rows + [("num_workers='auto' (its last window)",
                                                s["auto_rate"])], "batches/s"),
            f"Each fixed setting of the sweep (median over the rounds, {auto['seconds']:g} s "
            "windows), and auto over the last window of its run.")]
    over_time = tuning.figure(auto["rounds"], s, auto["seconds"])
    return out + ([over_time] if over_time else [])


def write_page(result: dict, out: str) -> str:
    from .page import Page
    from .tuning import settled_name

    arms, e = result["arms"], result["environment"]
    p = Page(f"fastmm-bench: {result['pipeline']['dataset']}")
    p.answer(result["answer"])
    for text in result["busy"] + result["alerts"]:
        p.alert(text)
    p.heading("Throughput, queue wait, step time and memory")
    for name, fig, caption in figures(result, out):
        p.plot(name, fig, caption)
    p.heading("The arms")
    p.table(["arm", "changes", "samples/s", "ratio to parent", "first batch s", "host memory "
             "held", "loop waiting", "check", "call"],
            [[n, f"{a['factor']} (from {a['parent']})" if a["parent"] else "baseline",
              stats.interval(a["samples_per_s"], 1), stats.interval(a.get("ratio"), 2, "x"),
              stats.interval(a["first_batch_s"], 2),
              _mib(a["host_bytes_held"]["median"] if a["host_bytes_held"] else None),
              f"{a['queue_wait_share']['median']:.0%}" if a["queue_wait_share"] else "-",
              ("ok" if a["correctness"]["ok"] else "FAILED") + f": {a['correctness']['check']}",
              f"{a['call']}: {a['label']}" if a.get("call") else "-"]
             for n, a in arms.items()])
    if result.get("auto"):
        auto = result["auto"]
        p.heading("num_workers='auto' against a sweep of fixed settings")
        p.text(auto_answer(auto))
        p.table(["round", "best fixed before, after: batches/s",
                 "auto: batches/s, last window", "95% of best reached at", "settled at",
                 "changes"],
                [[str(i + 1), f"{r['before']['rate'] or 0:.1f}, {r['after']['rate'] or 0:.1f}",
                  f"{r['judged'].get('rate') or 0:.1f}",
                  "never" if r["judged"].get("reached_s") is None
                  else f"{r['judged']['reached_s']:.1f} s",
                  settled_name(r["auto"]["settled"]),
                  "; ".join(f"{c['at_s']:.0f} s: {c['setting']} {c['old']} to {c['new']}"
                            for c in r["auto"]["changes"]) or "none"]
                 for i, r in enumerate(auto["rounds"])])
    p.heading("Baseline profile: torch's DataLoader, untouched")
    m = result["baseline_profile"]["metrics"]
    rows = []
    for name in ("queue_wait_s", "step_s", "sample_s", "collate_s", "worker_pss_bytes",
                 "loader_host_bytes", "total_pss_bytes", "worker_cpu_percent"):
        d = m.get(name)
        if d:
            scale, unit = ((1e3, " ms") if name.endswith("_s") else
                           (2**-20, " MiB") if name.endswith("bytes") else (1, "%"))
            rows.append([f"`{name}`"] + [f"{d[k] * scale:.1f}{unit}" for k in ("p50", "p95",
                                                                              "p99", "max")])
    p.table(["metric", "p50", "p95", "p99", "max"], rows)
    b = result["bottleneck"]
    p.items([f"Observed (measured): {x}" for x in b["observed"]] +
            [f"Hypothesis (not measured): {x}" for x in b["hypotheses"]])
    p.heading("Correctness")
    p.items([f"{n}: {'ok' if a['correctness']['ok'] else 'FAILED'}: "
             f"{a['correctness']['check']} ({a['correctness']['why']})" for n, a in arms.items()]
            + [f"{x['arm']}: not run: {x['why']}" for x in result["not_run"]])
    w = result["window"]
    p.heading("Method")
    p.items([
        f"Pipeline: `{result['pipeline']['dataset']}`"
        + (f", step `{result['pipeline']['step']}`" if result["pipeline"]["step"] else
           ", no step (the loop reads every byte of each batch)")
        + f"; batches {result['pipeline']['batch']} ({_mib(result['pipeline']['batch_bytes'])}).",
        "Every arm: one untimed check run (every batch digested: the bytes of its tensors and "
        "arrays, its other values, its structure; telemetry with a trace), compared with its "
        "parent's batch by batch (no batch: a failed check); the baseline's untimed warm-up "
        "run digested too, and every timed run's first batch, to show it reproducible. Then "
        f"{w['reps']} rounds of all arms, each round starting one arm later; a fresh loader per "
        f"run, built after torch.manual_seed({result['settings']['seed']}) with a generator "
        "seeded the same, so every arm draws the same sample order and worker seeds.",
        f"Timed: the first batch (constructor to the loop's hands), then {w['timed_batches']} "
        f"batches after {w['warmup_batches']} (one per worker), each handed to the step.",
        f"Intervals: {stats.CI_METHOD}. Ratios are paired run by run within a round.",
        f"Calls: roll out when the ratio's interval lies above {stats.ROLL_OUT_BAR}, the "
        f"check passed and the arm holds at most {result['method']['memory_bar']:.2f}x its "
        "parent's memory; " + ROLLBACK + ".",
    ])
    p.heading("Environment")
    v = e["versions"]
    p.items([
        f"Command: `{e['command']}`; fastmm commit `{e['git']['commit']}`"
        + (" (with local changes)" if e["git"]["dirty"] else ""),
        f"{e['cpu_model']}, {e['cpu_count_usable']} usable cores, RAM "
        f"{e['ram_total_bytes'] / 2**30:.1f} GiB, /dev/shm "
        f"{(e['dev_shm']['total_bytes'] or 0) / 2**30:.1f} GiB; GPU: "
        f"{', '.join(d['name'] for d in e['gpus']['devices']) or 'none'}",
        f"Python {e['python']}, torch {v['torch']}, torchvision {v['torchvision']}, torchcodec "
        f"{v['torchcodec']}, NumPy {v['numpy']}, Pillow {v['pillow']}; fastmm C++ path: "
        f"{e['fastmm_uses_cpp']}",
        f"Date {e['timestamp_utc']}; total {result['total_s']:.0f} s.",
    ])
    p.heading("Traces")
    for name, a in arms.items():
        p.link(f"{a['telemetry_dir']}/trace.json", f"{name}: trace.json (open in ui.perfetto.dev)")
    p.heading("Sources")
    p.items([f"{what}: {where} (read {when})" for what, where, when in SOURCES])
    return p.write(os.path.join(out, "index.html"))
