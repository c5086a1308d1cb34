"""Readable reports of a results dict: plain text for the terminal, an HTML page for a reader
(``write_html``), Markdown as a second export; and the busy-machine notes every bench part
shares."""

from __future__ import annotations

import os

from . import stats
from .workloads import CONSUMERS

BUSY_CORES = 0.25  # a timed repetition during which other processes used more CPU counts as busy


def save(out: str, stem: str, result: dict, text: str, page=None) -> None:
    """Write ``<stem>.json`` (every figure), ``<stem>.md`` (the report in Markdown) and, given
    a ``page.Page``, ``report.html`` (the report a reader opens) into ``out``, and print the
    Markdown: how every bench command leaves its result."""
    import json

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    if page is not None:
        page.write(os.path.join(out, "report.html"))
    print(text)


def called(finding: dict) -> str:
    """A finding's call as every page and export words it."""
    return f"Call: **{finding['call']}** ({finding['label']})."


def save_study(out: str, stem: str, result: dict, title: str, header: list[str],
               rows: list[list[str]], notes: list[str], figures: list[tuple]) -> None:
    """A study's result: ``<stem>.json``; ``report.html``, the page a reader opens (the
    finding and its call at the top, busy-machine alerts beside them, the plots, the table,
    the notes); ``<stem>.md``, the same in Markdown without the plots."""
    from .page import Page

    f = result["finding"]
    page = Page(title)
    page.answer([f["text"], called(f)])
    for note in result["busy"]:
        page.alert(note)
    for name, fig, caption in figures:
        page.plot(name, fig, caption)
    page.table(header, rows)
    for line in notes:
        page.text(line)
    md = [f"# {title}", "", f["text"], "", called(f), "",
          *[f"**{note}**\n" for note in result["busy"]],
          "| " + " | ".join(header) + " |", "|---" * len(header) + "|",
          *["| " + " | ".join(r) + " |" for r in rows], "", "\n\n".join(notes)]
    save(out, stem, result, "\n".join(md), page)


def busy_notes(what: str, cores: list[float | None]) -> list[str]:
    """[] on a quiet run; else one sentence for the page's top: how many of the timed
    repetitions ran while other processes used more than BUSY_CORES."""
    busy = [c for c in cores if c is not None and c > BUSY_CORES]
    if not busy:
        return []
    return [f"{what}: {len(busy)} of {len(cores)} timed repetitions ran while other processes "
            f"used more than {BUSY_CORES:g} cores (up to {max(busy):.2f}): its figures may be "
            "lower and more spread than on a quiet machine."]


