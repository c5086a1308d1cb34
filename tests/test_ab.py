"""fastmm-bench --dataset: the method on a pipeline someone else wrote (tests/_user_pipeline.py:
dict samples with strings, a random augmentation, a small CNN's real training step), its
refusals before any work, and what a failing pipeline leaves behind. No figure is asserted:
speed belongs to the benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import fastmm
from fastmm.bench import ab, cli, stats

PIPE = os.path.join(os.path.dirname(__file__), "_user_pipeline.py")


def bench(*args: str, out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastmm.bench", *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    out = tmp_path_factory.mktemp("ab")
    proc = bench("--dataset", f"{PIPE}:shapes", "--step", f"{PIPE}:train_step", "--batch-size",
                 "8", "--num-workers", "2", "--quick", out=out)
    assert proc.returncode == 0, proc.stderr
    return out, proc, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_every_arm_changes_one_thing_and_passes_its_check(ran):
    _, _, result = ran
    arms = result["arms"]
    twin = ["fastmm, pure_python=1"] if fastmm.uses_cpp() else []
    assert list(arms) == ["torch, loader alone", "fastmm, loader alone", "torch", "fastmm",
                          "num_workers=1", "prefetch_factor=4", "fastmm, slab_memory=lean",
                          "fastmm, worker_malloc=system", *twin]
    for name, arm in arms.items():
        assert arm["correctness"]["ok"] and arm["correctness"]["why"], (name, arm["correctness"])
        assert arm["samples_per_s"]["n"] == 3 and len(arm["reps"]) == 3
        parent = arms.get(arm["parent"])
        if parent is None:
            assert name in ("torch", "torch, loader alone")
            continue
        keys = set(arm["settings"]) | set(parent["settings"])
        changed = {k for k in keys if parent["settings"].get(k) != arm["settings"].get(k)}
        assert len(changed) == 1, (name, changed)
        assert arm["call"] in ab.CALLS and stats.interval(arm["ratio"], 2, "x") in arm["label"]
    # the same seeds: the loaders and the prefetch depth give the same bytes; the worker count
    # moves the augmentation's random draws to other workers, which the check says
    for name in ("fastmm", "fastmm, loader alone", "prefetch_factor=4", "fastmm, slab_memory=lean",
                 "fastmm, worker_malloc=system", *twin):
        assert arms[name]["correctness"]["check"] == "every batch byte-identical"
    assert "random" in arms["num_workers=1"]["correctness"]["why"]
    assert {x["arm"] for x in result["not_run"]} == {
        "pin_memory", "decoder", "source", "reduce", *([] if twin else ["pure_python"])}


@pytest.mark.slow
def test_results_lead_with_a_headline_and_the_console_names_the_page(ran):
    out, proc, result = ran
    whats = [h["what"] for h in result["headline"]]
    assert len(whats) == 4 and "end to end" in whats[1] and "memory" in whats[2]
    for h in result["headline"]:
        assert h["ci"][0] <= h["ratio"] <= h["ci"][1] and h["n"] == 3 and h["ci_level"] == 0.75
        assert "range of 3" in h["label"]  # three runs make no 95% CI, and it says so
    assert result["answer"][0].startswith("On this machine")
    assert result["pipeline"]["batch"] == ("dict{image: uint8[8, 3, 40, 40], label: int64[8], "
                                           "name: list[8 x str]}")
    assert proc.stdout.strip().splitlines()[-1] == f"report: {out / 'index.html'}"
    m = result["baseline_profile"]["metrics"]
    assert m["queue_wait_s"]["count"] > 0 and m["worker_cpu_percent"] is not None


@pytest.mark.slow
def test_the_page_shows_the_answer_and_every_plot(ran):
    from _browser import render

    out, _, result = ran
    dom = render(out / "index.html")
    assert result["answer"][0] in dom["answer"]
    assert set(dom["plots"]) == {"ratios", "rates", "queue-wait", "step-time", "memory"}
    assert all(w > 100 and h > 100 for w, h in dom["plots"].values()), dom["plots"]


@pytest.mark.parametrize("target, says", [
    ("nope", "has no 'nope'"),
    ("answer", "answer is not callable (it is int 42)"),
    ("not_a_dataset", "not_a_dataset() returned list_iterator, not a Dataset"),
])
def test_a_target_that_cannot_be_used_is_one_line_and_exit_2(target, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--dataset", f"{PIPE}:{target}", "--batch-size", "8", "--num-workers", "2",
                  "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and says in err and PIPE in err
    assert not (tmp_path / "results.json").exists()


def test_a_module_that_does_not_import_is_named(tmp_path, capsys):
    broken = tmp_path / "broken_pipeline.py"
    broken.write_text("import definitely_not_a_module_xyz\n")
    for target, says in [
        (f"{broken}:dataset", "ModuleNotFoundError: No module named 'definitely_not_a_module_xyz'"),
        ("no_such_package.data:dataset", "No module named 'no_such_package'"),
        (f"{tmp_path}/missing.py:dataset", "no such file"),
        ("no_colon", "expected MODULE:CALLABLE or path/to/FILE.py:CALLABLE"),
    ]:
        with pytest.raises(SystemExit) as e:
            cli.main(["--dataset", target, "--batch-size", "8", "--num-workers", "2",
                      "--out", str(tmp_path)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        assert repr(target) in err and says in err, err


@pytest.mark.slow
def test_a_step_that_raises_shows_its_traceback_and_writes_no_report(tmp_path):
    (tmp_path / "index.html").write_text("an earlier run's page")
    proc = bench("--dataset", f"{PIPE}:shapes", "--step", f"{PIPE}:broken_step", "--batch-size",
                 "8", "--num-workers", "2", "--quick", out=tmp_path)
    assert proc.returncode == 1
    assert 'in broken_step\n    raise RuntimeError("the step is broken on purpose")' in proc.stderr
    assert not (tmp_path / "index.html").exists() and not (tmp_path / "results.json").exists()


@pytest.mark.slow
def test_an_iterable_dataset_without_a_step(tmp_path):
    proc = bench("--dataset", f"{PIPE}:stream", "--batch-size", "8", "--num-workers", "2",
                 "--quick", "--arms", "fastmm,num_workers", out=tmp_path)
    assert proc.returncode == 0, proc.stderr
    arms = json.loads((tmp_path / "results.json").read_text())["arms"]
    assert list(arms) == ["torch", "fastmm", "num_workers=1"]
    assert arms["fastmm"]["correctness"]["check"] == "every batch byte-identical"
    assert arms["num_workers=1"]["correctness"]["check"].startswith("every batch the same structure")
    assert "IterableDataset" in arms["num_workers=1"]["correctness"]["why"]


@pytest.mark.slow
def test_a_multimodal_dataset_gets_its_backends_as_arms(tmp_path):
    from fastmm.bench.mmcorpus import CorpusSpec
    from fastmm.bench.pipelines import ensure_mmcorpus

    root = ensure_mmcorpus(CorpusSpec(num_images=40, num_videos=0, seed=3), tmp_path / "cache")
    env = dict(os.environ, PIPELINE_IMAGES=os.path.join(root, "posix", "manifest.jsonl"))
    proc = subprocess.run([sys.executable, "-m", "fastmm.bench", "--dataset", f"{PIPE}:multimodal",
                           "--batch-size", "8", "--num-workers", "2", "--quick", "--arms",
                           "decoder,source,reduce", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    arms = json.loads((tmp_path / "out" / "results.json").read_text())["arms"]
    assert list(arms) == ["torch", "decoder=torchvision", "source=staged", "reduce=True"]
    for name in list(arms)[1:]:
        assert arms[name]["correctness"]["ok"], (name, arms[name]["correctness"])
    assert arms["source=staged"]["correctness"]["check"] == "every batch byte-identical"
    assert arms["reduce=True"]["correctness"]["check"].startswith("the same batches, pixels within")


def test_checks_fail_when_what_was_delivered_differs():
    base = {"digests": [(1, 7), (2, 7)], "kept": [torch.zeros(2, 4)]}
    arm = ab.Arm("x", "fastmm", 2, 2, False, True, None, parent="torch", factor="fastmm")
    assert ab.check(arm, base, base, True)["ok"]
    assert not ab.check(arm, dict(base, digests=[(1, 7), (3, 7)]), base, True)["ok"]
    shaped = dict(base, digests=[(1, 7), (2, 8)])
    assert not ab.check(ab.Arm("y", "torch", 1, 2, False, True, None, check="structure"),
                        shaped, base, True)["ok"]
    pixels = ab.Arm("z", "torch", 2, 2, False, True, None, check="pixels")
    ramp = torch.arange(256.0).repeat(2, 1)
    assert ab.check(pixels, dict(base, kept=[ramp + 1]), dict(base, kept=[ramp]), True)["ok"]
    assert not ab.check(pixels, dict(base, kept=[ramp + 3]), dict(base, kept=[ramp]), True)["ok"]
    assert not ab.check(pixels, dict(base, kept=[ramp[:1]]), dict(base, kept=[ramp]), True)["ok"]


def test_a_check_run_without_batches_fails_its_check():
    """No digests on either side compare nothing: not 'identical'."""
    empty = {"digests": [], "kept": None}
    for kind in ("bytes", "structure", "bytes-or-random"):
        arm = ab.Arm("x", "fastmm", 2, 2, False, True, None, check=kind)
        assert not ab.check(arm, empty, empty, True)["ok"]
        assert not ab.check(arm, empty, {"digests": [(1, 7)], "kept": None}, True)["ok"]


def test_the_baseline_is_reproducible_only_if_every_run_gave_the_same_batches():
    """Its warm-up and check runs batch by batch over the batches both made (the 3rd batch
    differing counts), the first batch of every timed run, and no run without a batch."""
    check = {"digests": [(1, 7), (2, 7), (3, 7)]}
    timed = [{"digests": [(1, 7)]}, {"digests": [(1, 7)]}]
    assert ab.reproducible({"digests": [(1, 7), (2, 7)]}, check, timed)
    assert not ab.reproducible({"digests": [(1, 7), (2, 7), (4, 7)]}, check, timed)
    assert not ab.reproducible({"digests": [(1, 7)]}, check, timed + [{"digests": []}])
    assert not ab.reproducible({"digests": [(1, 7)]}, check, [{"digests": [(5, 7)]}])
    assert not ab.reproducible({"digests": []}, {"digests": []}, [])


def test_digest_sees_bytes_order_and_structure():
    a = {"x": torch.arange(6, dtype=torch.uint8).reshape(2, 3), "s": ["a", "b"]}
    assert ab.digest(a) == ab.digest({"x": torch.arange(6, dtype=torch.uint8).reshape(2, 3),
                                      "s": ["a", "b"]})
    assert ab.digest(a)[0] != ab.digest(dict(a, s=["b", "a"]))[0]
    assert ab.digest(a)[1] != ab.digest(dict(a, x=a["x"].reshape(3, 2)))[1]
    assert ab.describe(a) == "dict{x: uint8[2, 3], s: list(str, str)}"


def test_without_workers_there_is_no_loader_to_compare():
    """fastmm.DataLoader with num_workers=0 is torch's own loader: no fastmm arm, said why; the
    worker-count arm tries one worker per core."""
    args = ab.build_parser().parse_args(["--dataset", "m:f", "--batch-size", "8",
                                         "--num-workers", "0"])
    chosen, skipped = ab.arms(args, torch.utils.data.TensorDataset(torch.zeros(4)), True, "/x")
    assert [a.name for a in chosen] == ["torch", f"num_workers={ab.env.usable_cores()}"]
    why = {x["arm"]: x["why"] for x in skipped}
    assert "is torch's DataLoader" in why["fastmm"] and why["prefetch_factor"].startswith("no workers")


def test_the_baseline_profile_names_copy_on_read_when_its_workers_grew():
    from fastmm.bench.ab import COPY_ON_READ_BYTES, bottleneck

    reps = [{"queue_wait_share": 0.5}] * 3
    for grown, said in ((COPY_ON_READ_BYTES * 2, True), (COPY_ON_READ_BYTES // 2, False),
                        (None, False)):
        metrics = {"worker_uss_growth_bytes": grown and {"max": grown}}
        observed = bottleneck({"metrics": metrics}, reps)["observed"]
        named = [x for x in observed if x.startswith("copy-on-read: ")]
        assert bool(named) is said
        if said:
            assert f"grew by up to {grown / 2**20:,.0f} MiB" in named[0]


@pytest.mark.slow
def test_the_auto_arm_runs_a_sweep_around_yours_and_judges_auto_against_its_best(tmp_path):
    """--arms auto: num_workers="auto" against the best fixed setting of a sweep that holds
    the user's own, paired per round; the answer, the table and the plots on the page."""
    from _browser import render

    proc = bench("--dataset", f"{PIPE}:shapes", "--step", f"{PIPE}:train_step", "--batch-size",
                 "8", "--num-workers", "3", "--prefetch-factor", "3", "--quick", "--arms", "auto",
                 "--auto-seconds", "3", out=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "results.json").read_text())
    auto = result["auto"]
    assert [3, 3] in auto["settings"] and [1, 2] in auto["settings"]
    assert len(auto["sweep"]) == 3 and len(auto["rounds"]) == 3 and auto["auto_seconds"] == 3
    keys = {f"{w},{p}" for w, p in auto["settings"]}
    assert all(set(r["fixed"]) == keys for r in auto["sweep"])
    s = auto["summary"]
    assert s["best"] in keys and s["same_first_batch"], s
    for r in auto["rounds"]:  # the best just before auto and just after it
        assert r["before"]["rate"] > 0 and r["after"]["rate"] > 0
        assert r["auto"]["times"][-1] >= 3 and r["auto"]["settled"]["num_workers"] >= 1
    assert auto["call"] in ab.CALLS and "range of 3" in auto["label"]  # no 95% CI from 3
    said = [line for line in result["answer"] if line.startswith("num_workers='auto'")]
    assert said and stats.interval(s["ratio"], 3, "x") in said[0]
    dom = render(tmp_path / "index.html")
    assert said[0] in dom["answer"]
    assert {"auto-sweep", "auto"} <= set(dom["plots"]), dom["plots"]
    assert "ratios" not in dom["plots"]  # no arm changed one thing: no empty plot for it
    assert all(w > 100 and h > 100 for w, h in dom["plots"].values())


