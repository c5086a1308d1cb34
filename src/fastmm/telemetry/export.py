"""Exports of a telemetry session: a summary (JSON and a terminal table), a time series (JSON
lines, one sampler row each) and a Chrome trace (JSON; opens in Perfetto or chrome://tracing)
with one track for the main loop, one per worker and one for the GPU, and memory counters."""

from __future__ import annotations

import json
import os

from .metrics import METRICS
from .recorder import SAMPLE_COPY, STAGES

MAIN_TID, GPU_TID = 0, 1000


def table(summary: dict) -> str:
    """The summary as aligned text: distributions as p50 / p95 / p99 / max."""
    lines = [f"{summary['loader']}: {summary['samples']} samples in {summary['batches']} "
             f"batches, {summary['num_workers']} workers, {summary['wall_s']:.2f} s"]
    tuned = summary.get("tuned")
    if tuned:
        lines.append(f"  tuned (num_workers='auto'): now num_workers={tuned['num_workers']}, "
                     f"prefetch_factor={tuned['prefetch_factor']}")
        lines += [f"    at {c['at_s']:.1f} s: {c['setting']} {c['old']} -> {c['new']} ({c['why']})"
                  for c in tuned["changes"]]
    width = max(len(k) for k in METRICS)
    for name in METRICS:
        value = summary["metrics"].get(name)
        if isinstance(value, dict):
            text = "  ".join(f"{k} {_fmt(name, value[k])}" for k in ("p50", "p95", "p99", "max"))
            text += f"  (n={value['count']})"
        elif value is None:
            text = "-"
        else:
            text = _fmt(name, value)
        lines.append(f"  {name:<{width}}  {text}")
    return "\n".join(lines)


def _fmt(name: str, value: float) -> str:
    if name.endswith("_bytes"):
        return f"{value / 2**20:.1f} MiB"
    if name.endswith("_bytes_per_s"):
        return f"{value / 2**20:.1f} MiB/s"
    if name.endswith("_s") and not name.endswith("per_s"):
        return f"{value * 1e3:.2f} ms"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def write(directory: str, summary: dict, series: list[dict], spans, loop_events, gpu_events,
          t0_ns: int) -> dict[str, str]:
    """summary.json; timeseries.jsonl, one sampler row a line (its fields: sampler.Sampler);
    with ``spans``, trace.json. Returns the paths written, by kind.

    Args:
        directory: where the files go (made if missing).
        summary: the session's summary (Telemetry.summary()).
        series: the sampler's rows, in order.
        spans: the stage spans, rows of (process row, stage, start ns, end ns, value) as
            SpanLog.drain gives them; None: no trace.
        loop_events: (name, start ns, end ns) of the loop's marks, for the trace.
        gpu_events: (name, host start ns, GPU seconds) of CUDA-timed marks, for the trace.
        t0_ns: the session's start (time.monotonic_ns), the trace's zero.
    """
    os.makedirs(directory, exist_ok=True)
    paths = {"summary": os.path.join(directory, "summary.json"),
             "timeseries": os.path.join(directory, "timeseries.jsonl")}
    with open(paths["summary"], "w") as f:
        json.dump(summary, f, indent=1)
    with open(paths["timeseries"], "w") as f:
        for row in series:
            f.write(json.dumps(row) + "\n")
    if spans is not None:
        paths["trace"] = os.path.join(directory, "trace.json")
        trace = chrome_trace(spans, loop_events, gpu_events, series, t0_ns, summary["loader"])
        with open(paths["trace"], "w") as f:  # dumps: C's encoder, 3x json.dump's Python one
            f.write(json.dumps(trace))
    return paths


def chrome_trace(spans, loop_events, gpu_events, series, t0_ns: int, loader: str) -> dict:
    """Trace Event Format: complete ("X") events in microseconds from the session's start.

    Args:
        spans: the stage spans, rows of (process row, stage, start ns, end ns, value): a track
            for the main loop (row 0) and one per worker.
        loop_events: (name, start ns, end ns) of the loop's marks, on the main loop's track.
        gpu_events: (name, host start ns, GPU seconds) of CUDA-timed marks, on the GPU's track
            at the host time the work was queued.
        series: the sampler's rows, whose memory figures become counters.
        t0_ns: the session's start (time.monotonic_ns), the trace's zero.
        loader: the loader's name, the trace's process name.
    """
    pid = 1
    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": loader}},
              {"ph": "M", "name": "thread_name", "pid": pid, "tid": MAIN_TID,
               "args": {"name": "main loop"}}]
    rows = sorted({int(r) for r in spans[:, 0]}) if len(spans) else []
    for row in rows:
        if row:
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": row,
                           "args": {"name": f"worker {row - 1}"}})
    for row, code, start, end, value in spans.tolist():
        event = {"ph": "X", "name": STAGES[code], "pid": pid, "tid": row or MAIN_TID,
                 "ts": (start - t0_ns) / 1e3, "dur": (end - start) / 1e3}
        if value == SAMPLE_COPY:
            event["args"] = {"copies": "one sample into its batch"}
        elif value:
            event["args"] = {"bytes" if STAGES[code] == "read" else "samples": value}
        events.append(event)
    for name, start, end in loop_events:
        events.append({"ph": "X", "name": name, "pid": pid, "tid": MAIN_TID,
                       "ts": (start - t0_ns) / 1e3, "dur": (end - start) / 1e3})
    if gpu_events:
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": GPU_TID,
                       "args": {"name": "GPU"}})
    for name, start, seconds in gpu_events:  # placed at the host time the work was queued
        events.append({"ph": "X", "name": name, "pid": pid, "tid": GPU_TID,
                       "ts": (start - t0_ns) / 1e3, "dur": seconds * 1e6})
    for row in series:  # counters of the sweeps' memory figures
        ts = (row["t_ns"] - t0_ns) / 1e3
        if "pss_bytes" in row and all(v is not None for v in row["pss_bytes"]):
            events.append({"ph": "C", "name": "total_pss_bytes", "pid": pid, "ts": ts,
                           "args": {"bytes": sum(row["pss_bytes"])}})
        if row.get("loader_host_bytes") is not None:
            events.append({"ph": "C", "name": "loader_host_bytes", "pid": pid, "ts": ts,
                           "args": {"bytes": row["loader_host_bytes"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
