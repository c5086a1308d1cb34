"""Study 3 (sharded storage under torchrun) on a tiny corpus."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torchvision")


@pytest.mark.slow
def test_sharded_storage_study_under_torchrun(tmp_path):
    """Study 3, quick: every layout runs in a real 2-rank torchrun job, and in one of two node
    launches with a rank each, with equal batch counts; each node stages each object once; its
    page shows the finding and both plots."""
    from _browser import render

    from fastmm.bench import stats, study_shards

    out = tmp_path / "out"
    assert study_shards.main(["--quick", "--out", str(out), "--cache-dir",
                              str(tmp_path / "cache"), "--work-dir", str(tmp_path)]) == 0
    result = json.loads((out / "shards.json").read_text())
    layouts = ("files", "shards-300kB", "shards-2MB", "s3", "staged")
    configs = ("world 2", "world 2, 2 nodes")
    assert list(result["results"]) == [f"{name} / {c}" for c in configs for name in layouts]
    for name, r in result["results"].items():
        assert r["equal_batches"], name
        assert r["reps"] == 2 and r["per_rank_samples_per_s"]["n"] == 2
        assert r["batches_per_epoch"] == 3  # 48 images over 2 ranks, batches of 8
        assert r["per_rank_samples_per_s"]["median"] > 0
        assert 0 < r["slowest_over_fastest"]["median"] <= 1
        assert r["vs_files"]["n"] == 2  # paired with files round by round
    files = result["results"]["files / world 2"]["vs_files"]
    assert files["min"] == files["max"] == 1.0
    for c in configs:
        staged = result["results"][f"staged / {c}"]
        assert staged["staging_s"]["median"] >= 0 and staged["staged_once_per_node"]
        assert result["process_ready_s"][c] > 0  # one job per configuration: started once
    table = (out / "shards.md").read_text()
    assert "vs files" in table and "1.00x [1.00-1.00] (range of 2)" in table
    assert " s at world 2, " in table and " s at world 2, 2 nodes from process start" in table
    assert "[95% CI]" not in table
    # the call: stats.decision's on the first shard layout at the largest world size; with
    # 2 repetitions there is no 95% CI, so it cannot be more than "undecided"
    finding, top = result["finding"], result["results"]["shards-300kB / world 2"]
    assert (finding["call"], finding["label"]) == (
        "undecided", "shards-300kB / world 2: " + stats.decision(top["vs_files"])[1])
    assert stats.interval(top["vs_files"], 2, "x") in finding["label"]
    assert all(f"{k} {stats.interval(result['results'][f'{k} / {c}']['vs_files'], 2, 'x')}"
               in finding["text"] for k in layouts[1:] for c in configs)
    assert isinstance(result["busy"], list)
    seen = render(out / "report.html")
    assert seen["answer"][:2] == [finding["text"],
                                  f"Call: {finding['call']} ({finding['label']})."]
    assert seen["answer"][2:] == seen["alerts"] == result["busy"]
    assert list(seen["plots"]) == ["per-rank-rates", "vs-files"]
    assert all(w == 1000 and h > 150 for w, h in seen["plots"].values())
    assert seen["tables"] == [1 + 10] and seen["external"] == []