def test_auto_is_asked_for_by_name_and_its_sweep_holds_the_users_count():
    from fastmm.bench import tuning

    args = ab.build_parser().parse_args(["--dataset", "m:f", "--batch-size", "8",
                                         "--num-workers", "2"])
    assert "auto" not in args.arms and "fastmm" in args.arms
    assert tuning.worker_counts(2) == [1, 2, 4]
    assert tuning.worker_counts(16, 12) == [1, 2, 4, 8, 12, 16, 32]
    assert tuning.worker_counts(3, 0) == [1, 2, 3, 4]


def test_auto_is_called_only_on_what_its_rounds_show():
    from fastmm.bench import tuning

    def summary(ratios, never=0, best="2,4"):
        return {"ratio": stats.summarize(ratios), "never_reached": never, "best": best}

    assert tuning.call(summary([1.0, 0.99, 1.02]))[0] == "undecided"  # 3 rounds: no 95% CI
    assert tuning.call(summary([0.97, 0.99, 1.0, 1.01, 0.98, 1.02]))[0] == "roll out"
    twelve = [0.94, 0.96, 0.97, 0.98, 0.99, 0.99, 1.0, 1.0, 1.01, 1.02, 1.03, 1.04]
    call, label = tuning.call(summary(twelve, never=1))  # one round short: the interval holds it
    assert call == "roll out" and "(1 of 12 rounds never reached 95% of it)" in label
    assert tuning.call(summary([0.8, 0.85, 0.9, 0.82, 0.88, 0.86]))[0] == "roll back"
    assert tuning.call(summary([0.8, 0.99, 1.0, 1.01, 0.98, 1.02]))[0] == "undecided"
    assert tuning.call(summary([], best=None)) == (
        "undecided", "no fixed setting of the sweep stayed within the budget")
    assert tuning.settled_text([{"num_workers": 2, "prefetch_factor": 4}] * 2 + [
        {"num_workers": 1, "prefetch_factor": 2}]) == ("2 workers, prefetch 4 (2 rounds); "
                                                       "1 worker, prefetch 2 (1 round)")
