"""Smoke test of fastmm-bench: a tiny run of the CLI, with exact checks on the JSON it writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torchvision")
pytest.importorskip("PIL")

from fastmm.bench import harness, stats  # noqa: E402

ENV_KEYS = {
    "timestamp_utc", "command", "argv", "cwd", "python", "python_implementation", "platform",
    "kernel", "versions", "fastmm_uses_cpp", "fastmm_transport", "cpu_model", "cpu_count_logical",
    "cpu_count_usable", "ram_total_bytes", "ram_available_bytes_at_start", "dev_shm", "slab_dir",
    "torch_num_threads", "multiprocessing_start_method", "loadavg_at_start", "git", "loadavg_at_end",
}
WINDOW_KEYS = {
    "phase", "rep", "order", "started_unix_s", "first_batch_s", "warm_batches", "batches",
    "samples", "bytes", "window_s", "samples_per_s", "bytes_per_s", "exhausted", "tree_cpu_s",
    "system_busy_s", "other_processes_cpu_cores", "loadavg_1m_at_start",
}
LOADER_KEYS = WINDOW_KEYS | {
    "teardown_s", "workers_alive_after_teardown", "workers_alive_before_start", "first_batch_crc32",
}
MEMORY_KEYS = LOADER_KEYS | {
    "peak_total_pss_bytes", "main_pss_bytes_at_peak", "workers_pss_bytes_at_peak", "pss_sweeps",
    "pss_sweep_mean_s", "pss_sampler_cpu_s", "pss_processes_seen", "baseline_pss_bytes",
}
ARM_SUMMARY_KEYS = {
    "samples_per_s", "bytes_per_s", "first_batch_s", "teardown_s", "window_s", "cpu_ms_per_sample",
    "other_processes_cpu_cores", "peak_total_pss_bytes", "peak_pss_over_baseline_bytes",
    "samples_per_s_with_pss_sampler",
}
STAT_KEYS = {"n", "median", "min", "max", "ci95_low", "ci95_high"}

BATCH = 32
WORKERS = 2
DECODE_BATCH = 4
CLIP = (2, 3, 32, 32)  # 6 KiB a sample, 192 KiB a batch: big enough to travel in slabs


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out")
    cache = tmp_path_factory.mktemp("bench-cache")
    argv = [
        "--quick", "--reps", "2", "--mem-reps", "1", "--min-seconds", "0.2",
        "--warmup-seconds", "0.05", "--clip-shape", ",".join(map(str, CLIP)),
        "--num-images", "6", "--decode-batch-sizes", str(DECODE_BATCH),
        "--cache-dir", str(cache), "--out", str(out),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "fastmm.bench", *argv], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return argv, out, proc


@pytest.mark.slow
def test_cli_writes_results_json(run):
    argv, out, proc = run
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"format", "environment", "settings", "method", "cases", "total_s"}
    assert results["format"] == 1

    env = results["environment"]
    assert set(env) == ENV_KEYS
    assert env["argv"][1:] == argv
    assert set(env["versions"]) == {"fastmm", "torch", "torchvision", "numpy", "pillow", "psutil"}
    assert set(env["git"]) == {"repo", "commit", "dirty", "changed_files"}
    assert set(env["dev_shm"]) == {"path", "total_bytes", "free_bytes"}
    assert isinstance(env["fastmm_uses_cpp"], bool)

    settings = results["settings"]
    assert settings["reps"] == 2 and settings["mem_reps"] == 1
    assert settings["clip_modes"] == ["view"] and settings["decode_batch_sizes"] == [DECODE_BATCH]

    cases = {c["name"]: c for c in results["cases"]}
    assert list(cases) == ["transport-view-b32", f"decode-b{DECODE_BATCH}"]
    expected_arms = {
        "transport-view-b32": ["torch", "fastmm", "single-process", "single-reuse", "crc-alone"],
        f"decode-b{DECODE_BATCH}": ["torch", "fastmm", "getitem-1-thread"],
    }
    for name, case in cases.items():
        order = []
        assert list(case["arms"]) == expected_arms[name]
        batch = BATCH if name.startswith("transport") else DECODE_BATCH
        assert case["batch_size"] == batch and case["num_workers"] == WORKERS
        for arm_name, arm in case["arms"].items():
            reps = arm["reps"]
            order += [r["order"] for r in reps]
            if arm["kind"] == "loader":
                assert [r["phase"] for r in reps] == ["warmup", "timed", "timed", "memory"]
                for r in reps:
                    assert set(r) == (MEMORY_KEYS if r["phase"] == "memory" else LOADER_KEYS)
                    assert r["warm_batches"] == WORKERS
                    assert r["batches"] % WORKERS == 0 and r["batches"] > 0
                    assert r["workers_alive_after_teardown"] == 0
                    assert r["first_batch_s"] > 0
                mem = reps[-1]
                assert mem["pss_processes_seen"] == 1 + WORKERS
                assert mem["peak_total_pss_bytes"] == mem["main_pss_bytes_at_peak"] + mem["workers_pss_bytes_at_peak"]
                assert mem["peak_total_pss_bytes"] > 0 and mem["pss_sweeps"] >= 1
            else:
                assert arm["kind"] == "reference"
                assert [r["phase"] for r in reps] == ["warmup", "timed", "timed"]
                for r in reps:
                    keys = WINDOW_KEYS | ({"first_batch_crc32"} if arm_name.startswith("single") else set())
                    assert set(r) == keys
            for r in reps:
                assert r["exhausted"] is False
                assert r["window_s"] >= (0.2 if r["phase"] != "warmup" else 0.05)
                per_item = 1 if arm_name == "getitem-1-thread" else batch
                assert r["samples"] == r["batches"] * per_item
                assert r["samples_per_s"] == pytest.approx(r["samples"] / r["window_s"])
                if name.startswith("transport"):
                    assert r["bytes"] == r["samples"] * 2 * 3 * 32 * 32
            assert [r["rep"] for r in reps if r["phase"] == "timed"] == [0, 1]

        summary = case["summary"]
        assert set(summary) == {
            "arms", "ratio_fastmm_over_torch", "paired_ratios_fastmm_over_torch", "target",
            "other_processes_cpu_cores_max", "busy_timed_reps", "timed_reps", "discarded_busy_reps",
        } | ({"first_batch_identical", "ceiling"} if name.startswith("transport") else {"decode_limit"})
        assert summary["timed_reps"] == 2 * len(expected_arms[name])
        assert summary["discarded_busy_reps"] == 0  # no --wait-quiet: nothing is redone
        assert set(summary["arms"]) == set(expected_arms[name])
        for arm_summary in summary["arms"].values():
            assert set(arm_summary) == ARM_SUMMARY_KEYS
            assert set(arm_summary["samples_per_s"]) == STAT_KEYS
            assert arm_summary["samples_per_s"]["n"] == 2
        assert summary["arms"]["torch"]["peak_total_pss_bytes"]["n"] == 1
        assert summary["arms"]["crc-alone" if name.startswith("transport") else "getitem-1-thread"][
            "peak_total_pss_bytes"
        ] is None
        torch_med = summary["arms"]["torch"]["samples_per_s"]["median"]
        fastmm_med = summary["arms"]["fastmm"]["samples_per_s"]["median"]
        assert summary["ratio_fastmm_over_torch"] == pytest.approx(fastmm_med / torch_med)
        assert set(summary["target"]) == {"description", "ratio", "met"}
        if name.startswith("transport"):
            assert summary["first_batch_identical"] is True
            ceiling = summary["ceiling"]
            assert set(ceiling) == {
                "crc_alone_samples_per_s", "single_process_samples_per_s", "single_reuse_samples_per_s",
                "cores", "cores_x_single_process_samples_per_s", "cores_x_single_reuse_samples_per_s",
                "torch_fraction_of_ceiling", "fastmm_fraction_of_ceiling",
                "highest_possible_ratio_over_torch",
            }
            assert ceiling["crc_alone_samples_per_s"] == summary["arms"]["crc-alone"]["samples_per_s"]["median"]
            assert ceiling["highest_possible_ratio_over_torch"] == pytest.approx(
                ceiling["crc_alone_samples_per_s"] / torch_med
            )
            assert summary["target"]["ratio"] == 3.0
        else:
            limit = summary["decode_limit"]
            assert limit["limit_samples_per_s"] == pytest.approx(
                limit["cores"] * summary["arms"]["getitem-1-thread"]["samples_per_s"]["median"]
            )
            assert summary["target"]["ratio"] == 1.0
        # Every repetition of a case has its own place in the case's run order: none lost.
        assert sorted(order) == list(range(len(order)))
    transport = cases["transport-view-b32"]["arms"]
    timed_orders = [
        [r["order"] for r in transport[a]["reps"] if r["phase"] == "timed"] for a in ("torch", "fastmm")
    ]
    assert all(t < f for t, f in zip(*timed_orders))  # torch then fastmm, rep by rep


@pytest.mark.slow
def test_cli_prints_table_and_writes_markdown(run):
    _, out, proc = run
    assert "samples/s median [min-max]" in proc.stdout
    assert "fastmm/torch =" in proc.stdout
    # One progress line on stderr per repetition: 2 loaders x 4 + 3 references x 3, then 2 x 4 + 1 x 3.
    progress = [line for line in proc.stderr.splitlines() if line.startswith("[")]
    assert len(progress) == (2 * 4 + 3 * 3) + (2 * 4 + 1 * 3)
    summary = (out / "summary.md").read_text()
    assert "## transport-view-b32" in summary and f"## decode-b{DECODE_BATCH}" in summary


def test_summarize_exact():
    s = stats.summarize([3.0, None, 1.0, 2.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (3, 2.0, 1.0, 3.0)
    assert 1.0 <= s["ci95_low"] <= s["median"] <= s["ci95_high"] <= 3.0
    assert stats.summarize([None]) is None
    assert stats.summarize([5.0]) == {"n": 1, "median": 5.0, "min": 5.0, "max": 5.0,
                                      "ci95_low": 5.0, "ci95_high": 5.0}
    assert stats.paired_ratios([2.0, None, 9.0], [1.0, 1.0, 3.0]) == [2.0, 3.0]


def test_wait_for_quiet_reports_what_it_saw():
    quiet = harness.wait_for_quiet(max_wait_s=0.1, threshold_cores=1e9, probe_s=0.05)
    assert quiet["quiet_wait_s"] == pytest.approx(0.05)
    assert quiet["quiet_before_start"] is True
    assert quiet["other_processes_cpu_cores_before_start"] >= 0.0
