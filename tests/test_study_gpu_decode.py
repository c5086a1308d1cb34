"""Study 2 (GPU decode placement) on a tiny corpus: the CPU arms run with both model stand-ins,
the GPU arms run on CUDA or say why they were not measured, and both arms draw the same crops."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("torchvision")

from fastmm.bench import stats, study_gpu_decode  # noqa: E402
from _browser import render  # noqa: E402


@pytest.mark.slow
def test_gpu_decode_study_end_to_end(tmp_path):
    out = tmp_path / "out"
    assert study_gpu_decode.main(["--quick", "--out", str(out), "--cache-dir",
                                  str(tmp_path / "cache"), "--compute-ms", "10"]) == 0
    result = json.loads((out / "gpu_decode.json").read_text())
    arms = result["arms"]
    measured = {k for k, a in arms.items() if a["measured"]}
    if torch.cuda.is_available():
        assert measured == {"cpu-decode / model cuda", "gpu-decode inline / model cuda",
                            "gpu-decode ahead / model cuda"}
    else:
        assert measured == {"cpu-decode / model sleep", "cpu-decode / model cpu"}
        for arm in ("gpu-decode inline", "gpu-decode ahead"):
            assert "no CUDA" in arms[f"{arm} / model cuda"]["why"]
        assert arms["cpu-decode / model sleep"]["model_step_s_alone"] == pytest.approx(0.010,
                                                                                        abs=0.005)
    for name in measured:
        assert arms[name]["samples_per_s"]["n"] == 6 and arms[name]["samples_per_s"]["median"] > 0
    text = (out / "gpu_decode.md").read_text()
    assert "not measured" in text and "GPU idle" in text and "[95% CI]" not in text
    finding = result["finding"]
    if torch.cuda.is_available():  # decode ahead on the GPU against CPU decode, paired
        ratio = arms["gpu-decode ahead / model cuda"]["vs_cpu_decode"]
        assert ratio["n"] == 6
        assert finding["label"] == "gpu-decode ahead: " + stats.decision(ratio)[1]
    else:  # the question is not measured here: no call but "undecided", with what was seen
        assert finding["call"] == "undecided" and "no CUDA" in finding["text"]
        rate = stats.interval(arms["cpu-decode / model sleep"]["samples_per_s"], 0, " samples/s")
        assert rate in finding["label"] and rate in finding["text"]
    seen = render(out / "report.html")
    assert seen["answer"][:2] == [finding["text"],
                                  f"Call: {finding['call']} ({finding['label']})."]
    assert seen["answer"][2:] == seen["alerts"] == result["busy"]
    assert list(seen["plots"]) == (
        ["rates", "vs-cpu-decode"] if torch.cuda.is_available() else ["rates"])
    assert all(w == 1000 and h > 150 for w, h in seen["plots"].values())
    assert seen["tables"] == [1 + len(arms)] and seen["external"] == []


def test_both_placements_draw_the_same_crops(tmp_path):
    """The GPU arm's worker plans the crop exactly as the CPU arm's decoder does."""
    from fastmm.bench.mmcorpus import CorpusSpec, write_corpus
    from fastmm.bench.pipelines import _files

    write_corpus(CorpusSpec(num_images=6, num_videos=0, seed=4), str(tmp_path / "c"))
    paths = _files(str(tmp_path / "c"), ("jpg",))
    for i in range(len(paths)):
        torch.manual_seed(i)
        cpu = study_gpu_decode.Decoded(paths)[i]
        torch.manual_seed(i)
        data, plan = study_gpu_decode.Encoded(paths)[i]
        images = study_gpu_decode.gpu_decode([(data, plan)], "cpu") if not \
            torch.cuda.is_available() else None
        if images is not None:  # torchvision decodes on the CPU too: the same crop, same size
            assert images.shape[1:] == cpu.shape
            assert (images[0].float() - cpu.float()).abs().mean() < 3.0



def _encoded_batches(tmp_path, n=6, batch=2):
    from fastmm.bench.mmcorpus import CorpusSpec, write_corpus
    from fastmm.bench.pipelines import _files

    write_corpus(CorpusSpec(num_images=n, num_videos=0, seed=5), str(tmp_path / "c"))
    ds = study_gpu_decode.Encoded(_files(str(tmp_path / "c"), ("jpg",)))
    return [[ds[i] for i in range(k, k + batch)] for k in range(0, len(ds), batch)]


def test_decoding_ahead_hands_over_every_batch_in_order(tmp_path):
    """The thread that decodes ahead (on the CPU here; on its own CUDA stream on a GPU) gives
    the batches the loop would have decoded itself, in order, and then stops."""
    batches = _encoded_batches(tmp_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ahead = study_gpu_decode.DecodeAhead(iter(batches), device)
    got = list(ahead)
    ahead.close()
    assert len(got) == len(batches)
    for images, batch in zip(got, batches):
        assert torch.equal(images.cpu(), study_gpu_decode.gpu_decode(batch, device).cpu())


def test_decoding_ahead_raises_a_decode_error_in_the_loop_and_closes_early(tmp_path):
    batches = _encoded_batches(tmp_path)
    broken = batches[:1] + [[(torch.zeros(10, dtype=torch.uint8), batches[1][0][1])]]
    ahead = study_gpu_decode.DecodeAhead(iter(broken), "cpu")
    it = iter(ahead)
    next(it)
    with pytest.raises(RuntimeError):
        next(it)
    ahead.close()
    waiting = study_gpu_decode.DecodeAhead(iter(batches * 4), "cpu", depth=1)
    next(iter(waiting))  # the thread is now blocked on a full queue: close() must still end it
    waiting.close()
    assert not waiting._thread.is_alive()
