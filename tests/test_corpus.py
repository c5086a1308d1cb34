"""The multimodal corpus generator: deterministic bytes, a composition that matches the files,
the same samples through the posix and shards sources, frame indices readable after decoding,
and image sizes within the configured distribution."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil

import pytest

from fastmm.bench.mmcorpus import CorpusSpec, index_pattern, read_frame_index, write_corpus

if shutil.which("ffmpeg") is None:
    pytest.skip("the ffmpeg CLI is needed to encode corpus videos", allow_module_level=True)

CORPUS_SPEC = CorpusSpec(
    num_images=12, num_videos=3, seed=7, png_fraction=0.25, image_short_side=(120, 200),
    large_fraction=0.25, large_short_side=(1080, 1200), video_duration_s=(0.8, 1.6),
    video_fps=(24, 30), video_sizes=((96, 64), (128, 96)), video_keyint=(6, 12),
    shard_bytes=300_000,
)


def _hashes(root: str) -> dict[str, str]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _composition(out):
    with open(os.path.join(out, "composition.json")) as f:
        return json.load(f)


def _manifest(out):
    with open(os.path.join(out, "posix", "manifest.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_same_spec_same_bytes(corpus, tmp_path):
    out, comp = corpus, _composition(corpus)
    lines = []
    comp2 = write_corpus(CORPUS_SPEC, str(tmp_path / "again"), processes=2, progress=lines.append)
    assert lines and "done" in lines[-1]
    first, second = _hashes(out), _hashes(str(tmp_path / "again"))
    assert len(first) == 12 * 4 + 3 * 4 + 1 + 1 + comp["counts"]["shards"]
    assert first == second and comp == comp2
    other = write_corpus(dataclasses.replace(CORPUS_SPEC, seed=8, num_videos=0),
                         str(tmp_path / "o"))
    assert other["counts"]["images"] == 12
    h_other = _hashes(str(tmp_path / "o"))
    assert h_other["posix/image/000000.json"] != first["posix/image/000000.json"]


def test_composition_matches_files(corpus):
    from PIL import Image

    out, comp = corpus, _composition(corpus)
    manifest = _manifest(out)
    keys = [m["key"] for m in manifest]
    assert keys == sorted(keys) and len(keys) == 15
    assert keys == [f"image/{i:06d}" for i in range(12)] + [f"video/{i:06d}" for i in range(3)]
    c, b = comp["counts"], comp["bytes"]
    assert (c["samples"], c["images"], c["videos"]) == (15, 12, 3)
    size = {"jpg": 0, "png": 0, "mp4": 0, "text": 0}
    fmts, shorts, frames = {"jpg": 0, "png": 0}, [], []
    for m in manifest:
        assert set(m["members"]) in ({"jpg", "txt", "cls", "json"}, {"png", "txt", "cls", "json"},
                                     {"mp4", "txt", "cls", "json"})
        for ext, rel in m["members"].items():
            n = os.path.getsize(os.path.join(out, "posix", rel))
            size[ext if ext in size else "text"] += n
        meta = json.loads(open(os.path.join(out, "posix", m["members"]["json"])).read())
        label = open(os.path.join(out, "posix", m["members"]["cls"])).read()
        assert label == str(meta["label"])
        assert open(os.path.join(out, "posix", m["members"]["txt"])).read().strip()
        if meta["kind"] == "image":
            fmts[meta["format"]] += 1
            with Image.open(os.path.join(out, "posix", m["members"][meta["format"]])) as im:
                assert im.size == (meta["width"], meta["height"])
                assert im.format == {"jpg": "JPEG", "png": "PNG"}[meta["format"]]
            shorts.append(min(meta["width"], meta["height"]))
        else:
            frames.append(meta["frames"])
    assert (c["jpg"], c["png"]) == (fmts["jpg"], fmts["png"]) and c["png"] >= 1
    assert {k: b[k] for k in size} == size
    assert b["posix_total"] == sum(size.values())
    shard_files = sorted(os.listdir(os.path.join(out, "shards")))
    assert shard_files == comp["shards"] == [f"shard-{i:06d}.tar" for i in range(c["shards"])]
    assert c["shards"] > 1  # shard_bytes splits this corpus
    assert b["shards_total"] == sum(os.path.getsize(os.path.join(out, "shards", s))
                                    for s in shard_files)
    hist = comp["image_short_side_hist"]
    edges = hist["edges"]
    assert hist["counts"] == [sum(1 for s in shorts if lo <= s < hi)
                              for lo, hi in zip(edges, edges[1:])]
    fh = comp["video_frames_hist"]
    assert fh["counts"] == [sum(1 for n in frames if lo <= n < hi)
                            for lo, hi in zip(fh["edges"], fh["edges"][1:])]
    assert c["video_frames"] == sum(frames)
    assert sum(comp["video_fps"].values()) == 3 and set(comp["video_fps"]) <= {"24", "30"}
    assert c["large_images"] == sum(1 for s in shorts if s >= 1080)


def test_posix_and_shards_read_the_same_samples(corpus):
    from fastmm.sources import open_source

    out = corpus
    manifest = _manifest(out)
    posix = open_source("posix", os.path.join(out, "posix", "manifest.jsonl"))
    shards = open_source("shards", os.path.join(out, "shards"))
    expected = {}
    for m in manifest:
        expected[m["key"]] = {
            ext: open(os.path.join(out, "posix", rel), "rb").read()
            for ext, rel in m["members"].items()}
    for src in (posix, shards):
        got = {s.key: dict(s.members) for s in src.iter_samples()}
        assert got == expected
    assert posix.keys() == shards.keys() == [m["key"] for m in manifest]


def test_frame_indices_decoded_by_torchcodec(corpus):
    pytest.importorskip("torchcodec")
    from fastmm.decode import ClipSpec, get_decoder

    out = corpus
    dec = get_decoder("torchcodec")
    videos = [m for m in _manifest(out) if "mp4" in m["members"]]
    assert len(videos) == 3
    for m in videos:
        meta = json.loads(open(os.path.join(out, "posix", m["members"]["json"])).read())
        data = open(os.path.join(out, "posix", m["members"]["mp4"]), "rb").read()
        n = meta["frames"]
        for spec in (ClipSpec(num_frames=4), ClipSpec(num_frames=3, stride=5),
                     ClipSpec(num_frames=5, sampling="uniform"),
                     ClipSpec(num_frames=3, stride=2, sampling="random", seed=3)):
            clip, idx = dec.decode_clip(data, spec, key=m["key"])
            assert clip.shape[1:] == (3, meta["height"], meta["width"])
            assert [read_frame_index(f) for f in clip] == idx
        assert idx[-1] < n
        clip, idx = dec.decode_clip(data, ClipSpec(num_frames=2, stride=n - 1), key=m["key"])
        assert idx == [0, n - 1] and [read_frame_index(f) for f in clip] == idx


def test_index_pattern_roundtrip():
    import numpy as np
    import torch

    for i in (0, 1, 47, 1234, 65535):
        frame = np.zeros((96, 128, 3), np.uint8)
        frame[:64, :64] = index_pattern(i)
        assert read_frame_index(frame) == i
        assert read_frame_index(torch.from_numpy(frame).permute(2, 0, 1)) == i


def test_resolution_distribution(corpus, tmp_path):
    out = corpus
    sizes = [(json.loads(open(os.path.join(out, "posix", m["members"]["json"])).read()))
             for m in _manifest(out) if "mp4" not in m["members"]]
    shorts = [min(s["width"], s["height"]) for s in sizes]
    longs = [max(s["width"], s["height"]) for s in sizes]
    ratios = max(CORPUS_SPEC.aspect_ratios)
    for s, l in zip(shorts, longs):
        assert 120 <= s <= 200 or 1080 <= s <= 1200
        assert s <= l <= round(s * ratios)
    assert any(s >= 1080 for s in shorts) and any(s <= 200 for s in shorts)  # tail present
    no_tail = CorpusSpec(num_images=40, num_videos=0, large_fraction=0.0)
    from fastmm.bench.mmcorpus import image_size

    assert all(300 <= min(image_size(no_tail, i)) <= 500 for i in range(200))
    all_tail = CorpusSpec(num_images=40, num_videos=0, large_fraction=1.0)
    assert all(1080 <= min(image_size(all_tail, i)) <= 2160 for i in range(50))
    # ImageNet-like default with a small 1080p+ tail
    default = CorpusSpec()
    shorts = [min(image_size(default, i)) for i in range(2000)]
    tail = sum(1 for s in shorts if s >= 1080) / len(shorts)
    assert 0.02 < tail < 0.09 and all(300 <= s <= 500 or s >= 1080 for s in shorts)


def test_bad_spec_is_refused():
    with pytest.raises(ValueError, match="png_fraction"):
        CorpusSpec(png_fraction=1.5)
    with pytest.raises(ValueError, match="video_sizes"):
        CorpusSpec(video_sizes=((63, 64),))
    with pytest.raises(ValueError, match="image_short_side"):
        CorpusSpec(image_short_side=(500, 300))
    for bad in ({"video_fps": (0,)}, {"video_keyint": (30, 2.5)}, {"video_crf": 60},
                {"seed": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CorpusSpec(**bad)


@pytest.mark.parametrize("argv", [["--fps", "0"], ["--keyint", "abc"], ["--images", "-5"],
                                  ["--seed", "-1"], ["--shard-bytes", "0"],
                                  ["--video-sizes", "64x"]])
def test_cli_refuses_a_bad_value_before_any_work(tmp_path, capsys, argv):
    from fastmm.bench.mmcorpus import main

    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path / "c"), *argv])
    assert exit_.value.code == 2 and f"argument {argv[0]}" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_cli(tmp_path, capsys):
    from fastmm.bench.mmcorpus import main

    assert main(["--out", str(tmp_path / "c"), "--images", "3", "--videos", "1",
                 "--duration", "0.5", "0.5", "--fps", "24", "--video-sizes", "64x64",
                 "--keyint", "4", "--processes", "1"]) == 0
    cap = capsys.readouterr()
    assert "mmcorpus:" in cap.err
    printed = json.loads(cap.out)
    assert printed["counts"]["samples"] == 4 and printed["counts"]["video_frames"] == 12
    assert os.path.exists(tmp_path / "c" / "shards" / "shard-000000.tar")


def test_procedural_fallback(tmp_path):
    spec = dataclasses.replace(CORPUS_SPEC, num_images=2, num_videos=1, photos="procedural",
                               large_fraction=0.0)
    comp = write_corpus(spec, str(tmp_path))
    assert comp["photos"] == "procedural" and comp["counts"]["samples"] == 3
    assert all(k.startswith("procedural-") for k in comp["sources"])


def test_videos_without_the_ffmpeg_cli_go_through_pyav(tmp_path, monkeypatch):
    """The GPU machine has no ffmpeg CLI: PyAV's FFmpeg encodes the same frames instead."""
    pytest.importorskip("av")
    pytest.importorskip("torchcodec")
    from fastmm.bench import mmcorpus
    from fastmm.decode import ClipSpec, get_decoder

    monkeypatch.setattr(mmcorpus.shutil, "which", lambda name: None)
    spec = dataclasses.replace(CORPUS_SPEC, num_images=0, num_videos=1)
    comp = write_corpus(spec, str(tmp_path))
    assert comp["tools"]["ffmpeg"].startswith("PyAV")
    (video,) = [m for m in _manifest(str(tmp_path)) if "mp4" in m["members"]]
    data = open(os.path.join(str(tmp_path), "posix", video["members"]["mp4"]), "rb").read()
    clip, idx = get_decoder("torchcodec").decode_clip(data, ClipSpec(num_frames=4, stride=3),
                                                      key=video["key"])
    assert [read_frame_index(f) for f in clip] == idx == [0, 3, 6, 9]
