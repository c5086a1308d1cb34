"""stats.decision, the roll-out rule every part's call comes from, on intervals made to be known:
six repetitions make a 95% CI that is their range (coverage 96.9%), fewer are only a range."""

from __future__ import annotations

import pytest

from fastmm.bench import stats

SIX = 0.96875  # 1 - 2 / 2**6: the coverage of six repetitions' range


def ratio(*values: float) -> dict:
    return stats.summarize(values)


def test_six_repetitions_make_a_95_ci_that_is_their_range():
    r = ratio(1.30, 1.06, 1.10, 1.25, 1.15, 1.21)
    assert (r["n"], r["ci_low"], r["ci_high"], r["ci_level"]) == (6, 1.06, 1.30, SIX)
    assert r["median"] == pytest.approx(1.18)


@pytest.mark.parametrize("values, call, said", [
    ((1.06, 1.10, 1.15, 1.21, 1.25, 1.30), "roll out",
     "1.18x [1.06-1.30] (95% CI): faster, beyond the 5% roll-out bar"),
    ((1.02, 1.10, 1.15, 1.21, 1.25, 1.30), "keep the baseline",
     "1.18x [1.02-1.30] (95% CI): faster, not surely by the 5% roll-out bar"),
    ((1.05, 1.10, 1.15, 1.21, 1.25, 1.30), "keep the baseline",  # on the bar is not beyond it
     "1.18x [1.05-1.30] (95% CI): faster, not surely by the 5% roll-out bar"),
    ((0.90, 0.98, 1.00, 1.02, 1.05, 1.10), "keep the baseline",
     "1.01x [0.90-1.10] (95% CI): no difference shown (the interval holds 1)"),
    ((0.80, 0.85, 0.88, 0.90, 0.93, 0.95), "roll back", "0.89x [0.80-0.95] (95% CI): slower"),
])
def test_a_speed_ratio_is_judged_on_its_whole_interval(values, call, said):
    assert stats.decision(ratio(*values), ok=True) == (call, said)


def test_the_bar_is_the_callers():
    r = ratio(1.06, 1.10, 1.15, 1.21, 1.25, 1.30)
    assert stats.decision(r, ok=True, bar=1.10) == (
        "keep the baseline",
        "1.18x [1.06-1.30] (95% CI): faster, not surely by the 10% roll-out bar")


def test_output_that_differs_is_rolled_back_whatever_the_speed():
    assert stats.decision(ratio(1.06, 1.10, 1.15, 1.21, 1.25, 1.30), ok=False) == (
        "roll back", "1.18x [1.06-1.30] (95% CI): its output differs from the baseline's")
    assert stats.decision(ratio(1.5, 1.6), ok=False) == (
        "roll back", "1.55x [1.50-1.60] (range of 2): its output differs from the baseline's")


def test_ok_must_be_given():
    with pytest.raises(TypeError, match="ok"):
        stats.decision(ratio(1.06, 1.10, 1.15, 1.21, 1.25, 1.30))


@pytest.mark.parametrize("values, said", [
    ((1.10, 1.12, 1.15, 1.20, 1.30),
     "1.15x [1.10-1.30] (range of 5): faster in all 5 repetitions; 6 or more repetitions make "
     "a 95% CI to decide on"),
    ((0.80, 0.90, 0.95),
     "0.90x [0.80-0.95] (range of 3): slower in all 3 repetitions; 6 or more repetitions make a "
     "95% CI to decide on"),
    ((0.90, 1.20),
     "1.05x [0.90-1.20] (range of 2): no clear difference; 6 or more repetitions make a 95% CI "
     "to decide on"),
    ((1.40,), "1.40x (1 repetition): one repetition, no interval"),
])
def test_fewer_than_six_repetitions_are_undecided(values, said):
    assert stats.decision(ratio(*values), ok=True) == ("undecided", said)


def test_nothing_measured_is_undecided():
    assert stats.decision(None, ok=True) == ("undecided", "-: one repetition, no interval")


@pytest.mark.parametrize("values, call, said", [
    # times or memory: lower is better, and 1/x is the saving
    ((0.60, 0.65, 0.70, 0.75, 0.80, 0.90), "roll out",
     "0.72x [0.60-0.90] (95% CI): lower, beyond the 5% roll-out bar"),
    # the median (0.82x) is far below 1/1.05, but the interval reaches 0.98x: not surely 5% lower
    ((0.70, 0.75, 0.80, 0.85, 0.90, 0.98), "keep the baseline",
     "0.82x [0.70-0.98] (95% CI): lower, not surely by the 5% roll-out bar"),
    ((0.70, 0.75, 0.80, 0.85, 0.90, 1.05), "keep the baseline",
     "0.82x [0.70-1.05] (95% CI): no difference shown (the interval holds 1)"),
    ((1.05, 1.10, 1.15, 1.21, 1.25, 1.40), "roll back",
     "1.18x [1.05-1.40] (95% CI): higher"),
])
def test_a_time_or_memory_ratio_is_judged_on_its_interval_not_its_median(values, call, said):
    assert stats.decision(ratio(*values), ok=True, higher_is_better=False) == (call, said)


def test_fewer_than_six_lower_ratios_say_lower_not_faster():
    assert stats.decision(ratio(0.5, 0.6, 0.7), ok=True, higher_is_better=False) == (
        "undecided", "0.60x [0.50-0.70] (range of 3): lower in all 3 repetitions; 6 or more "
        "repetitions make a 95% CI to decide on")


def _arm(speed, memory) -> dict:
    return {"ratio": ratio(*speed), "memory_ratio": memory and ratio(*memory),
            "correctness": {"ok": True}}


FASTER = (1.20, 1.22, 1.25, 1.28, 1.30, 1.35)


@pytest.mark.parametrize("memory, call, said", [
    ((1.00, 1.02, 1.03, 1.05, 1.08, 1.10), "roll out", "beyond the 5% roll-out bar"),
    # the median (1.04x) is under the 1.10x bar, the interval is not: not shown, no roll-out
    ((0.98, 1.02, 1.03, 1.05, 1.08, 1.30), "keep the baseline",
     "but it holds 1.04x [0.98-1.30] (95% CI) the host memory: not shown within the 1.10x bar"),
    (None, "keep the baseline", "but its host memory was not measured"),
])
def test_a_faster_arm_rolls_out_only_within_the_memory_bar_on_its_interval(memory, call, said):
    from fastmm.bench.ab import decide

    got_call, label = decide(_arm(FASTER, memory))
    assert got_call == call and said in label
