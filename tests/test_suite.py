"""The main job's index: one page that leads with every part's answer and call, alerts for
failed parts and busy repetitions next to them, each part's plots inline and its report linked
as HTML; the console's last line names the page."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torchvision")
pytest.importorskip("matplotlib")

from fastmm.bench import stats, suite  # noqa: E402
from _browser import render  # noqa: E402

PARTS = {p.name: p for p in suite.PARTS}


@pytest.mark.slow
def test_suite_runs_a_part_and_its_index_leads_with_its_finding(tmp_path, capsys):
    """A real run of one part (Study 2, the quickest) through the job's own command line."""
    out = tmp_path / "out"
    assert suite.main(["--quick", "--only", "gpu-decode", "--out", str(out),
                       "--cache-dir", str(tmp_path / "cache")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"report: {os.path.abspath(out / 'index.html')}")
    finding = json.loads((out / "gpu-decode" / "gpu_decode.json").read_text())["finding"]
    seen = render(out / "index.html")
    assert seen["answer"][0] == (f"Study 2: GPU decode placement: {finding['text']} "
                                 f"Call: {finding['call']} ({finding['label']}).")
    assert seen["plots"] and all(name.startswith("gpu-decode-") for name in seen["plots"])
    assert all(w == 1000 and h > 150 for w, h in seen["plots"].values())
    assert seen["links"] == ["gpu-decode/report.html"] * 2  # the parts table and the section
    assert (out / "gpu-decode" / "report.html").exists() and seen["external"] == []
    md = (out / "index.md").read_text()
    assert finding["text"] in md and "| gpu-decode | ok |" in md
    assert "(gpu-decode/report.html)" in md


@pytest.mark.slow
def test_index_shows_the_pipelines_answer_and_plots_and_says_what_failed(tmp_path):
    """The pipeline part (a real quick fastmm-bench --dataset run) leads the page with its
    answer sentences, then its busy notes and alerts; its plots are inline; a part that failed
    without results is an alert, not a crash."""
    import subprocess
    import sys

    pipe = os.path.join(os.path.dirname(__file__), "_user_pipeline.py")
    subprocess.run([sys.executable, "-m", "fastmm.bench", "--dataset", f"{pipe}:shapes",
                    "--step", f"{pipe}:train_step", "--batch-size", "8", "--num-workers", "2",
                    "--quick", "--arms", "fastmm", "--out", str(tmp_path / "pipeline")],
                   check=True, timeout=600, capture_output=True)
    result = json.loads((tmp_path / "pipeline" / "results.json").read_text())
    html, md = suite.index(str(tmp_path), [(PARTS["pipeline"], 0, 150.0),
                                           (PARTS["shards"], 1, 12.0)], 162.0)
    seen = render(tmp_path / "index.html")
    failed = ("shards failed (exit 1) after 12 s: no figures from it; its output is in the "
              "console above.")
    notes = result["busy"] + result["alerts"]
    assert seen["answer"] == result["answer"] + notes + [failed]
    assert seen["alerts"] == notes + [failed]
    assert list(seen["plots"]) == [f"pipeline-{name}" for name in (
        "headline", "ratios", "rates", "queue-wait", "step-time", "memory")]
    assert all(w > 100 and h > 100 for w, h in seen["plots"].values())
    assert seen["links"] == ["pipeline/index.html"] * 2  # no link to a report not written
    assert "**shards failed (exit 1)" in open(md).read()


@pytest.mark.slow
def test_loader_part_gets_an_html_report_and_a_sentence_in_the_index(tmp_path):
    """fastmm-bench's side-by-side run (small clips, 2 repetitions): its report.html shows the
    finding and a rates plot per case; with 2 repetitions the call can only be "undecided"."""
    import subprocess
    import sys

    from fastmm.bench import report

    out = tmp_path / "loader"
    subprocess.run([sys.executable, "-m", "fastmm.bench", "--quick", "--workloads", "transport",
                    "--clip-modes", "view", "--reps", "2", "--mem-reps", "1", "--min-seconds",
                    "0.2", "--warmup-seconds", "0.05", "--clip-shape", "2,3,16,16", "--out",
                    str(out), "--cache-dir", str(tmp_path / "cache")], check=True, timeout=300)
    results = json.loads((out / "results.json").read_text())
    summary = results["cases"][0]["summary"]
    finding = report.finding(results)
    assert (finding["call"], finding["label"]) == (
        "undecided", stats.decision(summary["paired_ratios_fastmm_over_torch"], ok=True)[1])
    assert stats.interval(summary["paired_ratios_fastmm_over_torch"], 2, "x") in finding["text"]
    assert "(range of 2)" in finding["label"]
    suite.index(str(tmp_path), [(PARTS["loader"], 0, 20.0)], 20.0)  # writes loader/report.html
    page = render(out / "report.html")
    assert page["answer"][:2] == [finding["text"], f"Call: undecided ({finding['label']})."]
    assert page["answer"][2:] == page["alerts"] == report.busy(results)
    assert list(page["plots"]) == ["rates-transport-view-b32"]
    assert page["plots"]["rates-transport-view-b32"][0] == 1000 and page["tables"] == [1 + 5]
    index = render(tmp_path / "index.html")
    assert index["answer"][0] == (f"Transport: batches of clips from memory: {finding['text']} "
                                  f"Call: undecided ({finding['label']}).")
    assert list(index["plots"]) == ["loader-rates-transport-view-b32"]
    assert index["links"] == ["loader/report.html"] * 2
