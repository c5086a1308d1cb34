"""The benchmark's plots, from plain data, in one style: each function returns a matplotlib
Figure (no pyplot, so nothing is kept in a global registry; ``Page.plot`` inlines it). Sized
for a page read at 1400 px: 10 x (a few) inches at 100 dpi."""

from __future__ import annotations

import math

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, NullFormatter, ScalarFormatter

from . import stats

WIDTH = 10.0
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3")


def _figure(height: float) -> tuple[Figure, object]:
    fig = Figure(figsize=(WIDTH, height), layout="constrained")
    ax = fig.add_subplot()
    ax.grid(True, axis="x", color="#ddd", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig, ax


def _legend(fig: Figure, ax, columns: int = 1) -> None:
    """The legend under the plot, where it hides no line."""
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=columns,
               fontsize=9, frameon=False)


def _fmt(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def rates(rows: list[tuple[str, dict]], xlabel: str, ref: float | None = None) -> Figure:
    """Horizontal bars of each row's median (a ``stats.summarize`` dict; None: left out) with
    whiskers over its interval: solid where it is a 95% CI, dashed where it is only the range
    of too few repetitions to make one, so a reader sees which intervals to trust. ``ref``
    draws a reference line (1.0 for ratios)."""
    rows = [(label, s) for label, s in rows if s]
    fig, ax = _figure(0.5 * len(rows) + 1.4)
    kinds = set()
    for y, (label, s) in enumerate(rows):
        ci = stats.is_ci95(s)
        ax.barh(y, s["median"], color=COLORS[0], height=0.6)
        if s["n"] > 1:  # one repetition has no interval to draw
            kinds.add(ci)
            eb = ax.errorbar(s["median"], y, xerr=[[s["median"] - s["ci_low"]],
                                                   [s["ci_high"] - s["median"]]],
                             fmt="none", ecolor="black", capsize=5, linewidth=1.5)
            if not ci:
                eb[2][0].set_linestyle("--")
        ax.annotate(f" {_fmt(s['median'])}", (max(s["ci_high"], s["median"]), y),
                    va="center", fontsize=9)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    if ref is not None:
        ax.axvline(ref, color="#444", linewidth=1, linestyle=":")
    ax.set_xlim(0, max([s["ci_high"] for _, s in rows] + [ref or 0, 1e-9]) * 1.15)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    legend = {True: ("-", "95% CI of the median"),
              False: ("--", "range of the repetitions (fewer than 6: no 95% CI)")}
    shown = sorted(kinds, reverse=True)
    fig.legend([Patch(color=COLORS[0])] + [Line2D([], [], color="black", linestyle=legend[k][0])
                                           for k in shown],
               ["median"] + [legend[k][1] for k in shown], loc="outside lower center",
               ncols=1 + len(shown), fontsize=9, frameon=False)
    ax.set_xlabel(xlabel)
    return fig


def _quantile(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def distributions(series: dict[str, list[float]], xlabel: str, log: bool = True) -> Figure:
    """ECDFs (share of values at most x) of per-batch times such as queue wait or step time,
    one line per series, each labelled with its count, p50 and p95: the whole distribution,
    where a mean would hide the slow tail."""
    fig, ax = _figure(4.2)
    ax.grid(True, axis="y", color="#ddd", linewidth=0.8)
    for color, (name, values) in zip(COLORS * 3, series.items()):
        xs = sorted(values)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", color=color, linewidth=1.8,
                label=f"{name} (n={len(xs)}, p50 {_fmt(_quantile(xs, 0.5))}, "
                      f"p95 {_fmt(_quantile(xs, 0.95))})")
    if log and all(x > 0 for v in series.values() for x in v) and any(series.values()):
        ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("share of batches at most x")
    _legend(fig, ax)
    return fig


def over_time(series: dict[str, tuple[list[float], list[float]]], ylabel: str,
              yscale: float = 1.0) -> Figure:
    """Lines of a value against seconds since the start (memory over a run), one per series;
    ``yscale`` converts the values (2**-20: bytes to MiB)."""
    fig, ax = _figure(4.2)
    ax.grid(True, axis="y", color="#ddd", linewidth=0.8)
    for color, (name, (ts, values)) in zip(COLORS * 3, series.items()):
        ax.plot(ts, [v * yscale for v in values], color=color, linewidth=1.8, label=name)
    ax.set_xlabel("seconds since the start")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    _legend(fig, ax)
    return fig


def reaching(series: dict[str, tuple[list[float], list[float]]], best: float, reach: float,
             ylabel: str) -> Figure:
    """A rate over time for each series (auto's rounds) against a reference rate ``best`` and
    ``reach`` times it: where, and how soon, each series came within reach."""
    fig = over_time(series, ylabel)
    ax = fig.axes[0]
    for line in ax.get_lines():
        line.set_linewidth(1.2)
    ax.axhline(best, color="black", linewidth=1.5, label=f"best fixed setting: {_fmt(best)}")
    ax.axhline(best * reach, color="black", linewidth=1, linestyle="--",
               label=f"{reach:.0%} of it")
    top = max([best] + [max(values) for _, values in series.values() if values])
    ax.set_ylim(0, top * 1.1)
    for legend in fig.legends:
        legend.remove()
    _legend(fig, ax, columns=min(4, len(series) + 2))
    return fig


def break_even(in_place_epoch_s: float, staging_s: float, staged_epoch_s: float,
               in_place_open_s: float = 0.0) -> Figure:
    """Cumulative time against epochs for reading in place (after ``in_place_open_s``, what
    opening in place costs once) and for staging then reading the copy, with the crossing
    marked: the number of epochs from which staging pays."""
    saved = in_place_epoch_s - staged_epoch_s
    crossing = max(staging_s - in_place_open_s, 0.0) / saved if saved > 0 else None
    last = max(4, math.ceil(2 * crossing) if crossing else 4)
    epochs = list(range(last + 1))
    fig, ax = _figure(4.2)
    ax.grid(True, axis="y", color="#ddd", linewidth=0.8)
    opened = f"open {_fmt(in_place_open_s)} s, then " if in_place_open_s else ""
    ax.plot(epochs, [in_place_open_s + e * in_place_epoch_s for e in epochs], "o-",
            color=COLORS[1], label=f"read in place ({opened}{_fmt(in_place_epoch_s)} s an epoch)")
    ax.plot(epochs, [staging_s + e * staged_epoch_s for e in epochs], "o-", color=COLORS[0],
            label=f"stage ({_fmt(staging_s)} s), then read the copy ({_fmt(staged_epoch_s)} s "
                  "an epoch)")
    if crossing is not None:
        t = in_place_open_s + crossing * in_place_epoch_s
        ax.plot([crossing], [t], "D", color="black", markersize=8, zorder=5)
        ax.annotate(f"break-even: {crossing:.1f} epochs", (crossing, t), xytext=(12, -18),
                    textcoords="offset points", fontsize=10)
    else:
        ax.set_title("no break-even: the staged copy was not read faster")
    ax.set_xlabel("epochs (medians of the repetitions)")
    ax.set_ylabel("cumulative seconds")
    ax.set_xlim(0, last)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    _legend(fig, ax)
    return fig


def crossover(classes: dict[str, tuple[float, dict[int, float]]], ylabel: str) -> Figure:
    """GPU decode against one CPU core: per class, the GPU's rate at each batch size (a line)
    and one core's rate (a dashed line of the same colour); where a GPU line rises above its
    dashed line, the GPU beats one core. ``classes``: {name: (core rate, {batch: gpu rate})}."""
    fig, ax = _figure(4.5)
    ax.grid(True, axis="y", color="#ddd", linewidth=0.8)
    batches = sorted({b for _, gpu in classes.values() for b in gpu})
    for color, (name, (core, gpu)) in zip(COLORS * 3, classes.items()):
        bs = sorted(gpu)
        ax.plot(bs, [gpu[b] for b in bs], "o-", color=color, label=f"{name}: GPU")
        ax.axhline(core, color=color, linestyle="--", linewidth=1.2,
                   label=f"{name}: one CPU core ({_fmt(core)})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("GPU batch size")
    ax.set_ylabel(ylabel)
    _legend(fig, ax, columns=2)
    return fig
