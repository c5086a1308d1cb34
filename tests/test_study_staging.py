"""Study 1 (NVMe staging) on a tiny corpus: the throttle is real, staging is charged, both arms
deliver the same bytes, and the break-even follows from the measured times."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("torchvision")

from fastmm.bench import study_staging  # noqa: E402


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


def test_staging_study_end_to_end(tmp_path):
    out = tmp_path / "out"
    assert study_staging.main(["--quick", "--out", str(out), "--cache-dir", str(tmp_path / "c"),
                               "--work-dir", str(tmp_path)]) == 0
    result = json.loads((out / "staging.json").read_text())
    assert result["correctness"]["ok"]
    assert len(result["reps"]) == 5
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
    assert "break-even" in (out / "staging.md").read_text()
