"""Summaries of repeated measurements: median, min, max and a confidence interval of the median
that says how sure it is.

The interval is distribution-free: a pair of order statistics (x_(k), x_(n+1-k)) covers the
population median with probability 1 - 2 P(Binomial(n, 1/2) < k), whatever the distribution of
the repetitions (they need only be independent). k is the largest that keeps the coverage at
least 95%; six repetitions are the fewest that allow any (their range: 96.9%). With fewer, the
interval is the range of the repetitions and its coverage is stated with it (5: 93.8%, 3: 75%),
never called a 95% CI.
"""

from __future__ import annotations

import math
import statistics

CI_LEVEL = 0.95
CI_METHOD = ("distribution-free interval of the median from order statistics (binomial "
             "coverage >= 95%; with fewer than 6 repetitions, their range and its coverage)")


def _coverage(n: int, k: int) -> float:
    """P(x_(k) <= median <= x_(n+1-k)) for n independent repetitions."""
    below = sum(math.comb(n, i) for i in range(k)) / 2 ** n
    return 1.0 - 2.0 * below


def summarize(values) -> dict | None:
    """{n, median, min, max, ci_low, ci_high, ci_level} of the non-None values (None if there
    are none); ``ci_level`` is the interval's coverage (see the module docstring)."""
    xs = sorted(float(v) for v in values if v is not None)
    if not xs:
        return None
    n = len(xs)
    k = 1
    while k + 1 <= n // 2 and _coverage(n, k + 1) >= CI_LEVEL:
        k += 1
    return {"n": n, "median": statistics.median(xs), "min": xs[0], "max": xs[-1],
            "ci_low": xs[k - 1], "ci_high": xs[n - k], "ci_level": _coverage(n, k)}


def is_ci95(s: dict | None) -> bool:
    """Whether the summary's interval is a 95% confidence interval."""
    return bool(s) and s["ci_level"] >= CI_LEVEL


def interval(s: dict | None, digits: int = 2, unit: str = "", scale: float = 1.0) -> str:
    """"1.11x [1.02-1.39] (95% CI)" or "1.11x [1.02-1.39] (range of 3)": the median, its
    interval and what kind of interval it is."""
    if not s:
        return "-"
    f = f"{{:.{digits}f}}"
    core = (f"{f.format(s['median'] * scale)}{unit} [{f.format(s['ci_low'] * scale)}-"
            f"{f.format(s['ci_high'] * scale)}]")
    if s["n"] == 1:
        return f"{f.format(s['median'] * scale)}{unit} (1 repetition)"
    kind = "95% CI" if is_ci95(s) else f"range of {s['n']}"
    return f"{core} ({kind})"


def paired_ratios(numerators, denominators) -> list[float]:
    """Ratios of repetition i of one arm to repetition i of another (they ran back to back)."""
    return [
        n / d
        for n, d in zip(numerators, denominators)
        if n is not None and d is not None and d > 0
    ]


def verdict(ratios: dict | None, aim: float, *, at_most: bool = False) -> str | None:
    """A target on a ratio judged by the 95% CI of its median (``summarize``'s), so that
    noise is not read as a result: "met" when the whole interval is on the target's side of
    ``aim`` (>= aim, or <= aim with ``at_most``), "NOT met" when it is wholly on the other
    side, and "not shown" when it straddles ``aim`` or when fewer than 6 repetitions make no
    95% CI (their range, 93.8% for 5, is not one: a target is never called from it)."""
    if not ratios:
        return None
    if not is_ci95(ratios):
        return "not shown"
    low, high = ratios["ci_low"], ratios["ci_high"]
    if at_most:
        low, high, aim = -high, -low, -aim
    if low >= aim:
        return "met"
    return "NOT met" if high < aim else "not shown"


ROLL_OUT_BAR = 1.05  # a change is rolled out when its interval lies above this ratio


def decision(ratio: dict | None, *, ok: bool, bar: float = ROLL_OUT_BAR,
             higher_is_better: bool = True) -> tuple[str, str]:
    """(call, label) for a change measured as a ratio to what it would replace: "roll out"
    only when the whole interval clears ``bar`` and the output was checked correct; the label
    says exactly what was shown ("1.11x [1.02-1.39] (95% CI): faster, not surely by the 5%
    roll-out bar"). ``higher_is_better=False`` for times and memory. ``ok``, the result of the
    check that the change's output equals the baseline's, has no default: a call made without
    a check would say more than was shown."""
    shown = interval(ratio, 2, "x")
    if not ok:
        return "roll back", f"{shown}: its output differs from the baseline's"
    if not ratio or ratio["n"] < 2:
        return "undecided", f"{shown}: one repetition, no interval"
    low, high = ratio["ci_low"], ratio["ci_high"]
    if not higher_is_better:  # a time or a size: 1/x is the speed-up or saving
        low, high = 1.0 / high, 1.0 / low
    better, worse = ("faster", "slower") if higher_is_better else ("lower", "higher")
    pct = f"{bar - 1:.0%}"
    if not is_ci95(ratio):
        seen = (f"{better} in all {ratio['n']} repetitions" if low > 1.0 else
                f"{worse} in all {ratio['n']} repetitions" if high < 1.0 else "no clear difference")
        return "undecided", f"{shown}: {seen}; 6 or more repetitions make a 95% CI to decide on"
    if low > bar:
        return "roll out", f"{shown}: {better}, beyond the {pct} roll-out bar"
    if low > 1.0:
        return "keep the baseline", f"{shown}: {better}, not surely by the {pct} roll-out bar"
    if high < 1.0:
        return "roll back", f"{shown}: {worse}"
    return "keep the baseline", f"{shown}: no difference shown (the interval holds 1)"
