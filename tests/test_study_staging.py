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


@pytest.mark.slow  # a spawned process imports torch: seconds
def test_the_server_runs_in_a_process_of_its_own(tmp_path):
    """Not threads of the measuring process (they would take the loop's GIL): a child of the
    study, whose CPU the busy meter counts as the study's own and which the study can read."""
    import os
    import urllib.request

    import psutil

    (tmp_path / "blob").write_bytes(b"y" * 1_000_000)
    with study_staging.ServerProcess(study_staging.files_server, str(tmp_path), 4e6, 0.0) as server:
        assert server.process.pid != os.getpid()
        assert server.process.pid in {c.pid for c in psutil.Process().children(recursive=True)}
        t0 = time.perf_counter()
        data = urllib.request.urlopen(server.serving.url + "/blob").read()
        assert data == b"y" * 1_000_000 and time.perf_counter() - t0 >= 0.2  # 1 MB at 4 MB/s
        assert server.serving.env == {} and server.cpu_s() > 0
    assert not server.process.is_alive()


def _ratio(n):
    return stats.summarize([1.5] * n)


def test_the_finding_says_how_many_repetitions_staging_paid_in():
    staging = stats.summarize([2.0] * 6)
    assert study_staging.pays_for_itself(_ratio(6), stats.summarize([4.0] * 6), staging) == (
        "Staging took 2.0 s [2.0-2.0] (95% CI), so it pays for itself after 4.0 epochs "
        "[4.0-4.0] (95% CI).")
    # one repetition not faster: not "does not pay for itself"
    assert study_staging.pays_for_itself(_ratio(6), stats.summarize([4.0] * 5), staging) == (
        "The staged copy was read faster in 5 of the 6 repetitions only, so whether staging "
        "pays for itself is not shown (in those 5: after 4.0 epochs [4.0-4.0] (range of 5)).")
    assert study_staging.pays_for_itself(_ratio(6), None, staging) == (
        "The staged copy was read no faster in any of the 6 repetitions: staging did not pay "
        "for itself in them.")


def test_epochs_without_batches_are_not_the_same_bytes():
    def rep(digest, samples):
        epoch = {"digest": digest, "samples": samples}
        return dict.fromkeys(study_staging.EPOCHS, epoch)

    assert study_staging.same_bytes([rep("0badf00d", 48), rep("0badf00d", 48)])
    assert not study_staging.same_bytes([rep("0badf00d", 48), rep("0badf00e", 48)])
    assert not study_staging.same_bytes([rep("00000000", 0), rep("00000000", 0)])


@pytest.mark.slow
def test_staging_study_end_to_end(tmp_path):
    out = tmp_path / "out"
    assert study_staging.main(["--quick", "--out", str(out), "--cache-dir", str(tmp_path / "c"),
                               "--work-dir", str(tmp_path)]) == 0
    result = json.loads((out / "staging.json").read_text())
    assert result["correctness"]["ok"]
    assert len(result["reps"]) == 6  # the fewest that give a 95% CI
    # each repetition starts with the arm the last one ran second
    orders = [["in place", "staged"], ["staged", "in place"]] * 3
    assert [r["order"] for r in result["reps"]] == orders
    assert [r["order"] for r in result["object_store"]["reps"]] == orders
    assert all(r["server_cpu_s"] > 0 for r in result["reps"] + result["object_store"]["reps"])
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
