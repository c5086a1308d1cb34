"""The decode-rates benchmark (CPU and GPU decode rates, the crossover) on a tiny corpus: the CPU
arms run everywhere; the GPU arms run on CUDA or say why not; and with the GPU arms pointed at
the CPU, every figure they feed (crossover, pixel and frame checks) is computed."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("torchvision")
pytest.importorskip("torchcodec")

from fastmm.bench import decode_rates  # noqa: E402
from fastmm.bench.report import busy_notes  # noqa: E402


def _run(tmp_path, *extra):
    out = tmp_path / "out"
    assert decode_rates.main(["--quick", "--out", str(out), "--cache-dir",
                              str(tmp_path / "cache"), *extra]) == 0
    return json.loads((out / "decode_rates.json").read_text()), (out / "decode_rates.md").read_text()


@pytest.mark.slow
def test_rates_on_this_machine(tmp_path):
    result, text = _run(tmp_path)
    assert result["images"] and result["videos"]
    # whether the machine was busy is measured in every repetition of every arm (--quick: 2)
    others = result["other_processes_cpu_cores"]
    assert len(others) == 2 * (len(result["images"]) + len(result["videos"]))
    assert all(c >= 0 for c in others)
    assert result["busy"] == busy_notes("decode rates", others)
    for arm in [*result["images"].values(), *result["videos"].values()]:
        assert arm["rates"]["cpu 1 thread"]["median"] > 0
    if torch.cuda.is_available():
        assert result["gpu_images"]["measured"]
        assert all(a["cores_matching_gpu"] > 0 for a in result["images"].values())
    else:
        assert "no CUDA" in result["gpu_images"]["why"] and "no CUDA" in result["nvdec"]["why"]
        assert "nvJPEG not measured" in text and "NVDEC not measured" in text


@pytest.mark.slow
def test_gpu_arms_plumbing_pointed_at_the_cpu(tmp_path):
    result, text = _run(tmp_path, "--accelerator", "cpu")
    for arm in result["images"].values():
        assert set(arm["rates"]) == {"cpu 1 thread", "gpu batch 1", "gpu batch 8", "gpu batch 64"}
        assert arm["cores_matching_gpu"] > 0 and arm["gpu_vs_cpu_mean_abs_diff"] == 0
    for arm in result["videos"].values():
        assert arm["nvdec_frames_right"] is True and arm["nvdec_vs_cpu_mean_abs_diff"] == 0
        assert arm["cores_matching_gpu"] > 0
    assert result["nvdec"]["measured"] and "not measured" not in text


@pytest.mark.slow
def test_the_crossover_reaches_the_main_jobs_index(tmp_path):
    """Where the GPU arms were measured (here pointed at the CPU, for the plumbing), the finding
    says how many cores one GPU matches per class, and the main job's index shows it with the
    crossover plot."""
    from _browser import render

    from fastmm.bench import suite

    _run(tmp_path, "--accelerator", "cpu")
    (tmp_path / "out").rename(tmp_path / "decode-rates")
    result = json.loads((tmp_path / "decode-rates" / "decode_rates.json").read_text())
    classes = [f"{name} {a['cores_matching_gpu']:.1f}" for name, a in result["images"].items()]
    assert result["finding"]["call"] == "undecided"
    assert all(c in result["finding"]["text"] for c in classes)
    part = next(p for p in suite.PARTS if p.name == "decode-rates")
    suite.index(str(tmp_path), [(part, 0, 10.0)], 10.0)
    seen = render(tmp_path / "index.html")
    assert result["finding"]["text"] in seen["answer"][0]
    assert list(seen["plots"]) == ["decode-rates-crossover"]
    assert all(w > 100 and h > 100 for w, h in seen["plots"].values())
