"""Study 2 (GPU decode placement) on a tiny corpus: the CPU arms run with both model stand-ins,
the GPU arms run on CUDA or say why they were not measured, both arms draw the same crops, and
the arms' batches are compared before any call."""

from __future__ import annotations

import json
import os

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
    check = result["check"]  # the warm-up batch (quick: 1 of 8 images) of each arm's first rep
    assert check["ok"] and check["batches_per_arm"] == 1
    if torch.cuda.is_available():
        assert [(p["arm"], p["against"], p["allowed_mean_levels"], p["images"])
                for p in check["pairs"]] == [
            ("gpu-decode inline / model cuda", "cpu-decode / model cuda", 9.6, 8),
            ("gpu-decode ahead / model cuda", "cpu-decode / model cuda", 9.6, 8),
            ("gpu-decode ahead / model cuda", "gpu-decode inline / model cuda", 0.0, 8)]
    else:  # the same decoder in both CPU arms: byte-identical
        assert check["pairs"] == [{"arm": "cpu-decode / model cpu",
                                   "against": "cpu-decode / model sleep",
                                   "allowed_mean_levels": 0.0, "images": 8,
                                   "worst_mean_levels": 0.0, "max_levels": 0.0, "ok": True}]
    text = (out / "gpu_decode.md").read_text()
    assert "not measured" in text and "GPU idle" in text and "[95% CI]" not in text
    assert "test_decode_jpeg_cuda" in text and "batches checked" in text
    finding = result["finding"]
    assert finding["text"].endswith(study_gpu_decode._checked(check))
    if torch.cuda.is_available():  # decode ahead on the GPU against CPU decode, paired
        ratio = arms["gpu-decode ahead / model cuda"]["vs_cpu_decode"]
        assert ratio["n"] == 6
        assert finding["label"] == "gpu-decode ahead: " + stats.decision(ratio, ok=True)[1]
    else:  # the question is not measured here: no call but "undecided", with what was seen
        assert finding["call"] == "undecided" and "no CUDA" in finding["text"]
        assert ("cpu-decode / model cpu byte-identical to cpu-decode / model sleep"
                in finding["text"])
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


def _batch(*values: int) -> torch.Tensor:
    """Images of 3 x 2 x 2, image i filled with values[i]."""
    return torch.tensor(values, dtype=torch.uint8).view(-1, 1, 1, 1).expand(-1, 3, 2, 2).clone()


def test_difference_is_measured_image_by_image():
    a = [_batch(10, 20), _batch(30)]
    assert study_gpu_decode.difference(a, [x.clone() for x in a]) == (3, 0.0, 0.0)
    off = [_batch(10, 20), _batch(30)]
    off[0][1, 0, 0, 0] = 32  # one value of image 1 off by 12: its mean is 1 over 12 values
    off[1] += 2  # every value of image 2 off by 2
    assert study_gpu_decode.difference(off, a) == (3, 2.0, 12.0)
    down = [_batch(5, 20), _batch(30)]  # below as much as above
    assert study_gpu_decode.difference(down, a) == (3, 5.0, 5.0)
    inf = float("inf")
    assert study_gpu_decode.difference([_batch(10)], a[:1]) == (0, inf, inf)  # other shapes
    assert study_gpu_decode.difference(a[:1], a) == (0, inf, inf)  # fewer batches
    assert study_gpu_decode.difference([], []) == (0, 0.0, 0.0)  # nothing compared


def test_arms_are_compared_with_cpu_decode_and_the_gpu_arms_with_each_other():
    cpu = ["cpu-decode / model sleep", "cpu-decode / model cpu"]
    assert study_gpu_decode.comparisons(cpu) == [(cpu[1], cpu[0], 0.0)]
    cuda = ["cpu-decode / model cuda", "gpu-decode inline / model cuda",
            "gpu-decode ahead / model cuda"]
    assert study_gpu_decode.comparisons(cuda) == [
        (cuda[1], cuda[0], 9.6), (cuda[2], cuda[0], 9.6), (cuda[2], cuda[1], 0.0)]
    assert study_gpu_decode.CPU_GPU_LEVELS == pytest.approx(2.0 + 1.0 + 6.6)


def test_the_check_passes_only_within_its_bounds():
    cpu, inline, ahead = ("cpu-decode / model cuda", "gpu-decode inline / model cuda",
                          "gpu-decode ahead / model cuda")
    base = [_batch(100, 200)]
    near = [_batch(109, 191)]  # 9 levels off: within 9.6
    c = study_gpu_decode.check({cpu: base, inline: near, ahead: [near[0].clone()]})
    assert c["ok"] and c["batches_per_arm"] == 1
    assert [(p["worst_mean_levels"], p["max_levels"], p["ok"]) for p in c["pairs"]] == [
        (9.0, 9.0, True), (9.0, 9.0, True), (0.0, 0.0, True)]
    far = [_batch(110, 200)]  # 10 levels off
    c = study_gpu_decode.check({cpu: base, inline: near, ahead: far})
    assert not c["ok"] and [p["ok"] for p in c["pairs"]] == [True, False, False]
    assert study_gpu_decode._compared(c["pairs"][2]) == (
        "DIFFERS from gpu-decode inline / model cuda (byte-identical expected; 2 images, the "
        "worst 9.00 levels off on average, the largest value 9)")
    sleep, busy = "cpu-decode / model sleep", "cpu-decode / model cpu"
    one_off = base[0].clone()
    one_off[0, 0, 0, 0] += 1
    assert not study_gpu_decode.check({sleep: base, busy: [one_off]})["ok"]  # not identical
    assert not study_gpu_decode.check({sleep: [], busy: []})["ok"]  # nothing compared


def test_the_gpu_arms_batches_pass_the_check_against_cpu_decode(tmp_path):
    """On CUDA: the CPU arm's images and nvJPEG's (inline and ahead) of the same samples and
    crops pass the study's check, with the bound it states."""
    if not torch.cuda.is_available():
        if os.environ.get("FASTMM_REQUIRE_CUDA") == "1":
            pytest.fail("FASTMM_REQUIRE_CUDA=1 but CUDA is not available")
        pytest.skip("needs CUDA (FASTMM_REQUIRE_CUDA=1 makes this fail)")
    from fastmm.bench.mmcorpus import CorpusSpec, write_corpus
    from fastmm.bench.pipelines import _files

    write_corpus(CorpusSpec(num_images=16, num_videos=0, seed=0), str(tmp_path / "c"))
    paths = _files(str(tmp_path / "c"), ("jpg",))
    torch.manual_seed(0)
    cpu = study_gpu_decode.Decoded(paths)
    images = [cpu[i] for i in range(len(paths))]
    torch.manual_seed(0)
    encoded = study_gpu_decode.Encoded(paths)
    batch = [encoded[i] for i in range(len(paths))]
    inline = study_gpu_decode.gpu_decode(batch, "cuda")
    ahead = study_gpu_decode.DecodeAhead(iter([batch]), "cuda")
    (decoded_ahead,) = list(ahead)
    ahead.close()
    c = study_gpu_decode.check({"cpu-decode / model cuda": [torch.stack(images)],
                                "gpu-decode inline / model cuda": [inline.cpu()],
                                "gpu-decode ahead / model cuda": [decoded_ahead.cpu()]})
    assert c["ok"], c["pairs"]
    assert [p["images"] for p in c["pairs"]] == [16, 16, 16]
