"""Smoke test of fastmm-bench: a tiny run of the CLI, with exact checks on the JSON it writes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
import torch

pytest.importorskip("torchvision")
pytest.importorskip("PIL")

from fastmm.bench import cli, harness, stats, workloads  # noqa: E402

ENV_KEYS = {
    "timestamp_utc", "command", "argv", "cwd", "python", "python_implementation", "platform",
    "kernel", "versions", "fastmm_uses_cpp", "fastmm_transport", "cpu_model", "cpu_count_logical",
    "cpu_count_usable", "cgroup_cpu_quota_cores", "ram_total_bytes",
    "ram_available_bytes_at_start", "dev_shm", "slab_dir",
    "torch_num_threads", "multiprocessing_start_method", "loadavg_at_start", "git", "loadavg_at_end",
    "fastmm_env", "numa_nodes", "gpus", "storage", "network", "loader_config",
    "training_code_git",
}
WINDOW_KEYS = {
    "phase", "rep", "order", "started_unix_s", "first_batch_s", "warm_batches", "batches",
    "samples", "bytes", "window_s", "samples_per_s", "bytes_per_s", "exhausted", "tree_cpu_s",
    "system_busy_s", "other_processes_cpu_cores", "loadavg_1m_at_start",
}
LOADER_KEYS = WINDOW_KEYS | {
    "teardown_s", "workers_alive_after_teardown", "workers_alive_before_start", "digests",
    "fetch_wait_s",
}
MEMORY_KEYS = LOADER_KEYS | {
    "peak_total_pss_bytes", "main_pss_bytes_at_peak", "workers_pss_bytes_at_peak", "pss_sweeps",
    "pss_sweep_mean_s", "pss_sampler_cpu_s", "pss_processes_seen", "baseline_pss_bytes",
    "peak_shmem_bytes", "baseline_shmem_bytes", "pss_max_duty", "peak_host_held_bytes",
}
PACED_KEYS = MEMORY_KEYS | {"pace_step_s"}
ARM_SUMMARY_KEYS = {
    "samples_per_s", "bytes_per_s", "first_batch_s", "teardown_s", "window_s", "cpu_ms_per_sample",
    "other_processes_cpu_cores", "peak_total_pss_bytes", "peak_pss_over_baseline_bytes",
    "peak_shmem_over_baseline_bytes", "samples_per_s_with_pss_sampler", "paced_peak_total_pss_bytes",
    "paced_peak_pss_over_baseline_bytes", "paced_peak_shmem_over_baseline_bytes",
    "paced_samples_per_s", "paced_fetch_wait_s", "peak_host_held_bytes",
    "paced_peak_host_held_bytes",
}
MEMORY_CONDITION_KEYS = {
    "torch_samples_per_s", "fastmm_samples_per_s", "torch_peak_total_pss_bytes",
    "fastmm_peak_total_pss_bytes", "torch_peak_pss_over_baseline_bytes",
    "fastmm_peak_pss_over_baseline_bytes", "ratio_over_baseline_fastmm_over_torch",
    "paired_ratios_over_baseline", "verdict", "verdict_on_total", "verdict_on_pss",
    "torch_peak_shmem_over_baseline_bytes", "fastmm_peak_shmem_over_baseline_bytes",
    "torch_host_held_bytes", "fastmm_host_held_bytes", "paired_ratios_host_held",
}
STAT_KEYS = {"n", "median", "min", "max", "ci_low", "ci_high", "ci_level"}

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
    assert results["format"] == 3

    env = results["environment"]
    assert set(env) == ENV_KEYS
    assert env["argv"] == ["python", "-m", "fastmm.bench", *argv]  # a command that runs it again
    assert set(env["versions"]) == {
        "fastmm", "torch", "torchvision", "torchcodec", "dali", "webdataset", "spdl",
        "mosaicml_streaming", "av", "numpy",
        "pillow", "scikit_image", "psutil", "nvidia_ml_py", "cuda", "libjpeg_turbo", "ffmpeg"}
    assert set(env["git"]) == {"repo", "commit", "dirty", "changed_files"}
    assert set(env["dev_shm"]) == {"path", "total_bytes", "free_bytes"}
    assert isinstance(env["fastmm_uses_cpp"], bool)

    settings = results["settings"]
    assert settings["reps"] == 2 and settings["mem_reps"] == 1
    assert settings["consume"] == "sum64" and settings["pace_factor"] == 1.5
    assert results["method"]["consumer"].startswith("sum64:")
    assert settings["clip_modes"] == ["view"] and settings["decode_batch_sizes"] == [DECODE_BATCH]

    cases = {c["name"]: c for c in results["cases"]}
    assert list(cases) == ["transport-view-b32", f"decode-b{DECODE_BATCH}"]
    expected_arms = {
        "transport-view-b32": ["torch", "fastmm", "single-process", "single-reuse", "consume-alone"],
        f"decode-b{DECODE_BATCH}": ["torch", "fastmm", "getitem-1-thread"],
    }
    for name, case in cases.items():
        order = []
        assert list(case["arms"]) == expected_arms[name]
        batch = BATCH if name.startswith("transport") else DECODE_BATCH
        assert case["batch_size"] == batch and case["num_workers"] == WORKERS
        assert "loop: sum64 over" in case["description"]
        step_s = case["summary"]["memory"]["paced_step_s"]
        assert step_s == pytest.approx(
            1.5 * batch / case["summary"]["arms"]["torch"]["samples_per_s"]["median"]
        )
        for arm_name, arm in case["arms"].items():
            reps = arm["reps"]
            order += [r["order"] for r in reps]
            if arm["kind"] == "loader":
                assert [r["phase"] for r in reps] == ["warmup", "timed", "timed", "memory", "memory-paced"]
                for r in reps:
                    keys = {"memory": MEMORY_KEYS, "memory-paced": PACED_KEYS}.get(r["phase"], LOADER_KEYS)
                    assert set(r) == keys
                    assert r["fetch_wait_s"] <= r["window_s"]
                    assert r["warm_batches"] == WORKERS
                    assert r["batches"] % WORKERS == 0 and r["batches"] > 0
                    assert r["workers_alive_after_teardown"] == 0
                    assert r["first_batch_s"] > 0
                    # the warm-up (the check) digests every batch it consumed, the others their first
                    assert len(r["digests"]) == (r["warm_batches"] + r["batches"]
                                                 if r["phase"] == "warmup" else 1)
                for mem in reps[-2:]:
                    assert mem["pss_processes_seen"] == 1 + WORKERS
                    assert mem["peak_total_pss_bytes"] == mem["main_pss_bytes_at_peak"] + mem["workers_pss_bytes_at_peak"]
                    assert mem["peak_total_pss_bytes"] > 0 and mem["pss_sweeps"] >= 1
                    assert mem["peak_shmem_bytes"] >= 0 and mem["baseline_shmem_bytes"] >= 0
                paced = reps[-1]
                assert paced["pace_step_s"] == step_s
                assert reps[-2]["pss_max_duty"] is None and paced["pss_max_duty"] == 0.2
                # One step per tick of step_s: the paced loop does not run faster than the pace.
                assert paced["samples_per_s"] <= batch / step_s * 1.1
            else:
                assert arm["kind"] == "reference"
                assert [r["phase"] for r in reps] == ["warmup", "timed", "timed"]
                for r in reps:
                    keys = WINDOW_KEYS | ({"digests"} if arm_name.startswith("single") else set())
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
            "check", "memory", "busy_memory_reps",
        } | ({"ceiling"} if name.startswith("transport") else {"decode_limit"})
        assert summary["timed_reps"] == 2 * len(expected_arms[name])
        assert summary["discarded_busy_reps"] == 0  # no --wait-quiet: nothing is redone
        assert set(summary["arms"]) == set(expected_arms[name])
        for arm_summary in summary["arms"].values():
            assert set(arm_summary) == ARM_SUMMARY_KEYS
            assert set(arm_summary["samples_per_s"]) == STAT_KEYS
            assert arm_summary["samples_per_s"]["n"] == 2
        assert summary["arms"]["torch"]["peak_total_pss_bytes"]["n"] == 1
        assert summary["arms"]["torch"]["paced_peak_total_pss_bytes"]["n"] == 1
        reference = summary["arms"]["consume-alone" if name.startswith("transport") else "getitem-1-thread"]
        assert reference["peak_total_pss_bytes"] is None and reference["paced_peak_total_pss_bytes"] is None
        memory = summary["memory"]
        assert set(memory) == {
            "target", "max_throughput", "paced", "pace_factor", "kept_pace_fraction",
            "paced_step_s", "paced_target_samples_per_s", "kept_pace",
        }
        assert memory["paced_target_samples_per_s"] == pytest.approx(batch / step_s)
        assert set(memory["kept_pace"]) == {"torch", "fastmm"}
        for condition, prefix in (("max_throughput", ""), ("paced", "paced_")):
            c = memory[condition]
            assert set(c) == MEMORY_CONDITION_KEYS | ({"conclusive"} if condition == "paced" else set())
            t = summary["arms"]["torch"][prefix + "peak_pss_over_baseline_bytes"]["median"]
            f = summary["arms"]["fastmm"][prefix + "peak_pss_over_baseline_bytes"]["median"]
            assert (c["torch_peak_pss_over_baseline_bytes"], c["fastmm_peak_pss_over_baseline_bytes"]) == (t, f)
            ratios = c["paired_ratios_over_baseline"]
            assert c["verdict_on_pss"] == stats.verdict(ratios, 1.0, at_most=True)
            if ratios["n"] == 1:  # one round makes no 95% CI: no call
                assert c["verdict_on_pss"] == "not shown"
            # the target: host memory held, the loaders' Pss_Anon + Shmem over idle
            t_held = summary["arms"]["torch"][prefix + "peak_host_held_bytes"]["median"]
            f_held = summary["arms"]["fastmm"][prefix + "peak_host_held_bytes"]["median"]
            assert (c["torch_host_held_bytes"], c["fastmm_host_held_bytes"]) == (t_held, f_held)
            assert 0 < t_held and 0 < f_held
            assert c["verdict"] == stats.verdict(c["paired_ratios_host_held"], 1.0, at_most=True)
            if c["paired_ratios_host_held"]["n"] == 1:
                assert c["verdict"] == "not shown"
            if condition == "paced":
                assert c["conclusive"] == all(memory["kept_pace"].values())
            if t > 0:
                assert c["ratio_over_baseline_fastmm_over_torch"] == pytest.approx(f / t)
        # Same batches from both loaders: deterministic clips, and the same seed before every
        # loader for the decode case's random crops. Every batch of the warm-ups compared.
        warm = {n: case["arms"][n]["reps"][0] for n in ("torch", "fastmm")}
        assert summary["check"] == {
            "batches_compared": min(len(w["digests"]) for w in warm.values()),
            "first_difference": None, "repetitions_first_batch": 2 * 4,
            "repetitions_first_batch_differs": 0, "ok": True}
        assert summary["check"]["batches_compared"] >= 2 * WORKERS
        first = warm["torch"]["digests"][0]
        torch_med = summary["arms"]["torch"]["samples_per_s"]["median"]
        fastmm_med = summary["arms"]["fastmm"]["samples_per_s"]["median"]
        assert summary["ratio_fastmm_over_torch"] == pytest.approx(fastmm_med / torch_med)
        assert set(summary["target"]) == {"description", "ratio", "verdict"}
        assert summary["target"]["verdict"] == stats.verdict(
            summary["paired_ratios_fastmm_over_torch"], summary["target"]["ratio"])
        if name.startswith("transport"):
            ceiling = summary["ceiling"]
            assert set(ceiling) == {
                "consume_alone_samples_per_s", "single_process_samples_per_s", "single_reuse_samples_per_s",
                "cores", "cores_x_single_process_samples_per_s", "cores_x_single_reuse_samples_per_s",
                "torch_fraction_of_ceiling", "fastmm_fraction_of_ceiling",
                "highest_possible_ratio_over_torch",
            }
            assert ceiling["consume_alone_samples_per_s"] == summary["arms"]["consume-alone"]["samples_per_s"]["median"]
            assert ceiling["highest_possible_ratio_over_torch"] == pytest.approx(
                ceiling["consume_alone_samples_per_s"] / torch_med
            )
            # The single-process arms read the same deterministic clips: same first batch.
            for arm_name in ("single-process", "single-reuse"):
                assert all(r["digests"] == [first] for r in case["arms"][arm_name]["reps"])
            assert summary["target"]["ratio"] == 3.0
        else:
            limit = summary["decode_limit"]
            assert limit["limit_samples_per_s"] == pytest.approx(
                limit["cores"] * summary["arms"]["getitem-1-thread"]["samples_per_s"]["median"]
            )
            assert summary["target"]["ratio"] == 1.0
        # Every repetition of a case has its own place in the case's run order: none lost.
        assert sorted(order) == list(range(len(order)))
    # each round of timed repetitions starts one arm later: no arm always runs first
    arms = expected_arms["transport-view-b32"]
    transport = cases["transport-view-b32"]["arms"]
    for r in range(2):
        timed = {a: next(x["order"] for x in transport[a]["reps"] if x["phase"] == "timed"
                         and x["rep"] == r) for a in arms}
        assert sorted(timed, key=timed.get) == arms[r:] + arms[:r]


@pytest.mark.slow
def test_cli_prints_table_and_writes_markdown(run):
    _, out, proc = run
    assert "samples/s median [min-max]" in proc.stdout
    assert "fastmm/torch =" in proc.stdout
    # One progress line on stderr per repetition: 2 loaders x 5 + 3 references x 3, then 2 x 5 + 1 x 3.
    progress = [line for line in proc.stderr.splitlines() if line.startswith("[")]
    assert len(progress) == (2 * 5 + 3 * 3) + (2 * 5 + 1 * 3)
    assert sum("paced" in line for line in progress) == 2 * 2
    summary = (out / "summary.md").read_text()
    assert "## transport-view-b32" in summary and f"## decode-b{DECODE_BATCH}" in summary
    assert "sum64" in summary
    for text in (proc.stdout, summary):
        assert text.count("host memory held at full speed:") == 2
        assert text.count("host memory held paced (") == 2
        assert text.count("batches: torch and fastmm agree (") == 2


def test_summarize_exact():
    s = stats.summarize([3.0, None, 1.0, 2.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (3, 2.0, 1.0, 3.0)
    assert (s["ci_low"], s["ci_high"], s["ci_level"]) == (1.0, 3.0, 0.75)  # the range of 3
    assert stats.summarize([None]) is None
    assert stats.summarize([5.0]) == {"n": 1, "median": 5.0, "min": 5.0, "max": 5.0,
                                      "ci_low": 5.0, "ci_high": 5.0, "ci_level": 0.0}
    assert stats.paired_ratios([2.0, None, 9.0], [1.0, 1.0, 3.0]) == [2.0, 3.0]


@pytest.mark.parametrize("n, rank, level", [(5, 1, 0.9375), (6, 1, 0.96875), (8, 1, 0.9921875),
                                            (9, 2, 0.9609375), (12, 3, 0.96142578125)])
def test_the_median_interval_is_the_widest_pair_of_order_statistics_needed_for_95(n, rank, level):
    """Coverage 1 - 2 P(Binomial(n, 1/2) < k) for (x_(k), x_(n+1-k)), k as large as 95% allows
    (the textbook table: n=9 -> k=2, n=12 -> k=3); under 6 repetitions no pair reaches 95%."""
    s = stats.summarize(range(n, 0, -1))  # unsorted on purpose
    assert (s["ci_low"], s["ci_high"], s["ci_level"]) == (rank, n + 1 - rank, level)
    assert stats.is_ci95(s) == (n >= 6)


def test_an_interval_says_what_kind_it_is():
    assert stats.interval(stats.summarize([1.0, 1.2, 1.1]), 2, "x") == "1.10x [1.00-1.20] (range of 3)"
    assert (stats.interval(stats.summarize([1.0, 1.3, 1.1, 1.2, 1.2, 1.1]), 2, "x")
            == "1.15x [1.00-1.30] (95% CI)")
    assert stats.interval(stats.summarize([2.0]), 1, " s") == "2.0 s (1 repetition)"
    assert stats.interval(None) == "-"


def test_a_target_is_judged_by_the_interval_not_the_median():
    """Repetitions that cannot tell a loader from the target say so; a median a hair off the
    target is not a result (the main job printed 'NOT met' for 44 MiB against 44 MiB)."""
    def ratios(low, high):
        return {"n": 6, "median": (low + high) / 2, "min": low, "max": high,
                "ci_low": low, "ci_high": high, "ci_level": 0.96875}

    assert stats.verdict(ratios(1.02, 1.3), 1.0) == "met"
    assert stats.verdict(ratios(0.8, 0.97), 1.0) == "NOT met"
    assert stats.verdict(ratios(0.9, 1.26), 1.0) == "not shown"
    assert stats.verdict(ratios(0.7, 0.95), 1.0, at_most=True) == "met"
    assert stats.verdict(ratios(1.01, 1.2), 1.0, at_most=True) == "NOT met"
    assert stats.verdict(ratios(0.98, 1.03), 1.0, at_most=True) == "not shown"
    assert stats.verdict(None, 1.0) is None


def test_a_target_is_never_called_from_fewer_than_6_repetitions():
    """5 repetitions (fastmm-bench's old default) or 1 (--mem-reps 1) make no 95% CI: the
    range of 5 wholly above the aim, or one value below it, is 'not shown', not met."""
    five = stats.summarize([3.2, 3.4, 3.3, 3.5, 3.6])
    assert stats.interval(five, 2, "x") == "3.40x [3.20-3.60] (range of 5)"
    assert stats.verdict(five, 3.0) == stats.verdict(five, 4.0) == "not shown"
    assert stats.verdict(stats.summarize([1.01]), 1.0, at_most=True) == "not shown"
    six = stats.summarize([3.2, 3.4, 3.3, 3.5, 3.6, 3.1])
    assert (stats.verdict(six, 3.0), stats.verdict(six, 4.0)) == ("met", "NOT met")


def test_a_memory_target_not_met_at_full_speed_names_its_cause():
    from fastmm.bench import report

    def case(verdict, torch_rate, fastmm_rate):
        mib = 2**20
        condition = {
            "ratio_over_baseline_fastmm_over_torch": 2.2, "verdict": verdict,
            "verdict_on_total": verdict, "verdict_on_pss": verdict,
            "paired_ratios_over_baseline": None, "paired_ratios_host_held": None,
            "torch_host_held_bytes": 300 * mib, "fastmm_host_held_bytes": 450 * mib,
            "torch_peak_total_pss_bytes": 900 * mib, "torch_peak_pss_over_baseline_bytes": 200 * mib,
            "fastmm_peak_total_pss_bytes": 1100 * mib,
            "fastmm_peak_pss_over_baseline_bytes": 440 * mib,
            "torch_samples_per_s": torch_rate, "fastmm_samples_per_s": fastmm_rate,
            "torch_peak_shmem_over_baseline_bytes": 300 * mib,
            "fastmm_peak_shmem_over_baseline_bytes": 440 * mib}
        return {"summary": {"memory": {"paced_step_s": None, "max_throughput": condition}}}

    (note,) = report._memory_notes(case("NOT met", 500.0, 4500.0))
    assert "flat out (fastmm's loop 9.0x torch's here)" in note
    assert "FASTMM_SLAB_MEMORY=lean" in note
    for verdict, rates in (("met", (500.0, 4500.0)), ("NOT met", (500.0, 450.0)),
                           ("NOT met", (None, 4500.0))):
        (note,) = report._memory_notes(case(verdict, *rates))
        assert "flat out" not in note


def test_a_repetition_waits_for_the_last_loaders_workers_not_for_multiprocessing_helpers():
    """Each repetition starts once the last one's workers are gone; multiprocessing's resource
    tracker (started by shared memory, as Mosaic Streaming's arm does) lives on and is not
    waited for (it cost every repetition the 10 s deadline)."""
    from multiprocessing import shared_memory

    block = shared_memory.SharedMemory(create=True, size=16)  # starts the resource tracker
    block.close()
    block.unlink()
    t0 = time.monotonic()
    assert harness.wait_for_children(timeout=5.0) == 0
    assert time.monotonic() - t0 < 4.0
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert harness.wait_for_children(timeout=0.2) == 1
    finally:
        worker.kill()
        worker.wait()


def test_wait_for_quiet_reports_what_it_saw():
    quiet = harness.wait_for_quiet(max_wait_s=0.1, threshold_cores=1e9, probe_s=0.05)
    assert quiet["quiet_wait_s"] == pytest.approx(0.05)
    assert quiet["quiet_before_start"] is True
    assert quiet["other_processes_cpu_cores_before_start"] >= 0.0


def test_pss_sampler_duty_limit():
    free = harness.PssSampler(interval=0.01)
    limited = harness.PssSampler(interval=0.01, max_duty=0.1)
    for sampler in (free, limited):
        sampler.start()
    time.sleep(0.6)
    free_fig, limited_fig = free.stop(), limited.stop()
    assert limited_fig["pss_max_duty"] == 0.1 and free_fig["pss_max_duty"] is None
    # Sweeping at most 10% of the time: far fewer sweeps than back to back every 10 ms.
    assert limited_fig["pss_sweeps"] < free_fig["pss_sweeps"]
    busy = limited_fig["pss_sweeps"] * limited_fig["pss_sweep_mean_s"]
    assert busy <= 0.6 * 0.1 * 1.5 + limited_fig["pss_sweep_mean_s"]
    assert limited_fig["peak_total_pss_bytes"] > 0 and limited_fig["peak_shmem_bytes"] is not None


def test_sum64_reads_every_byte():
    data = bytes(range(13))  # 13 bytes: one uint64 word and 5 tail bytes
    batch = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert workloads.sum64(batch) == int.from_bytes(data[:8], "little") + sum(data[8:])
    assert workloads.sum64(torch.empty(0, dtype=torch.uint8)) == 0
    words = torch.full((4,), 0xFF, dtype=torch.uint8).repeat(8)  # 4 words of 2**64 - 1: wraps
    assert workloads.sum64(words) == (4 * (2**64 - 1)) % 2**64
    clip = torch.randint(0, 256, (3, 5, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    expected = int(np.frombuffer(clip.numpy().tobytes()[:104], dtype="<u8").sum(dtype=np.uint64))
    expected += sum(clip.numpy().tobytes()[104:])
    assert workloads.sum64(clip) == expected % 2**64
    strided = clip.transpose(0, 2)  # not contiguous: read in logical order like a copy
    assert workloads.sum64(strided) == workloads.sum64(strided.contiguous())
    assert workloads.crc32(clip) == zlib.crc32(clip.numpy().tobytes())
    assert workloads.digest(clip).data == zlib.crc32(clip.numpy().tobytes())
    assert set(workloads.CONSUMERS) == {"sum64", "crc32", "cuda"}
    assert workloads.DEFAULT_CONSUMER == "sum64"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("flags", [["--consume", "cuda"], ["--pin-memory"]])
def test_gpu_copies_without_a_gpu_are_refused_up_front(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--quick", *flags])
    assert exit_info.value.code == 2 and "need a CUDA device" in capsys.readouterr().err


def test_caption_batches_are_counted_and_read_whole():
    """A batch of (caption, label) samples: its samples, bytes and digest cover every caption."""
    from torch.utils.data import default_collate

    data = workloads.CaptionDataset()
    batch = default_collate([data[i] for i in range(5)])
    captions, labels = batch
    assert workloads.batch_len(batch) == 5 and workloads.batch_len({"c": captions}) == 5
    text = "".join(captions).encode()
    assert workloads.batch_nbytes(batch) == len(text) + 5 * 8
    quoted = b"".join(repr(c).encode() for c in captions)
    assert workloads.digest(batch).data == zlib.crc32(quoted + labels.numpy().tobytes())
    assert workloads.sum64(batch) != workloads.sum64(default_collate([data[i] for i in range(1, 6)]))
    alone = default_collate([workloads.CaptionDataset(labels=False)[i] for i in range(5)])
    assert alone == list(captions) and workloads.batch_len(alone) == 5


def test_a_batch_without_tensors_is_digested_by_its_content():
    """Strings and plain numbers are content: two batches of different captions (or labels)
    differ, where a digest of tensor bytes alone gave both the empty CRC."""
    a, b = ["a cat", "a dog"], ["a cat", "a hat"]
    assert workloads.digest(a).data == zlib.crc32(b"'a cat''a dog'") != 0
    assert workloads.digest(a) != workloads.digest(b)
    assert workloads.digest([1, 2]).data != workloads.digest([1, 3]).data
    assert workloads.digest([1, 2]).structure != workloads.digest(["1", "2"]).structure
    assert workloads.digest(torch.tensor(7)).data == zlib.crc32((7).to_bytes(8, "little"))


def _check_reps(torch_digests, fastmm_digests, firsts=((1, 0),)):
    """A case's loader repetitions as batch_check reads them: a warm-up each, then others."""
    return {name: [{"phase": "warmup", "digests": [tuple(d) for d in warm]}]
            + [{"phase": "timed", "digests": [tuple(f)] if f else []} for f in firsts]
            for name, warm in (("torch", torch_digests), ("fastmm", fastmm_digests))}


def test_the_loaders_are_checked_on_every_batch_of_the_warm_up():
    same = [(1, 0), (2, 0), (3, 0), (4, 0)]
    assert cli.batch_check(_check_reps(same, same[:3])) == {
        "batches_compared": 3, "first_difference": None, "repetitions_first_batch": 2,
        "repetitions_first_batch_differs": 0, "ok": True}
    third = cli.batch_check(_check_reps(same, [(1, 0), (2, 0), (9, 0), (4, 0)]))
    assert (third["first_difference"], third["ok"]) == (2, False)
    from fastmm.bench import report

    assert report._digest_note({"summary": {"check": third}}) == (
        "WARNING: batches differ: batch 3 of the warm-ups differs (4 batches of the warm-up "
        "repetitions compared one by one, the first batch of 2 other loader repetitions)")


def test_a_missing_digest_fails_the_check():
    same = [(1, 0), (2, 0)]
    no_first = cli.batch_check(_check_reps(same, same, firsts=((1, 0), None)))
    assert (no_first["repetitions_first_batch_differs"], no_first["ok"]) == (2, False)
    nothing = cli.batch_check(_check_reps([], []))
    assert (nothing["batches_compared"], nothing["ok"]) == (0, False)
    assert not cli.batch_check(_check_reps(same, []))["ok"]


def test_samples_kept_apart_are_counted_as_samples():
    """A list of read-only byte arrays (keep_list): 3 samples, not the first one's length."""
    data = workloads.ClipBankDataset((2, 3, 4), bank_size=2, mode="bytes")
    batch = workloads.keep_list([data[i] for i in range(3)])
    assert all(not a.flags.writeable and a.shape == (24,) for a in batch)
    assert workloads.batch_len(batch) == 3 and workloads.batch_nbytes(batch) == 72
    assert workloads.digest(batch).data == zlib.crc32(b"".join(a.tobytes() for a in batch))
    assert workloads.batch_len(workloads.stack_numpy(batch)) == 3


@pytest.mark.slow
@pytest.mark.parametrize("mode, collate", [("numpy", "stack_numpy"), ("bytes", "keep_list")])
def test_numpy_transport_case_runs_side_by_side(tmp_path, mode, collate):
    """Batches a collate_fn keeps in NumPy (stacked, or read-only samples in a list): both
    loaders deliver the same bytes."""
    from fastmm.bench import cli

    out = tmp_path / "out"
    assert cli.main(["--quick", "--workloads", "transport", "--clip-modes", mode, "--reps", "1",
                     "--mem-reps", "0", "--min-seconds", "0.2", "--warmup-seconds", "0.05",
                     "--clip-shape", ",".join(map(str, CLIP)), "--out", str(out)]) == 0
    (case,) = json.loads((out / "results.json").read_text())["cases"]
    assert case["name"] == f"transport-{mode}-b{BATCH}" and case["summary"]["check"]["ok"]
    assert {"torch", "fastmm", "single-process", "single-reuse", "consume-alone"} <= set(case["arms"])
    assert f"collate_fn={collate}" in case["arms"]["fastmm"]["description"]


@pytest.mark.slow
def test_captions_workload_runs_side_by_side(tmp_path):
    from fastmm.bench import cli

    out = tmp_path / "out"
    assert cli.main(["--quick", "--workloads", "captions", "--reps", "1", "--mem-reps", "0",
                     "--min-seconds", "0.2", "--warmup-seconds", "0.05", "--out", str(out)]) == 0
    cases = json.loads((out / "results.json").read_text())["cases"]
    assert [case["name"] for case in cases] == ["captions-b32", "captions-labels-b32"]
    for case in cases:
        assert case["summary"]["check"]["ok"] and case["summary"]["check"]["batches_compared"] > 1
        assert {"torch", "fastmm", "getitem-1-thread"} <= set(case["arms"])


def test_paced_steps_last_step_s():
    clip = torch.zeros(8, dtype=torch.uint8)

    def make():
        return torch.utils.data.DataLoader([clip] * 10_000, batch_size=2, num_workers=0)

    calls = []

    def consume(batch):
        calls.append(len(batch))
        return workloads.sum64(batch)

    fig = harness.run_loader(make, 0, 0.1, consume, step_s=0.02)
    assert calls and all(n == 2 for n in calls)
    assert fig["pace_step_s"] == 0.02 and fig["batches"] >= 5
    assert fig["samples_per_s"] == pytest.approx(2 / 0.02, rel=0.15)
    assert fig["samples_per_s"] <= 2 / 0.02 * 1.1
    assert fig["digests"] == [workloads.digest(torch.zeros(2, 8, dtype=torch.uint8))]
    assert fig["digests"][0].data == zlib.crc32(bytes(16))


def test_environment_command_carries_fastmm_settings(monkeypatch):
    from fastmm.bench import env

    for name in [k for k in os.environ if k.startswith("FASTMM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FASTMM_SLAB_MEMORY", "lean")
    record = env.capture(["fastmm-bench", "--quick"])
    assert record["command"] == "FASTMM_SLAB_MEMORY=lean fastmm-bench --quick"
    assert record["fastmm_env"] == {"FASTMM_SLAB_MEMORY": "lean"}
    assert record["fastmm_transport"]["slab_memory"] == "lean"


def test_environment_records_storage_versions_and_topology(tmp_path):
    import shutil

    from fastmm.bench import env

    record = env.capture(["fastmm-bench"], loader_config={"num_workers": 2}, paths=[str(tmp_path)])
    shm = record["storage"]["/dev/shm"]
    assert shm["mountpoint"] == "/dev/shm" and shm["fstype"] == "tmpfs"
    data = record["storage"][str(tmp_path)]
    assert data["mountpoint"] and str(tmp_path).startswith(data["mountpoint"].rstrip("/"))
    assert data["free_bytes"] == shutil.disk_usage(tmp_path).free or data["free_bytes"] > 0
    versions = record["versions"]
    assert versions["torch"] == torch.__version__ and versions["pillow"]
    if shutil.which("ffmpeg"):
        assert versions["ffmpeg"].startswith("ffmpeg version")
    assert record["numa_nodes"] and all(record["numa_nodes"].values())
    assert record["loader_config"] == {"num_workers": 2}
    assert "lo" in record["network"] and record["network"]["lo"]["up"]
    assert record["gpus"]["devices"] == [] if not torch.cuda.is_available() else \
        record["gpus"]["devices"][0]["memory_bytes"] > 0
    assert record["training_code_git"]["repo"] is None or record["training_code_git"]["commit"]


@pytest.mark.slow
def test_pipelines_quick_run_records_every_repetition(tmp_path):
    """python -m fastmm.bench.pipelines end to end, small: every arm's rate per repetition,
    and paired ratios of fastmm over each torch arm and over its own variants."""
    from fastmm.bench import pipelines

    pytest.importorskip("torchcodec")
    out = tmp_path / "out"
    assert pipelines.main(["--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--images",
                           "64", "--videos", "4", "--reps", "2", "--min-seconds", "0.3",
                           "--warmup-seconds", "0.3"]) == 0  # --quick, with 2 repetitions
    result = json.loads((out / "pipelines.json").read_text())
    video = result["cases"]["video"]
    assert all(len(v) == 2 and min(v) > 0 for v in video["samples_per_s"].values())
    ratios = video["ratios_over_baselines"]
    assert {"fastmm (torchcodec) / torch + PyAV",
            "fastmm (torchcodec) / fastmm, every frame decoded"} <= set(ratios)
    assert ("fastmm (torchcodec) / SPDL (threads, FFmpeg)" in ratios) == \
        pipelines._installed("spdl.io")
    image = result["cases"]["image"]["ratios_over_baselines"]
    assert "fastmm, exact (pil) / fastmm" not in image
    assert ("fastmm / DALI (CPU pipeline)" in image) == pipelines._installed("nvidia.dali")
    assert ("fastmm, tar shards / WebDataset (tar shards, PIL + v2)" in image) == \
        pipelines._installed("webdataset")
    assert ("fastmm / SPDL (threads, FFmpeg)" in image) == pipelines._installed("spdl.io")
    assert ("fastmm / Mosaic Streaming (MDS, PIL + v2)" in image) == \
        pipelines._installed("streaming")
    assert result["versions"]["numpy"] and result["versions"]["torch"] == torch.__version__


def _flat_images(tmp_path) -> list[str]:
    """Five JPEGs and PNGs of several sizes, image i all grey level 40 * i."""
    from PIL import Image

    files = []
    for i, (fmt, h, w) in enumerate([("JPEG", 300, 400), ("PNG", 250, 260), ("JPEG", 500, 230),
                                     ("PNG", 230, 300), ("JPEG", 240, 240)]):
        path = tmp_path / f"{i}.{fmt.lower()}"
        Image.fromarray(np.full((h, w, 3), 40 * i, np.uint8)).save(path, fmt)
        files.append(str(path))
    return files


def test_spdl_arm_yields_uint8_batches_of_the_output_size(tmp_path):
    """The SPDL arm of the pipelines benchmark: JPEGs and PNGs of any size in, uint8
    Bx224x224x3 batches (SPDL's own layout) of those images out, without end, in an order
    drawn from torch's seed (as the images complete: the same order with one thread)."""
    pytest.importorskip("spdl.io")
    from fastmm.bench.pipelines import SIZE, SpdlImageLoader

    files = _flat_images(tmp_path)

    def colours(seed, threads=1):
        torch.manual_seed(seed)
        batches = iter(SpdlImageLoader(files, batch_size=5, num_workers=threads))
        out = []
        for _ in range(6):
            batch = next(batches)
            assert batch.shape == (5, SIZE, SIZE, 3) and batch.dtype == torch.uint8
            assert (batch.float() - batch[:, :1, :1, :].float()).abs().max() <= 2  # flat
            out += [40 * round(v / 40) for v in batch[:, 0, 0, 0].tolist()]
        batches.close()
        return out

    first = colours(0)  # one thread: SPDL hands images out as they complete
    assert set(first) == {0, 40, 80, 120, 160}
    assert colours(0) == first and colours(1) != first
    assert set(colours(0, threads=2)) == set(first)


def test_spdl_clip_arm_decodes_the_frames_the_clip_spec_draws(tmp_path):
    """The SPDL video arm: clips of 16 frames, every 2nd from a random start, scaled and
    centre-cropped to 224x224, BxTxHxWxC uint8 (frame i of the video is grey level 6 * i)."""
    pytest.importorskip("spdl.io")
    from fastmm.bench.mmcorpus import encode_h264
    from fastmm.bench.pipelines import CLIP_FRAMES, CLIP_STRIDE, SIZE, SpdlClipLoader

    path = str(tmp_path / "ramp.mp4")
    encode_h264([np.full((48, 64, 3), 6 * i, np.uint8) for i in range(40)], 64, 48, 24, 8,
                10, path)
    torch.manual_seed(0)
    batches = iter(SpdlClipLoader([path], batch_size=2, num_workers=2))
    starts = set()
    for _ in range(4):
        batch = next(batches)
        assert batch.shape == (2, CLIP_FRAMES, SIZE, SIZE, 3) and batch.dtype == torch.uint8
        for clip in batch:
            levels = clip.float().mean(dim=(1, 2, 3)) / 6
            frames = levels.round().long().tolist()
            assert (levels - levels.round()).abs().max() < 0.3, levels  # flat grey frames
            assert frames == list(range(frames[0], frames[0] + CLIP_STRIDE * CLIP_FRAMES,
                                        CLIP_STRIDE))
            starts.add(frames[0])
    batches.close()
    assert len(starts) > 1 and max(starts) <= 40 - CLIP_STRIDE * (CLIP_FRAMES - 1) - 1


def test_webdataset_arm_yields_the_shards_images_as_uint8_batches(tmp_path):
    """The WebDataset arm of the pipelines benchmark: the images of the tar shards (not the
    other samples) as uint8 Bx3x224x224 batches, without end, in an order drawn from torch's
    seed."""
    pytest.importorskip("webdataset")
    from PIL import Image

    from fastmm.bench.pipelines import SIZE, WebDatasetImageLoader
    from fastmm.sources import write_shards

    samples = []
    for i in range(6):
        data = io.BytesIO()
        Image.fromarray(np.full((240 + 10 * i, 300, 3), 40 * i, np.uint8)).save(
            data, "PNG" if i % 2 else "JPEG")
        samples.append((f"image/{i}", {"png" if i % 2 else "jpg": data.getvalue()}))
    samples.append(("video/0", {"mp4": b"not an image: must not be decoded"}))
    write_shards(samples, str(tmp_path), max_bytes=2000)
    shards = sorted(str(p) for p in tmp_path.glob("*.tar"))
    assert len(shards) > 1

    def colours(seed):
        torch.manual_seed(seed)
        batches = iter(WebDatasetImageLoader(shards, batch_size=4, num_workers=2))
        out = []
        for _ in range(8):  # more images than the shards hold: resampled without end
            batch = next(batches)
            assert batch.shape == (4, 3, SIZE, SIZE) and batch.dtype == torch.uint8
            out += [40 * round(v / 40) for v in batch[:, 0, 0, 0].tolist()]
        return out

    first = colours(0)
    # only the images' colours (never the video's bytes); resampled at random, so most of
    # the six in 32 draws, not necessarily all (one was missing in about one run in fifty)
    assert set(first) <= {0, 40, 80, 120, 160, 200} and len(set(first)) >= 4
    assert colours(1) != first


def test_mosaic_arm_yields_the_mds_images_as_uint8_batches(tmp_path):
    """The Mosaic Streaming arm of the pipelines benchmark: the images, written once to MDS
    shards, as uint8 Bx3x224x224 batches, without end, in an order drawn from torch's seed.
    Mosaic Streaming pins numpy < 2.2, so CI runs this in .venv-mosaic (scripts/mosaic-env)."""
    pytest.importorskip("streaming")
    from fastmm.bench.pipelines import SIZE, MosaicImageLoader, ensure_mds

    files = _flat_images(tmp_path)
    mds = ensure_mds(str(tmp_path), files)
    written = os.path.getmtime(os.path.join(mds, "index.json"))
    assert ensure_mds(str(tmp_path), files) == mds
    assert os.path.getmtime(os.path.join(mds, "index.json")) == written  # written once

    def colours(seed):
        torch.manual_seed(seed)
        batches = iter(MosaicImageLoader(mds, batch_size=5, num_workers=2))
        out = []
        for _ in range(6):  # more images than the shards hold
            batch = next(batches)
            assert batch.shape == (5, 3, SIZE, SIZE) and batch.dtype == torch.uint8
            assert (batch.float() - batch[:, :, :1, :1].float()).abs().max() <= 2  # flat
            out += [40 * round(v / 40) for v in batch[:, 0, 0, 0].tolist()]
        batches.close()
        return out

    first = colours(0)
    assert set(first) == {0, 40, 80, 120, 160}
    assert colours(0) == first and colours(1) != first


def test_dali_arm_yields_uint8_batches_of_the_output_size(tmp_path):
    """The DALI arm of the pipelines benchmark: JPEGs and PNGs of any size in, uint8
    Bx3x224x224 batches of those images out, in an order drawn from torch's seed."""
    pytest.importorskip("nvidia.dali")
    from fastmm.bench.pipelines import SIZE, DaliImageLoader

    files = _flat_images(tmp_path)

    def colours(seed):
        """The flat colour of each image of the first 6 batches, to the nearest 40."""
        torch.manual_seed(seed)
        batches = iter(DaliImageLoader(files, batch_size=5, num_workers=2))
        out = []
        for _ in range(6):
            batch = next(batches)
            assert batch.shape == (5, 3, SIZE, SIZE) and batch.dtype == torch.uint8
            assert (batch.float() - batch[:, :, :1, :1].float()).abs().max() <= 2  # flat
            out += [40 * round(v / 40) for v in batch[:, 0, 0, 0].tolist()]
        return out

    first = colours(0)
    assert set(first) == {0, 40, 80, 120, 160}
    assert colours(0) == first and colours(1) != first


@pytest.mark.slow
def test_resume_cost_quick_run_times_both_ways(tmp_path):
    """python -m fastmm.bench.resume_cost end to end, small: both ways timed at the stop, with
    their paired ratio (no figure is asserted: timings belong to the benchmark)."""
    from fastmm.bench import resume_cost

    out = tmp_path / "out"
    assert resume_cost.main(["--quick", "--out", str(out), "--cache-dir",
                             str(tmp_path / "cache")]) == 0
    result = json.loads((out / "resume_cost.json").read_text())
    assert result["shards"] >= 2 and result["stops"] == [result["batches_per_epoch"] // 2]
    stop = result["stops"][0]
    for way in resume_cost.WAYS:
        assert result["first_batch_s"][f"{way} @ {stop}"]["reps"][0] > 0
    assert result["pulled_over_own"][str(stop)]["median"] > 0
    assert "ratio" in (out / "resume_cost.md").read_text()


@pytest.mark.slow
def test_telemetry_cost_quick_run_pairs_every_arm_with_off(tmp_path):
    """python -m fastmm.bench.telemetry_cost end to end on the tiny dataset, 2 blocks: every
    arm of every block drew samples in its windows, the ratios to "off" (the noise floor's
    arm too) are paired per block, and the aims get a verdict."""
    from fastmm.bench import telemetry_cost

    out = tmp_path / "out"
    assert telemetry_cost.main(["--quick", "--workloads", "tiny", "--reps", "2",
                                "--min-seconds", "0.3", "--window-seconds", "0.1",
                                "--out", str(out), "--cache-dir", str(tmp_path / "cache")]) == 0
    case = json.loads((out / "telemetry_cost.json").read_text())["cases"]["tiny"]
    for name, blocks in case["blocks"].items():
        assert len(blocks) == 2 and blocks[0]["workers_alive_after"] == 0
        for figs in blocks:
            for mode in telemetry_cost.MODES:
                assert figs[mode]["seconds"] >= 0.3 and figs[mode]["samples"] > 0
                assert (figs[mode]["sampler_cpu_percent"] > 0) == (not mode.startswith("off"))
                assert figs[mode]["spans_dropped"] == 0
        for mode in telemetry_cost.MODES[1:]:
            assert case["on_over_off"][f"{name} {mode}"]["n"] == 2
        # 2 blocks make no 95% CI: the aims are not shown, and the intervals say what they are
        assert case["verdicts"][f"{name} summary"] == "not shown"
    text = (out / "telemetry_cost.md").read_text()
    assert "noise floor" in text and "(range of 2) not shown" in text and "(95% CI)" not in text
    assert f"{stats.interval(case['on_over_off']['fastmm summary'], 3)} not shown" in text


def _bad_command_lines(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    return [
        ("cli", ["--min-seconds", "nan"]),  # a window that would never close
        ("cli", ["--warmup-seconds", "inf"]),
        ("cli", ["--out", str(a_file)]),
        ("cli", ["--cache-dir", str(a_file / "sub")]),
        ("cli", ["--seed", "-1"]),
        ("cli", ["--workloads", "decode,bogus"]),
        ("suite", ["--only", "loader,bogus"]),
        ("pipelines", ["--workloads", "images"]),  # telemetry_cost's spelling
        ("telemetry_cost", ["--workloads", "image"]),
        ("study_staging", ["--reps", "0"]),
        ("study_staging", ["--out", str(a_file / "sub")]),  # found before the run, not after
        ("study_gpu_decode", ["--reps", "-1"]),
        ("study_shards", ["--worlds", "2,0"]),
        ("study_shards", ["--work-dir", str(a_file)]),
        ("resume_cost", ["--fractions", "0.5,1.5"]),
        ("cli", ["--dataset", "m:f", "--batch-size", "0", "--num-workers", "2"]),
        ("cli", ["--dataset", "m:f", "--batch-size", "8"]),  # --num-workers missing
        ("cli", ["--dataset", "m:f", "--batch-size", "8", "--num-workers", "2",
                 "--arms", "fastmm,bogus"]),
        ("mmcorpus", ["--out", str(a_file)]),
        ("worker_memory", ["--samples", "0"]),
        ("copy_on_read", ["--items", "0"]),
        ("copy_on_read", ["--datasets", "bogus"]),
        ("state_cost", ["--step-ms", "-1"]),
        ("state_cost", ["--num-workers", "0"]),
        ("tuning", ["--workloads", "decode,bogus"]),
        ("tuning", ["--workloads", "dataset"]),  # --dataset missing
        ("tuning", ["--cpu-budget", "1.5"]),
    ]


def test_bad_command_lines_are_refused_before_any_work(tmp_path, capsys):
    """argparse's one-line error and exit 2, for every bench command, before it starts."""
    import importlib

    for module, argv in _bad_command_lines(tmp_path):
        main = importlib.import_module(f"fastmm.bench.{module}").main
        started = time.perf_counter()
        with pytest.raises(SystemExit) as exited:
            main(argv)
        said = capsys.readouterr().err
        assert exited.value.code == 2 and "error: " in said, (module, argv, said)
        assert time.perf_counter() - started < 5, (module, argv)
    assert not list((tmp_path).glob("*/")), "nothing made"


def test_quick_presets_give_way_to_what_the_command_line_says():
    import argparse

    from fastmm.bench import options

    p = argparse.ArgumentParser()
    p.add_argument("--images", type=options.whole(1), default=400)
    p.add_argument("--worlds", type=options.listed(options.whole(1)), default="2,4")
    p.add_argument("--quick", action="store_true")
    preset = {"images": 48, "worlds": [2]}
    assert vars(options.parse(p, ["--quick", "--worlds", "3"], preset)) == {
        "images": 48, "worlds": [3], "quick": True}
    assert vars(options.parse(p, ["--images", "10"], preset)) == {
        "images": 10, "worlds": [2, 4], "quick": False}


@pytest.mark.slow
def test_a_terminated_study_removes_its_temporary_data_and_says_so(tmp_path):
    """SIGTERM (timeout, a scheduler) ends a study as Ctrl-C does: its finally clauses run."""
    import signal

    work = tmp_path / "work"  # made by the study
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastmm.bench.study_shards", "--quick", "--out",
         str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--work-dir", str(work)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(work.glob("fastmm-shards-*")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    assert list(work.glob("fastmm-shards-*")), "it made its temporary directory"
    proc.send_signal(signal.SIGTERM)
    _, said = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in said and "Traceback" not in said, said
    assert not list(work.iterdir())
    assert not (tmp_path / "out" / "shards.json").exists()


@pytest.mark.slow
def test_an_interrupted_bench_run_keeps_the_cases_that_finished(tmp_path):
    import signal

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastmm.bench", "--quick", "--workloads", "transport",
         "--clip-modes", "view,clone", "--clip-shape", "4,3,32,32", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    said = []
    for line in proc.stderr:  # the second case has begun: the first one is done
        said.append(line)
        if line.startswith("[transport-clone"):
            proc.send_signal(signal.SIGTERM)
            break
    said.append(proc.communicate(timeout=60)[1])
    assert proc.returncode == 130, "".join(said)
    results = json.loads((out / "results.json").read_text())
    assert [c["name"] for c in results["cases"]] == ["transport-view-b32"]
    assert results["interrupted"] == "after 1 of 2 cases"
    assert "**Interrupted** after 1 of 2 cases" in (out / "summary.md").read_text()


@pytest.mark.slow
def test_worker_memory_run_follows_each_workers_rss_in_both_modes(tmp_path):
    """The long-run memory check (here short): both FASTMM_WORKER_MALLOC settings, each worker's
    RSS over the run, its growth over the second half, and a finding with a call."""
    from fastmm.bench import worker_memory

    out = tmp_path / "out"
    assert worker_memory.main(["--samples", "512", "--images", "40", "--out", str(out),
                               "--cache-dir", str(tmp_path / "cache")]) == 0
    result = json.loads((out / "worker_memory.json").read_text())
    assert [r["mode"] for r in result["runs"]] == ["reuse", "system"]
    for run in result["runs"]:
        assert run["samples"] == 512 and len(run["workers"]) == 2
        for w in run["workers"]:
            assert len(w["rss_at_tenths_bytes"]) == 10 and w["peak_rss_bytes"] == max(w["rss_bytes"])
        assert run["other_processes_cpu_cores"] >= 0  # whether the machine was busy: measured
    from fastmm.bench.report import busy_notes

    assert result["busy"] == busy_notes("worker memory",
                                        [r["other_processes_cpu_cores"] for r in result["runs"]])
    assert result["finding"]["call"] in ("roll out", "roll back", "undecided")
    assert (out / "report.html").exists()


@pytest.mark.slow
def test_state_cost_run_times_state_dict_for_both_loaders(tmp_path):
    """The state-every-step benchmark (here small): both loaders, with and without a state
    each step, per-call times, the state's size, and a finding."""
    pytest.importorskip("torchdata")
    from fastmm.bench import state_cost

    out = tmp_path / "out"
    assert state_cost.main(["--rounds", "2", "--batches", "12", "--warmup", "2",
                            "--num-workers", "2", "--step-ms", "1", "--items", "1000",
                            "--out", str(out)]) == 0
    result = json.loads((out / "state_cost.json").read_text())
    for r in result["rounds"]:
        for kind in ("torch", "fastmm"):
            runs = r["runs"][kind]
            assert runs["without"]["calls_s"] == [] and len(runs["with"]["calls_s"]) == 14
            assert runs["with"]["loop_s"] > 0 and runs["without"]["loop_s"] > 0
    assert result["state_bytes"]["fastmm"] > 0 and result["state_bytes"]["torch"] > 0
    assert result["overhead"]["fastmm"]["n"] == 2
    assert "state_dict()" in result["finding"]["text"] and (out / "report.html").exists()


@pytest.mark.slow
def test_tuning_run_sweeps_fixed_settings_and_judges_auto_against_the_best(tmp_path):
    """The auto-against-a-sweep benchmark (here small): every fixed setting's rate in the
    sweep, then auto's batch times and changes between two runs of the sweep's best, its rate
    against theirs, and a finding."""
    from fastmm.bench import tuning

    out = tmp_path / "out"
    assert tuning.main(["--quick", "--workloads", "transport", "--num-workers", "1,2",
                        "--prefetch-factors", "2", "--auto-seconds", "4", "--sweep-rounds", "2",
                        "--out", str(out)]) == 0
    result = json.loads((out / "tuning.json").read_text())
    sweep, (r,) = result["rounds"]["transport"]["sweep"], result["rounds"]["transport"]["rounds"]
    (summary,) = result["summaries"]
    assert len(sweep) == 2 and all(set(s["fixed"]) == {"1,2", "2,2"} for s in sweep)
    assert all(v["rate"] > 0 for s in sweep for v in s["fixed"].values())
    best = summary["best"]
    assert best == max(["1,2", "2,2"], key=lambda k: sum(s["fixed"][k]["rate"] for s in sweep))
    assert r["auto"]["times"][-1] >= 4
    between = (r["before"]["rate"] + r["after"]["rate"]) / 2
    assert r["judged"]["ratio"] == pytest.approx(r["judged"]["rate"] / between)
    assert r["auto"]["settled"]["num_workers"] >= 1
    assert "auto's rate" in result["finding"]["text"] and (out / "report.html").exists()


@pytest.mark.slow
def test_tuning_within_a_budget_times_the_step_alone_beside_a_busy_core_and_under_auto(tmp_path):
    """With --cpu-budget: the step timed alone, beside one busy process (no loader), and under
    auto within the budget; the workers' peak CPU read; all of it in the finding."""
    from fastmm.bench import tuning

    out = tmp_path / "out"
    assert tuning.main(["--quick", "--workloads", "transport", "--num-workers", "1",
                        "--prefetch-factors", "2", "--auto-seconds", "3", "--cpu-budget", "0.5",
                        "--step-ms", "5", "--out", str(out)]) == 0
    result = json.loads((out / "tuning.json").read_text())
    (r,) = result["rounds"]["transport"]["rounds"]
    assert r["step_alone_s"] > 0 and r["step_beside_a_busy_core"] > 0
    assert r["auto"]["step_s"] > 0 and r["auto"]["workers_cpu_peak"] > 0
    (summary,) = result["summaries"]
    assert summary["budget_cores"] == 0.5 * tuning.env.usable_cores()
    text = result["finding"]["text"]
    assert "beside one busy process" in text and "its time alone" in text


def test_tuning_windows_and_the_time_auto_reached_the_best():
    from fastmm.bench import tuning

    times = [0.1 * i for i in range(1, 101)]  # 10 batches/s for 10 s
    rates = tuning.window_rates(times, 1.0)
    assert rates[0][0] == pytest.approx(1.1)
    assert all(r == pytest.approx(10, abs=1) for _, r in rates)
    judged = tuning.judge_auto({"times": times}, best_rate=10.0, seconds=1.0)
    assert judged["ratio"] == pytest.approx(1.0, abs=0.1) and judged["reached_s"] <= 1.2
    assert tuning.judge_auto({"times": times}, best_rate=20.0, seconds=1.0)["reached_s"] is None


def _copy_on_read_case(ours: list[int], theirs: list[int], size: int, same=True) -> dict:
    from fastmm.bench import stats

    return {"dataset": "lists", "items": 10, "dataset_bytes": size, "same_batches": same,
            "rounds": [{"runs": {"fastmm": {"peak_private_bytes": o},
                                 "torch": {"peak_private_bytes": t}}}
                       for o, t in zip(ours, theirs)],
            "fastmm_private_over_dataset": stats.summarize([o / size for o in ours]),
            "torch_private_over_dataset": stats.summarize([t / size for t in theirs]),
            "fastmm_growth_over_dataset": stats.summarize([0.0] * len(ours)),
            "torch_growth_over_dataset": stats.summarize([t / size for t in theirs]),
            "rate_ratio": stats.summarize([1.0] * len(ours)), "first_batch_ratio": {}}


@pytest.mark.parametrize("ours, theirs, same, call", [
    ([20, 25], [300, 310], True, "roll out"),      # at most 0.3x the dataset in every round
    ([20, 35], [300, 310], True, "undecided"),     # less than torch's, over the bar once
    ([20, 320], [300, 310], True, "roll back"),    # as much as torch's in a round
    ([20, 25], [300, 310], False, "roll back"),    # different batches
])
def test_copy_on_read_calls_on_the_bar_torch_and_the_batches(ours, theirs, same, call):
    from fastmm.bench import copy_on_read

    found = copy_on_read.finding({"datasets": [_copy_on_read_case(ours, theirs, 100, same)]})
    assert found["call"] == call
    assert ("the same batches" in found["text"]) == same


@pytest.mark.slow
def test_copy_on_read_run_measures_both_loaders_private_memory_and_first_batch(tmp_path):
    """The copy-on-read benchmark (here small): both loaders, the same batches, each worker's
    private memory over the epoch, the first batch timed in a process of its own, a finding;
    its report and the main job's index show the memory over the epoch and the peaks."""
    from fastmm.bench import copy_on_read, suite
    from _browser import render

    out = tmp_path / "copy-on-read"
    assert copy_on_read.main(["--items", "20000", "--rounds", "2", "--num-workers", "2",
                              "--datasets", "lists", "--methods", "forkserver",
                              "--out", str(out)]) == 0
    result = json.loads((out / "copy_on_read.json").read_text())
    (case,) = result["datasets"]
    assert case["same_batches"] and case["dataset_bytes"] > 0
    for r in case["rounds"]:
        for kind in ("torch", "fastmm"):
            run = r["runs"][kind]
            assert run["samples"] == 20000 and run["peak_private_bytes"] > 0
            assert all(len(row) == 2 for _, row in run["series"])  # each worker, each sample
            assert r["first_batch_s"]["forkserver"][kind] > 0
            assert r["first_batch_floor_s"]["forkserver"][kind] > 0  # at 2,000 items
    assert case["first_batch_growth_s"]["forkserver"]["torch"]["n"] == 2
    assert "the dataset's size added" in result["finding"]["text"]
    assert case["fastmm_private_over_dataset"]["n"] == 2
    assert case["torch_growth_over_dataset"]["n"] == 2  # over the same loaders at 2,000 items
    assert all(r["floor_peak_private_bytes"]["fastmm"] > 0 for r in case["rounds"])
    # (20,000 items: the workers' start-up is most of what either holds, so any call; the
    # rule itself is tested on known figures above)
    assert result["finding"] == copy_on_read.finding(result)
    assert not list(out.glob("*.partial.json"))  # (kept only while later datasets run)
    plots = ["lists-over-time", "peak-over-dataset"]
    assert list(render(out / "report.html")["plots"]) == plots
    (part,) = [p for p in suite.PARTS if p.name == "copy-on-read"]
    suite.index(str(tmp_path), [(part, 0, 30.0)], 30.0)
    index = render(tmp_path / "index.html")
    assert index["answer"][0].startswith(f"{part.title}: {result['finding']['text']} Call: ")
    assert list(index["plots"]) == [f"copy-on-read-{name}" for name in plots]
    assert index["links"] == ["copy-on-read/report.html"] * 2


def test_copy_on_read_counts_a_container_the_dataset_holds_twice_once():
    """ImageFolder's ``imgs`` is its ``samples``: counted twice, the dataset's size (what the
    workers' memory is judged against) was twice what it held."""
    from fastmm.bench import copy_on_read
    from fastmm.shared import python_bytes

    dataset = copy_on_read.image_folder(20_000)
    assert dataset.imgs is dataset.samples
    assert copy_on_read.objects_bytes(dataset) == sum(map(python_bytes, [
        dataset.extensions, dataset.classes, dataset.class_to_idx, dataset.samples,
        dataset.targets]))


def test_the_copy_on_read_module_imports_no_plotting():
    """Under spawn every worker imports the module it was started from (``__mp_main__``): its
    first batch would time matplotlib's import too (0.6 s here), for both loaders."""
    done = subprocess.run([sys.executable, "-c", "import sys, fastmm.bench.copy_on_read; "
                           "print('matplotlib' in sys.modules)"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
