"""The bundled experiment end to end on a tiny corpus: baseline + one-factor arms, correctness
checks that pass where outputs must agree and fail where they do not, CIs, and the reports."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("torchvision")
pytest.importorskip("matplotlib")

from fastmm.bench import experiment  # noqa: E402

CONFIG = """
[step]
name = "tiny"
per_device_batch = 4
compute = "sleep"
compute_ms = 5
[data]
images = 24
videos = 0
seed = 1
[loader]
num_workers = 2
prefetch_factor = 2
[experiment]
reps = 5
warmup_batches = 1
batches = 2
[[ab]]
factor = "loader"
value = "fastmm"
[[ab]]
factor = "dataset"
value = "fastmm-pil"
[[ab]]
factor = "dataset"
value = "fastmm-fast"
[[ab]]
factor = "num_workers"
value = 1
"""


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    root = tmp_path_factory.mktemp("experiment")
    config = root / "step.toml"
    config.write_text(CONFIG)
    out = root / "out"
    assert experiment.main(["--config", str(config), "--out", str(out),
                            "--cache-dir", str(root / "cache")]) == 0
    return out, json.loads((out / "experiment.json").read_text())


def test_every_arm_changes_one_factor_and_passes_its_check(ran):
    _, result = ran
    arms = result["arms"]
    base = arms["baseline"]["settings"]
    assert list(arms) == ["baseline", "loader=fastmm", "dataset=fastmm-pil",
                          "dataset=fastmm-fast", "num_workers=1"]
    for name, arm in arms.items():
        changed = {k for k in base if arm["settings"][k] != base[k]}
        assert changed == (set() if name == "baseline" else {arm["factor"]})
        assert arm["correctness"]["ok"] and arm["correctness"]["runs"] == 5, name
        s = arm["samples_per_s"]
        assert s["n"] == 5 and s["ci_low"] <= s["median"] <= s["ci_high"]
        if name != "baseline":
            assert arm["ratio"]["n"] == 5
    checks = {n: a["correctness"]["check"] for n, a in arms.items()}
    assert checks["loader=fastmm"] == checks["dataset=fastmm-pil"] == "every batch byte-identical"
    assert "pixel" in checks["dataset=fastmm-fast"]
    assert result["global_batch"] == 4 and result["environment"]["loader_config"]["num_workers"] == 2
    assert result["bottleneck"]["observed"]


def test_reports_are_written_and_self_contained(ran):
    out, result = ran
    md = (out / "report.md").read_text()
    for section in ("## Environment", "## Data and step", "## Baseline profile",
                    "## Experiment matrix and results", "## Traces", "## Sources"):
        assert section in md
    assert "Observed (measured)" in md and "Hypotheses (not measured)" in md
    assert md.count("(read 2026-") == len(experiment.SOURCES)
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(result["arms"])
    assert {line.count("|") for line in rows} == {10}  # no cell splits into two
    html = (out / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "<table>" in html
    assert re.search(r'<img [^>]*src="data:image/png;base64,', html)
    assert not re.search(r'src="(?!data:)', html)  # nothing fetched from elsewhere
    trace = json.loads((out / "traces" / "baseline" / "trace.json").read_text())
    assert any(e["ph"] == "X" and e["name"] == "sample" for e in trace["traceEvents"])


def test_correctness_checks_fail_when_outputs_differ():
    base = {"digest": "1", "order_digest": "a", "first": torch.zeros(2, 3, 4, 4)}
    assert not experiment.correctness("bytes", dict(base, digest="2"), base)["ok"]
    assert not experiment.correctness("order", dict(base, order_digest="b"), base)["ok"]
    far = dict(base, first=torch.full((2, 3, 4, 4), 9))
    check = experiment.correctness("pixels", far, base)
    assert not check["ok"] and check["mean_abs_diff"] == 9
    assert experiment.correctness("pixels", dict(base), base)["ok"]


def test_config_refuses_what_the_method_does_not_allow(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(CONFIG.replace("reps = 5", "reps = 3"))
    with pytest.raises(ValueError, match="at least 5"):
        experiment.Config.load(str(path))
    path.write_text(CONFIG.replace('factor = "loader"', 'factor = "colour"'))
    with pytest.raises(ValueError, match="factor 'colour'"):
        experiment.Config.load(str(path))
    path.write_text(CONFIG.replace('compute = "sleep"', 'compute = "quantum"'))
    with pytest.raises(ValueError, match="compute='quantum'"):
        experiment.Config.load(str(path))


def test_html_report_renders_in_a_headless_browser(ran, tmp_path):
    """Chromium loads the page: the plot decodes (its natural width is known only after) and
    every table row is there."""
    import os
    import shutil
    import subprocess

    browser = next((b for b in ("chromium", "chromium-browser", "google-chrome")
                    if shutil.which(b)), None)
    if browser is None:
        if os.environ.get("FASTMM_REQUIRE_BROWSER") == "1":
            pytest.fail("FASTMM_REQUIRE_BROWSER=1 but no chromium on PATH")
        pytest.skip("no headless browser (apt-get install chromium; FASTMM_REQUIRE_BROWSER=1 "
                    "makes this fail)")
    out, result = ran
    probe = tmp_path / "probe.html"
    probe.write_text((out / "report.html").read_text().replace("</body>", (
        "<script>window.addEventListener('load', () => {document.body.dataset.images = "
        "[...document.images].map(i => i.naturalWidth).join(','); document.body.dataset.rows = "
        "document.querySelectorAll('tr').length;});</script></body>")))
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          probe.as_uri()], capture_output=True, text=True, timeout=120).stdout
    images = re.search(r'data-images="([^"]*)"', dom).group(1).split(",")
    assert images and all(int(w) > 100 for w in images), images
    rows = int(re.search(r'data-rows="(\d+)"', dom).group(1))
    assert rows == 1 + len(result["arms"])


def test_suite_runs_its_parts_and_links_their_reports(tmp_path):
    from fastmm.bench import suite

    out = tmp_path / "out"
    assert suite.main(["--quick", "--only", "staging", "--out", str(out),
                       "--cache-dir", str(tmp_path / "cache")]) == 0
    index = (out / "index.md").read_text()
    assert "| staging | ok |" in index and "(staging/staging.md)" in index
    assert (out / "staging" / "staging.md").exists()
    assert "staging/staging.md" in (out / "index.html").read_text()
