"""Study 1 (NVMe staging) on a tiny corpus: the throttle is real, staging is charged, both arms
deliver the same bytes, and the break-even follows from the measured times."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("torchvision")

from fastmm.bench import stats, study_staging  # noqa: E402
from _browser import render  # noqa: E402

CALLS = {"roll out", "keep the baseline", "roll back", "undecided"}


def test_throttled_server_holds_its_rate(tmp_path):
    (tmp_path / "blob").write_bytes(b"x" * 2_000_000)
    server = study_staging.ThrottledServer(str(tmp_path), bytes_per_s=4e6, latency_s=0.0)
    try:
        import urllib.request

        t0 = time.perf_counter()
        data = urllib.request.urlopen(server.url + "/blob").read()
        elapsed = time.perf_counter() - t0
    finally:
        server.close()
    assert len(data) == 2_000_000
    assert 0.45 <= elapsed <= 1.5  # 2 MB at 4 MB/s


@pytest.mark.slow
def test_staging_study_end_to_end(tmp_path):
    out = tmp_path / "out"
    assert study_staging.main(["--quick", "--out", str(out), "--cache-dir", str(tmp_path / "c"),
                               "--work-dir", str(tmp_path)]) == 0
    result = json.loads((out / "staging.json").read_text())
    assert result["correctness"]["ok"]
    assert len(result["reps"]) == 6  # the fewest that give a 95% CI
    data_bytes = result["data"]["bytes"]
    for rep in result["reps"]:
        cost = rep["staging_cost"]
        assert cost["bytes"] >= data_bytes and cost["files"] >= result["data"]["images"]
        # reading in place cannot beat the server's bandwidth
        assert rep["in_place"]["seconds"] >= data_bytes / (result["slow_storage"]["mb_per_s"] * 1e6)
    be = result["break_even_epochs"]
    inp = result["reps"][0]["in_place"]["seconds"]
    cold = result["reps"][0]["staged_cold"]["seconds"]
    if inp > cold:
        assert be["n"] >= 1
    # the finding: its call is stats.decision's on the paired ratio, its label the interval
    finding, ratio = result["finding"], result["staged_over_in_place_throughput"]
    assert (finding["call"], finding["label"]) == stats.decision(ratio, ok=True)
    assert finding["call"] in CALLS and stats.interval(ratio, 2, "x") in finding["label"]
    assert "(95% CI)" in finding["label"] and stats.interval(ratio, 2, "x") in finding["text"]
    assert all(0 <= r["other_processes_cpu_cores"] for r in result["reps"])
    busy_arms = [any(c > 0.25 for c in cores) for cores in (
        [r["other_processes_cpu_cores"] for r in result["reps"]],
        result["object_store"]["other_processes_cpu_cores"])]
    assert len(result["busy"]) == sum(busy_arms)  # one note per busy arm
    md = (out / "staging.md").read_text()
    assert "break-even" in md and finding["text"] in md and "[95% CI]" not in md
    seen = render(out / "report.html")
    assert seen["answer"][:2] == [finding["text"],
                                  f"Call: {finding['call']} ({finding['label']})."]
    assert seen["answer"][2:] == seen["alerts"] == result["busy"]
    assert list(seen["plots"]) == ["break-even", "epoch-times", "break-even-object-store"]
    assert all(w == 1000 and h > 150 for w, h in seen["plots"].values())
    assert seen["tables"] == [1 + len(study_staging.ROWS) + len(study_staging.S3_ROWS)]
    assert seen["external"] == []
    # the object-store arm: same bytes, each shard staged once a repetition, the cap holds
    arm = result["object_store"]
    assert arm["correctness"]["ok"] and len(arm["reps"]) == 6
    cap = arm["store"]["mb_per_s_per_connection"] * 1e6
    for rep in arm["reps"]:
        assert rep["staging_cost"]["bytes"] == arm["data"]["bytes"]
        assert rep["staging_cost"]["files"] == arm["data"]["shards"]
        assert rep["in_place"]["seconds"] >= arm["data"]["bytes"] / (2 * cap)  # 2 workers
    assert study_staging.object_store_finding(arm) in finding["text"]
    # the main job's index leads with the finding and shows the three plots inline
    from fastmm.bench import suite

    (tmp_path / "job").mkdir()
    out.rename(tmp_path / "job" / "staging")
    part = next(p for p in suite.PARTS if p.name == "staging")
    suite.index(str(tmp_path / "job"), [(part, 0, 10.0)], 10.0)
    seen = render(tmp_path / "job" / "index.html")
    assert seen["answer"][0] == (
        f"Study 1: NVMe staging: {finding['text']} Call: {finding['call']} ({finding['label']}).")
    assert list(seen["plots"]) == ["staging-break-even", "staging-epoch-times",
                                  "staging-break-even-object-store"]
    assert all(w == 1000 and h > 150 for w, h in seen["plots"].values())