def method(consume: str) -> dict:
    """How each figure is defined, for the results JSON (``consume``: the consumer's name)."""
    return {
        "interleaving": "per case: one untimed warm-up repetition of every arm, then --reps rounds "
        "of (torch, fastmm, reference arms) back to back, each round starting one arm later, "
        "then --mem-reps rounds of (torch, "
        "fastmm at full speed; torch, fastmm paced) with the PSS sampler on",
        "fresh_loader_per_rep": True,
        "seed": "every loader is built right after torch.manual_seed(--seed), so torch and fastmm "
        "draw the same base seed and their workers' random transforms agree",
        "first_batch_s": "from just before DataLoader(...) is constructed until its first batch "
        "has been consumed (worker start-up included)",
        "throughput_window": "opens after the first num_workers batches (one per worker) have been "
        "consumed; closes at the first batch boundary after --min-seconds where the window holds a "
        "whole number of rounds (a multiple of num_workers batches); only batches inside it count",
        "consumer": CONSUMERS[consume][1] + "; the loop's only work per batch",
        "digests": "per batch, CRC-32 of its content (every tensor's and array's bytes, every "
        "other value's repr: strings, numbers) and of its structure (containers, keys, types, "
        "dtypes, shapes). Each loader's untimed warm-up repetition digests every batch, and "
        "torch's and fastmm's must agree batch by batch over the batches both delivered; every "
        "other repetition digests its first batch (after first_batch_s is taken, before the "
        "window opens: in neither figure), which must equal the warm-up's first. A repetition "
        "without a digest fails the check (summary.check)",
        "fetch_wait_s": "time the loop spent blocked in next(iterator) inside the window",
        "shmem": "Shmem of /proc/meminfo (tmpfs, /dev/shm, memfd pages on the whole machine, "
        "mapped or not), sampled with each PSS sweep, peak minus the value before the loader was "
        "built: PSS misses shared-memory pages no process maps, such as a torch batch segment "
        "whose fd is in flight from a worker to the main process; other processes' shared memory "
        "would show up here too",
        "pss": "psutil memory_full_info().pss of the main process + all descendants, summed, every "
        "50 ms (or back to back when a sweep takes longer) from a thread started right after "
        "iter(loader); peak over the repetition; '+over idle' subtracts the PSS just before the "
        "loader was built. Only in memory repetitions: one sweep costs tens of ms of CPU per "
        "process, which would perturb timed runs",
        "memory_conditions": "max-throughput memory repetitions run the loop as fast as each "
        "loader delivers (a faster loader keeps fuller prefetch buffers, so speed and memory mix); "
        "paced memory repetitions make every loop step (consume, then sleep holding the batch) "
        "last step = pace_factor x torch's median batch interval in the timed repetitions of the "
        "case (batch_size / median samples/s), the same for both loaders, so both are "
        "consumer-bound with full prefetch buffers and the peak is the loader's own overhead; "
        "kept_pace says whether, in every paced repetition of a loader, the loop waited for "
        "batches (fetch_wait_s) at most 1 - kept_pace_fraction of the window. In paced "
        "repetitions the PSS sampler sweeps at most paced_pss_max_duty of the time, at jittered "
        "intervals: back to back it would take about a core and the workers of a 2-core machine "
        "could not hold the pace; the plateau of full buffers lasts most of each step, so sparser "
        "samples still find it",
        "memory_target": "fastmm's host memory held no higher than torch's, judged per "
        "condition on the ratios fastmm/torch of peak host memory held in each round (their "
        "repetitions ran back to back). Host memory held (peak_host_held_bytes): the Pss_Anon of "
        "this process and its descendants over this process's before the loader, plus the "
        "machine's Shmem over its level then: what is the loader's alone, and the shared memory "
        "it holds whether or not a process maps it (PSS misses torch's queued batches, Shmem "
        "the samples a worker holds). verdict_on_pss and verdict_on_total judge peak PSS over "
        "idle and peak total PSS the same way; paced.conclusive is false when a loader did not "
        "keep pace (its buffers were not full)",
        "verdicts": "a target is met when the interval of the median paired ratio (statistics) "
        "lies wholly on the target's side, NOT met when it lies wholly on the other, and "
        "not shown when it straddles the target (the repetitions cannot tell); one repetition's "
        "interval is its value",
        "cpu_ms_per_sample": "user+system CPU of the main process and its workers during the "
        "window, per sample",
        "other_processes_cpu_cores": "machine-wide busy CPU minus this benchmark's own, during the "
        "window, in cores (a busy machine shows up here)",
        "statistics": "median over timed repetitions, min..max, and the " + stats.CI_METHOD
        + "; ratio = median(fastmm) / median(torch), paired ratios = rep i / rep i",
        "decode_limit": "L = usable cores x single-thread rate of the same __getitem__ measured in "
        "the same run",
        "transport_ceiling": "the consume-alone rate (the consumer over one batch already in "
        "memory, one thread): the loop reads every byte of every batch on one core, so no loader "
        "can deliver faster; single-process and single-reuse show what one core does with all the "
        "work (x cores is a rough two-core figure, not a bound: fresh-memory page faults and "
        "allocator state weigh differently in one process than in workers)",
    }


def _rate(s: dict | None, scale: float = 1.0, digits: int = 0) -> str:
    if not s:
        return "-"
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'] * scale)} [{f.format(s['min'] * scale)}-{f.format(s['max'] * scale)}]"


