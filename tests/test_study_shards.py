"""Study 3 (sharded storage under torchrun) on a tiny corpus."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torchvision")


def test_sharded_storage_study_under_torchrun(tmp_path):
    """Study 3, quick: every layout runs in a real 2-rank torchrun job with equal batch counts."""
    from fastmm.bench import study_shards

    out = tmp_path / "out"
    assert study_shards.main(["--quick", "--out", str(out), "--cache-dir",
                              str(tmp_path / "cache"), "--work-dir", str(tmp_path)]) == 0
    result = json.loads((out / "shards.json").read_text())
    assert set(result["results"]) == {"files / world 2", "shards-300kB / world 2",
                                      "shards-2MB / world 2", "staged / world 2"}
    for name, r in result["results"].items():
        assert r["equal_batches"], name
        assert r["reps"] == 2 and r["per_rank_samples_per_s"]["n"] == 2
        assert r["batches_per_epoch"] == 3  # 48 images over 2 ranks, batches of 8
        assert r["per_rank_samples_per_s"]["median"] > 0
        assert 0 < r["slowest_over_fastest"]["median"] <= 1
        assert r["vs_files"]["n"] == 2  # paired with files round by round
    files = result["results"]["files / world 2"]["vs_files"]
    assert files["min"] == files["max"] == 1.0
    assert result["results"]["staged / world 2"]["staging_s"]["median"] >= 0
    assert result["process_ready_s"]["world 2"] > 0  # one job per world size: started once
    table = (out / "shards.md").read_text()
    assert "vs files" in table and "1.00x [1.00-1.00]" in table and " s at world 2 " in table
