"""The page of fastmm-bench --dataset: its headline figures say what their arm's check showed."""

from __future__ import annotations

from fastmm.bench import ab_page, stats

FASTER = stats.summarize([1.10, 1.12, 1.15, 1.21, 1.25, 1.30])
LOWER = stats.summarize([0.60, 0.65, 0.70, 0.75, 0.80, 0.90])


def _result(ok: bool) -> dict:
    arm = {"ratio": FASTER, "memory_ratio": LOWER, "first_batch_ratio": LOWER,
           "call": "roll out" if ok else "roll back", "correctness": {"ok": ok}}
    return {"arms": {"torch": {"correctness": {"ok": True}}, "fastmm": arm}}


def test_headline_labels_rest_on_the_arms_check():
    checked = ab_page.headline(_result(True))
    assert [h["label"] for h in checked] == [
        "1.18x [1.10-1.30] (95% CI): faster, beyond the 5% roll-out bar",
        "0.72x [0.60-0.90] (95% CI): lower, beyond the 5% roll-out bar",
        "0.72x [0.60-0.90] (95% CI): lower, beyond the 5% roll-out bar"]
    assert [h["call"] for h in checked] == ["roll out", None, None]
    failed = ab_page.headline(_result(False))
    assert [h["label"] for h in failed] == [
        "1.18x [1.10-1.30] (95% CI): its output differs from the baseline's",
        "0.72x [0.60-0.90] (95% CI): its output differs from the baseline's",
        "0.72x [0.60-0.90] (95% CI): its output differs from the baseline's"]
    assert failed[0]["call"] == "roll back"