def _one(s: dict | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if not s else f"{s['median'] * scale:.{digits}f}"


def _rows(case: dict) -> list[list[str]]:
    arms = case["summary"]["arms"]
    torch_rate = arms["torch"]["samples_per_s"]["median"]
    rows = []
    for name, a in arms.items():
        rate = a["samples_per_s"]
        rows.append(
            [
                name,
                _rate(rate, digits=0 if rate and rate["median"] >= 100 else 1),
                _one(a["bytes_per_s"], 1e-9),
                f"{rate['median'] / torch_rate:.2f}x" if rate and torch_rate else "-",
                _rate(a["first_batch_s"], digits=2),
                _held(a),
                _held(a, "paced_"),
                _one(a["cpu_ms_per_sample"], 1.0, 2),
            ]
        )
    return rows


def _held(arm: dict, prefix: str = "") -> str:
    held = arm.get(prefix + "peak_host_held_bytes")
    return f"{held['median'] / 2**20:.0f}" if held else "-"


HEADER = ["arm", "samples/s median [min-max]", "GB/s", "vs torch", "first batch s",
          "host memory held MiB, full speed", "host memory held MiB, paced", "CPU ms/sample"]


def _mib(value: float) -> str:
    return f"{value / 2**20:.0f}"


def _waits(case: dict) -> str:
    """Median share of the paced window the loop spent waiting for batches, per loader."""
    parts = []
    for name in ("torch", "fastmm"):
        shares = sorted(r["fetch_wait_s"] / r["window_s"] for r in case["arms"][name]["reps"]
                        if r["phase"] == "memory-paced" and r["window_s"] > 0)
        if shares:
            mid = len(shares) // 2
            median = shares[mid] if len(shares) % 2 else (shares[mid - 1] + shares[mid]) / 2
            parts.append(f"{name} {median:.1%}")
    return ", ".join(parts) or "-"


def _memory_notes(case: dict) -> list[str]:
    memory = case["summary"].get("memory")
    if not memory:
        return []
    notes = []
    conditions = [("max_throughput", "at full speed")]
    if memory["paced_step_s"]:
        lagging = [name for name in ("torch", "fastmm") if memory["kept_pace"].get(name) is False]
        conditions.append(
            (
                "paced",
                f"paced ({memory['paced_step_s'] * 1e3:.0f} ms/step = {memory['pace_factor']:g} x "
                f"torch's median batch interval, {memory['paced_target_samples_per_s']:.0f} samples/s; "
                + f"the loop waited for batches {_waits(case)} of the window; "
                + (
                    f"{' and '.join(lagging)} made it wait more than "
                    f"{1 - memory['kept_pace_fraction']:.0%} in some repetition: buffers not always full"
                    if lagging
                    else "both kept pace"
                )
                + ")",
            )
        )
    for key, label in conditions:
        c = memory[key]
        if not c:
            continue
        ratio = c["ratio_over_baseline_fastmm_over_torch"]
        held = (c["torch_host_held_bytes"], c["fastmm_host_held_bytes"])
        text = (
            f"host memory held {label}: "
            + (f"torch {_mib(held[0])} MiB, fastmm {_mib(held[1])} MiB; "
               if None not in held else "not measured here (no Pss_Anon: Linux < 5.8); ")
            + "target (fastmm's no higher than torch's): "
            + (
                f"INCONCLUSIVE (a loader did not keep pace; the figures say "
                f"{_verdict(c['verdict'], c['paired_ratios_host_held'])})"
                if c.get("conclusive") is False
                else _verdict(c["verdict"], c["paired_ratios_host_held"])
            )
            + f"; peak PSS: torch {_mib(c['torch_peak_total_pss_bytes'])} MiB "
            f"(+{_mib(c['torch_peak_pss_over_baseline_bytes'])} over idle), fastmm "
            f"{_mib(c['fastmm_peak_total_pss_bytes'])} MiB "
            f"(+{_mib(c['fastmm_peak_pss_over_baseline_bytes'])}), fastmm/torch over idle "
            f"{f'{ratio:.2f}x' if ratio is not None else '-'} ({c['verdict_on_pss']} on PSS)"
        )
        rates = (c["torch_samples_per_s"], c["fastmm_samples_per_s"])
        if None not in rates:
            text += f"; loop rate with the sampler on: torch {rates[0]:.0f}/s, fastmm {rates[1]:.0f}/s"
        shm = (c["torch_peak_shmem_over_baseline_bytes"], c["fastmm_peak_shmem_over_baseline_bytes"])
        if None not in shm:
            text += (f"; machine-wide shared memory (Shmem, incl. segments no process maps) peak "
                     f"over idle: torch +{_mib(shm[0])} MiB, fastmm +{_mib(shm[1])} MiB")
        if key == "max_throughput" and c["verdict"] not in ("met", None) and None not in rates \
                and rates[1] > rates[0]:
            text += (f"; flat out (fastmm's loop {rates[1] / rates[0]:.1f}x torch's here) each "
                     "worker keeps its slabs, where torch frees each batch's segment; "
                     "FASTMM_SLAB_MEMORY=lean trades speed for memory (docs/loader.md, "
                     "\"Shared memory it needs\")")
        notes.append(text)
    return notes


def _digest_note(case: dict) -> str:
    c = case["summary"]["check"]
    said = (f"{c['batches_compared']} batches of the warm-up repetitions compared one by one, "
            f"the first batch of {c['repetitions_first_batch']} other loader repetitions")
    if c["ok"]:
        return f"batches: torch and fastmm agree ({said})"
    wrong = []
    if not c["batches_compared"]:
        wrong.append("no batch was compared")
    if c["first_difference"] is not None:  # an index from 0
        wrong.append(f"batch {c['first_difference'] + 1} of the warm-ups differs")
    if c["repetitions_first_batch_differs"]:
        wrong.append(f"{c['repetitions_first_batch_differs']} first batches differ or are missing")
    return f"WARNING: batches differ: {'; '.join(wrong)} ({said})"


def _verdict(verdict: str | None, ratios: dict | None) -> str:
    """A target's verdict with the interval it was judged on."""
    if not ratios:
        return verdict or "-"
    return f"{verdict} (paired ratio {stats.interval(ratios, 2, 'x')})"


def _notes(case: dict) -> list[str]:
    s = case["summary"]
    notes = []
    pr = s["paired_ratios_fastmm_over_torch"]
    target = s["target"]
    notes.append(
        f"fastmm/torch = {s['ratio_fastmm_over_torch']:.2f}x (paired per repetition "
        f"{pr['min']:.2f}-{pr['max']:.2f}); target {target['description']}: "
        f"{_verdict(target['verdict'], pr)}"
    )
    if "ceiling" in s:
        c = s["ceiling"]
        notes.append(
            f"ceiling (the loop's consumer alone, one core) {c['consume_alone_samples_per_s']:.0f}/s: "
            f"torch at {c['torch_fraction_of_ceiling']:.0%}, fastmm at "
            f"{c['fastmm_fraction_of_ceiling']:.0%}; no loader can beat torch by more than "
            f"{c['highest_possible_ratio_over_torch']:.2f}x here"
        )
        notes.append(
            f"one core alone: single-process {c['single_process_samples_per_s']:.0f}/s "
            f"(x{c['cores']} = {c['cores_x_single_process_samples_per_s']:.0f}/s), single-reuse "
            f"{c['single_reuse_samples_per_s']:.0f}/s (x{c['cores']} = "
            f"{c['cores_x_single_reuse_samples_per_s']:.0f}/s)"
        )
    if "decode_limit" in s:
        d = s["decode_limit"]
        notes.append(
            f"limit L (cores x one thread of __getitem__) = {d['cores']} x {d['getitem_1_thread_samples_per_s']:.0f}/s = "
            f"{d['limit_samples_per_s']:.0f}/s: torch at {d['torch_fraction_of_limit']:.0%} of L, "
            f"fastmm at {d['fastmm_fraction_of_limit']:.0%}"
        )
    notes += _memory_notes(case)
    notes.append(_digest_note(case))
    other = s.get("other_processes_cpu_cores_max")
    if other is not None:
        busy = s.get("busy_timed_reps", 0)
        text = f"other processes used at most {other:.2f} cores during a timed window"
        if s.get("discarded_busy_reps"):
            text += f"; {s['discarded_busy_reps']} busy repetition(s) redone"
        if busy:
            text += f"; {busy} of {s['timed_reps']} timed repetitions ran on a busy machine: treat with care"
        if s.get("busy_memory_reps"):
            text += f"; {s['busy_memory_reps']} memory repetition(s) ran on a busy machine"
        notes.append(text)
    return notes


def _table(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(HEADER), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


def _case_title(case: dict) -> str:
    return (
        f"{case['name']}: batch {case['batch_size']}, {case['num_workers']} workers; "
        f"{case['description']}"
    )


def text(results: dict) -> str:
    env = results["environment"]
    st = results["settings"]
    out = [
        "",
        f"fastmm-bench  {env['timestamp_utc']}  {env['cpu_model']} x{env['cpu_count_usable']}  "
        f"torch {env['versions']['torch']}  C++ path: {env['fastmm_uses_cpp']}",
        f"{st['reps']} timed reps per arm (>= {st['min_seconds']} s each) after 1 warm-up, "
        f"{st['mem_reps']} full-speed + {st['mem_reps']} paced memory rep(s) per loader; "
        f"consumer {st['consume']}",
    ]
    for case in results["cases"]:
        out += ["", _case_title(case), _table(_rows(case), markdown=False)]
        out += ["  " + n for n in _notes(case)]
    return "\n".join(out) + "\n"


def markdown(results: dict, title: str = "fastmm-bench: torch vs fastmm DataLoader") -> str:
    env = results["environment"]
    st = results["settings"]
    git = env["git"]
    commit = git["commit"] or "unknown"
    dirty = (
        f" (with uncommitted changes to {', '.join(git['changed_files'])})" if git.get("dirty") else ""
    )
    out = [
        f"# {title}",
        "",
        f"Command: `{env['command']}`  ",
        f"Commit: `{commit}`{dirty}  ",
        f"Date: {env['timestamp_utc']}; total {results.get('total_s', 0):.0f} s",
        "",
        *([f"**Interrupted** {results['interrupted']}: the cases below are the ones that "
           "finished.", ""] if results.get("interrupted") else []),
        f"Environment: {env['cpu_model']}, {env['cpu_count_usable']} usable cores, "
        f"{env['ram_total_bytes'] / 2**30:.1f} GiB RAM, /dev/shm "
        f"{(env['dev_shm']['total_bytes'] or 0) / 2**30:.1f} GiB; Python {env['python']}, "
        f"torch {env['versions']['torch']}, torchvision {env['versions']['torchvision']}, numpy "
        f"{env['versions']['numpy']}, Pillow {env['versions']['pillow']}; fastmm C++ path: "
        f"{env['fastmm_uses_cpp']}; load average at start {env['loadavg_at_start'][0]:.2f}, at end "
        f"{env.get('loadavg_at_end', [float('nan')])[0]:.2f}.",
        "",
        f"Method: {st['reps']} timed repetitions per arm (window >= {st['min_seconds']} s, opened "
        "after the first batch of every worker), interleaved in rounds that each start one arm "
        "later, after one untimed warm-up; fresh DataLoader per repetition, built right after "
        f"torch.manual_seed({st['seed']}). Loop consumer: {CONSUMERS[st['consume']][1]}. Peak "
        f"PSS comes from {st['mem_reps']} extra repetition(s) per loader and condition with the "
        "PSS sampler on: at full speed (each loader as fast as it goes; a sweep every "
        f"{st['pss_interval_s'] * 1e3:.0f} ms or back to back) and paced (the loop runs on a "
        f"fixed clock of {st['pace_factor']:g} x torch's median batch interval from the timed "
        "repetitions, the same for both loaders, consuming each batch and sleeping while holding "
        "it, so both are consumer-bound with full prefetch buffers; the sampler sweeps at most "
        f"{st['paced_pss_max_duty']:.0%} of the time, at jittered intervals, so that it leaves the "
        "workers enough CPU to hold the pace). Figures are medians with [min-max]; the JSON has "
        "every repetition.",
    ]
    for case in results["cases"]:
        out += ["", f"## {case['name']}", "", _case_title(case), "", _table(_rows(case), markdown=True), ""]
        out += [f"- {n}" for n in _notes(case)]
    return "\n".join(out) + "\n"


def finding(results: dict) -> dict | None:
    """The loader part's answer for a reader, from its first case (transport when it ran):
    fastmm's samples/s against torch's, paired per repetition, with the call that interval
    supports (``stats.decision``; both loaders' batches must agree)."""
    if not results["cases"]:
        return None
    case, *others = results["cases"]
    s = case["summary"]
    arms = s["arms"]
    call, label = stats.decision(s["paired_ratios_fastmm_over_torch"],
                                 ok=s["check"]["ok"])
    first = {n: arms[n]["first_batch_s"]["median"] for n in ("fastmm", "torch")
             if arms[n]["first_batch_s"]}
    text = (f"{case['name']} (batch {case['batch_size']}, {case['num_workers']} workers): "
            f"fastmm {stats.interval(s['paired_ratios_fastmm_over_torch'], 2, 'x')} torch's "
            "samples/s (paired per repetition)"
            + (f"; first batch in {first['fastmm']:.2f} s (torch {first['torch']:.2f} s)"
               if len(first) == 2 else "") + ".")
    memory = s.get("memory") or {}
    held = [(label, memory[key]) for key, label in (("max_throughput", "at full speed"),
                                                    ("paced", "paced"))
            if memory.get(key) and memory[key].get("paired_ratios_host_held")]
    if held:
        text += (" Host memory held (Pss_Anon + Shmem over idle), fastmm over torch: " + "; ".join(
            f"{label} {stats.interval(c['paired_ratios_host_held'], 2, 'x')}"
            + ("" if c.get("conclusive", True) else " (inconclusive: a loader did not keep pace)")
            for label, c in held) + ".")
    if others:
        text += " Also: " + "; ".join(
            f"{c['name']} {stats.interval(c['summary']['paired_ratios_fastmm_over_torch'], 2, 'x')}"
            for c in others) + "."
    return {"text": text, "call": call, "label": label}


def busy(results: dict) -> list[str]:
    """The busy-machine notes of a fastmm-bench run, one per case that had busy repetitions."""
    notes = []
    for case in results["cases"]:
        cores = [r["other_processes_cpu_cores"] for a in case["arms"].values()
                 for r in a["reps"] if r["phase"] == "timed"]
        notes += busy_notes(f"loader, {case['name']}", cores)
    return notes


def figures(results: dict) -> list[tuple]:
    """(name, Figure, caption) per case: every arm's samples/s with its interval."""
    from . import plots

    out = []
    for case in results["cases"]:
        arms = case["summary"]["arms"]
        out.append((f"rates-{case['name']}",
                    plots.rates([(n, a["samples_per_s"]) for n, a in arms.items()], "samples/s"),
                    f"{_case_title(case)}. Bars: median samples/s of the timed repetitions; "
                    "whiskers: " + stats.CI_METHOD + "."))
    return out


def write_html(results: dict, out: str) -> str:
    """``report.html`` in ``out``: the answer, then per case its table, plot and notes."""
    from .page import Page

    env, st = results["environment"], results["settings"]
    page = Page("fastmm-bench: torch's DataLoader and fastmm's, side by side")
    f = finding(results)
    if f:
        page.answer([f["text"], called(f)])
    if results.get("interrupted"):
        page.alert(f"Interrupted {results['interrupted']}: the cases below are the ones that "
                   "finished.")
    for note in busy(results):
        page.alert(note)
    git = env["git"]
    page.text(f"Command: `{env['command']}`; commit `{git['commit'] or 'unknown'}`"
              + (" (with uncommitted changes)" if git.get("dirty") else "")
              + f"; {env['timestamp_utc']}; total {results.get('total_s', 0):.0f} s.")
    page.text(f"Machine: {env['cpu_model']}, {env['cpu_count_usable']} usable cores, "
              f"{env['ram_total_bytes'] / 2**30:.1f} GiB RAM; Python {env['python']}, torch "
              f"{env['versions']['torch']}; fastmm C++ path: {env['fastmm_uses_cpp']}.")
    page.text(f"Method: {st['reps']} timed repetitions per arm (>= {st['min_seconds']} s each) "
              "after one untimed warm-up, interleaved, a fresh loader each; "
              f"{st['mem_reps']} full-speed and paced memory repetitions per loader; loop "
              f"consumer: {CONSUMERS[st['consume']][1]}. Intervals: {stats.CI_METHOD}.")
    figs = {name: (fig, caption) for name, fig, caption in figures(results)}
    for case in results["cases"]:
        page.heading(case["name"])
        page.text(_case_title(case))
        page.table(HEADER, _rows(case))
        fig, caption = figs[f"rates-{case['name']}"]
        page.plot(f"rates-{case['name']}", fig, caption)
        page.items(_notes(case))
    page.text("Every repetition's figures: `results.json`; the same report in Markdown: "
              "`summary.md`.")
    return page.write(os.path.join(out, "report.html"))
