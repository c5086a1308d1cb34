"""Summaries of repeated measurements: median, min, max and a bootstrap 95% CI of the median."""

from __future__ import annotations

import statistics

import numpy as np

BOOTSTRAP_RESAMPLES = 4000


def summarize(values, seed: int = 0) -> dict | None:
    """{n, median, min, max, ci95_low, ci95_high} of the non-None values, or None if there are
    none. The CI is a percentile bootstrap of the median (with few repetitions it is coarse and
    never wider than min..max; read min..max as the spread)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    out = {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    if len(xs) >= 2:
        rng = np.random.default_rng(seed)
        samples = rng.choice(np.asarray(xs), size=(BOOTSTRAP_RESAMPLES, len(xs)), replace=True)
        medians = np.median(samples, axis=1)
        out["ci95_low"], out["ci95_high"] = (float(v) for v in np.percentile(medians, [2.5, 97.5]))
    else:
        out["ci95_low"] = out["ci95_high"] = xs[0]
    return out


def paired_ratios(numerators, denominators) -> list[float]:
    """Ratios of repetition i of one arm to repetition i of another (they ran back to back)."""
    return [
        n / d
        for n, d in zip(numerators, denominators)
        if n is not None and d is not None and d > 0
    ]


def verdict(ratios: dict | None, aim: float, *, at_most: bool = False) -> str | None:
    """A target on a ratio judged by the 95% CI of its median (``summarize``'s), so that noise
    is not read as a result: "met" when the whole interval is on the target's side of ``aim``
    (>= aim, or <= aim with ``at_most``), "NOT met" when it is wholly on the other side, and
    "not shown" when it straddles ``aim``. One repetition's interval is its value."""
    if not ratios:
        return None
    low, high = ratios["ci95_low"], ratios["ci95_high"]
    if at_most:
        low, high, aim = -high, -low, -aim
    if low >= aim:
        return "met"
    return "NOT met" if high < aim else "not shown"
