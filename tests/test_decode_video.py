"""Video clips through torchcodec: the frames asked for (each frame draws its own index in its
pixels), caps checked from metadata before decoding, and bad input as DecodeError."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
import torch

from fastmm.decode import ClipSpec, DecodeError, DecodeLimitError, DecodeLimits, get_decoder

try:
    import torchcodec  # noqa: F401
except Exception:
    if os.environ.get("FASTMM_REQUIRE_VIDEO") == "1":
        raise
    pytest.skip("torchcodec is not importable (FASTMM_REQUIRE_VIDEO=1 makes this fail)",
                allow_module_level=True)

if shutil.which("ffmpeg") is None:
    if os.environ.get("FASTMM_REQUIRE_VIDEO") == "1":
        raise RuntimeError("FASTMM_REQUIRE_VIDEO=1 but the ffmpeg CLI is not on PATH")
    pytest.skip("the ffmpeg CLI is needed to make test videos", allow_module_level=True)

W, H, BLOCK = 64, 64, 16  # 16 blocks of 16x16 px, one bit each: frame index up to 65535


def index_frame(i: int) -> np.ndarray:
    """HxWx3 uint8 frame whose blocks spell i in binary (white = 1), robust to compression."""
    bits = [(i >> b) & 1 for b in range(16)]
    grid = np.array(bits, dtype=np.uint8).reshape(4, 4) * 255
    return np.repeat(np.repeat(grid, BLOCK, 0), BLOCK, 1)[:, :, None].repeat(3, 2)


def read_index(frame: torch.Tensor) -> int:
    """Index drawn in a decoded CxHxW frame (the block means, thresholded)."""
    means = frame.float().mean(0).reshape(4, BLOCK, 4, BLOCK).mean((1, 3)).flatten()
    return sum(1 << b for b in range(16) if means[b] > 128)


# How the test MP4s are laid out: "fragmented" (moof boxes, as streamed), "moov at end" (as
# ffmpeg writes a file), "faststart" (moov first, as served on the web). Only the last two have
# the sample tables that the torchcodec decoder slims (decode.mp4).
LAYOUTS = {"fragmented": ["-movflags", "frag_keyframe+empty_moov"], "moov at end": [],
           "faststart": ["-movflags", "+faststart"]}


def make_mp4(num_frames: int, fps: int = 24, keyint: int = 8, layout: str = "fragmented",
             codec: list[str] = ("-c:v", "libx264"), audio: bool = False) -> bytes:
    raw = b"".join(index_frame(i).tobytes() for i in range(num_frames))
    sound = (["-f", "lavfi", "-t", str(num_frames / fps), "-i", "sine=frequency=440:sample_rate=8000"]
             if audio else [])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "v.mp4")  # a file: only a fragmented MP4 can go to a pipe
        cmd = ["ffmpeg", "-v", "error", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{W}x{H}",
               "-r", str(fps), "-i", "-", *sound, *codec, "-g", str(keyint), "-pix_fmt",
               "yuv420p", *(["-c:a", "aac"] if audio else []), *LAYOUTS[layout], out]
        subprocess.run(cmd, input=raw, capture_output=True, check=True)
        with open(out, "rb") as f:
            return f.read()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def mp4(request) -> bytes:
    return make_mp4(48, layout=request.param)


@pytest.fixture(scope="module")
def dec():
    return get_decoder("torchcodec")


def test_index_pattern_roundtrip():
    for i in (0, 1, 47, 1234, 65535):
        assert read_index(torch.from_numpy(index_frame(i)).permute(2, 0, 1)) == i


def _check(clip, idx, n):
    assert clip.dtype == torch.uint8 and clip.shape == (n, 3, H, W)
    assert [read_index(f) for f in clip] == idx


@pytest.mark.parametrize("spec,expected", [
    (ClipSpec(num_frames=4), [0, 1, 2, 3]),
    (ClipSpec(num_frames=5, stride=4), [0, 4, 8, 12, 16]),
    (ClipSpec(num_frames=4, fps=6.0), [0, 4, 8, 12]),
    (ClipSpec(num_frames=6, sampling="uniform"), [0, 9, 19, 28, 38, 47]),
    (ClipSpec(num_frames=2, stride=47), [0, 47]),
])
def test_clip_frames_are_the_frames_asked_for(dec, mp4, spec, expected):
    clip, idx = dec.decode_clip(mp4, spec, key="v")
    assert idx == expected
    _check(clip, idx, spec.num_frames)


@pytest.mark.parametrize("box", [(0, 0, H, W), (3, 7, 41, 50), (16, 0, 48, 32)])
@pytest.mark.parametrize("out,flip", [((41, 50), False), ((24, 20), True)])
def test_resized_clip_crops_in_the_decoder_as_cropping_afterwards(dec, mp4, box, out, flip):
    """decode_resized_clip crops inside FFmpeg: the same pixels as decode_clip + crop_resize,
    odd offsets included; the plan sees the frame size (width, height)."""
    from fastmm.decode.base import CropPlan, crop_resize

    seen = []

    def plan(width, height):
        seen.append((width, height))
        return CropPlan(*box, *out, flip)

    spec = ClipSpec(num_frames=5, stride=3, sampling="start")
    clip, idx = dec.decode_resized_clip(mp4, spec, plan, key="v")
    full, full_idx = dec.decode_clip(mp4, spec, key="v")
    assert seen == [(W, H)] and idx == full_idx == [0, 3, 6, 9, 12]
    assert torch.equal(clip, crop_resize(full, CropPlan(*box, *out, flip)))
    assert clip.shape == (5, 3, *out)


def test_random_clips_seeded_and_from_generator(dec, mp4):
    spec = ClipSpec(num_frames=4, stride=3, sampling="random", seed=11)
    starts = set()
    for k in range(12):
        clip, idx = dec.decode_clip(mp4, spec, key=f"v{k}")
        _check(clip, idx, 4)
        assert [i - idx[0] for i in idx] == [0, 3, 6, 9] and 0 <= idx[0] <= 48 - 10
        assert dec.decode_clip(mp4, spec, key=f"v{k}")[1] == idx  # same key, same clip
        starts.add(idx[0])
    assert len(starts) > 3
    g = torch.Generator().manual_seed(0)
    clip, idx = dec.decode_clip(mp4, ClipSpec(num_frames=3, sampling="random"), generator=g)
    assert idx == ClipSpec(num_frames=3, sampling="random").frame_indices(
        48, generator=torch.Generator().manual_seed(0))
    _check(clip, idx, 3)


def test_caps_checked_from_metadata_before_decoding(dec, mp4, monkeypatch):
    import torchcodec.decoders

    def never(*a, **k):
        raise AssertionError("decoded frames although the clip was over a cap")

    monkeypatch.setattr(torchcodec.decoders.VideoDecoder, "get_frames_at", never)
    small = {"max_clip_frames": 3}, {"max_clip_pixels": 4 * W * H - 1}, {"max_image_pixels": 100}
    for kw in small:
        d = get_decoder("torchcodec", limits=DecodeLimits(**kw))
        with pytest.raises(DecodeLimitError) as e:
            d.decode_clip(mp4, ClipSpec(num_frames=4), key="big")
        assert e.value.key == "big" and e.value.reason == "too_large"


def test_caps_at_the_limit_pass(mp4):
    d = get_decoder("torchcodec", limits=DecodeLimits(max_clip_frames=4,
                                                     max_clip_pixels=4 * W * H))
    clip, idx = d.decode_clip(mp4, ClipSpec(num_frames=4), key="ok")
    _check(clip, idx, 4)


def test_too_short_video(dec):
    with pytest.raises(DecodeError) as e:
        dec.decode_clip(make_mp4(5), ClipSpec(num_frames=4, stride=2), key="short")
    assert (e.value.reason, e.value.key) == ("too_short", "short")


@pytest.mark.parametrize("name", ["empty", "text", "truncated", "random", "png", "audio_only",
                                  "zero_frames", "moov_truncated"])
def test_bad_video_raises_decode_error_with_key(dec, mp4, name):
    if name == "png":  # wrong extension: an image stored as .mp4 makes a one-frame "video"
        from PIL import Image
        import io

        buf = io.BytesIO()
        Image.fromarray(index_frame(3)).save(buf, "PNG")
        data = buf.getvalue()
    elif name == "audio_only":
        data = subprocess.run(
            ["ffmpeg", "-v", "error", "-f", "lavfi", "-i", "anullsrc=r=8000:cl=mono", "-t",
             "0.5", "-c:a", "aac", "-movflags", "frag_keyframe+empty_moov", "-f", "mp4", "-"],
            capture_output=True, check=True).stdout
    elif name == "zero_frames":  # ffmpeg writes an MP4 with no stream at all
        data = _plain_mp4(["-f", "lavfi", "-i", "color=c=black:s=64x64:r=24", "-frames:v", "0"])
    elif name == "moov_truncated":  # a plain (non-fragmented) MP4 keeps its index at the end
        raw = b"".join(index_frame(i).tobytes() for i in range(24))
        data = _plain_mp4(["-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{W}x{H}", "-i", "-"],
                          raw)
        data = data[: len(data) - 200]
    else:
        data = {"empty": b"", "text": b"not a video\n" * 50, "truncated": mp4[:300],
                "random": np.random.default_rng(0).integers(0, 256, 8192, np.uint8).tobytes(),
                }[name]
    with pytest.raises(DecodeError) as e:
        dec.decode_clip(data, ClipSpec(num_frames=4), key=f"v/{name}")
    assert e.value.key == f"v/{name}"
    assert e.value.reason == {"empty": "empty", "png": "too_short", "audio_only": "no_video",
                              "zero_frames": "no_video"}.get(name, "corrupt")


def _plain_mp4(inputs: list[str], raw: bytes | None = None) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "v.mp4")
        subprocess.run(["ffmpeg", "-v", "error", *inputs, "-c:v", "libx264", "-pix_fmt",
                        "yuv420p", path], input=raw, check=True)
        with open(path, "rb") as f:
            return f.read()


def test_images_have_no_clips():
    for name in ("pil", "torchvision"):
        assert not hasattr(get_decoder(name), "decode_clip")


# Slimming (decode.mp4): non-reference frames a clip doesn't return are left out before FFmpeg
# decodes them; the frames it returns must be the very same pixels.

CODECS = {"h264": ["-c:v", "libx264"], "hevc": ["-c:v", "libx265", "-x265-params", "log-level=error"]}


@pytest.fixture(scope="module", params=list(CODECS))
def long_mp4(request) -> bytes:
    """x264's or x265's defaults (B-frames, some of them non-reference), keyframe every 24
    frames."""
    return make_mp4(96, keyint=24, layout="moov at end", codec=CODECS[request.param])


def _both_ways(data, spec, *, plan=None, seed=0, errors=False):
    """The clip decoded slimmed and as torchcodec alone decodes it, from the same draw (with
    ``errors``, the DecodeError in place of a clip that raised one)."""
    from fastmm.decode.torchcodec import Decoder

    out = []
    for skip in (True, False):
        d = Decoder(skip_unused_frames=skip)
        g = torch.Generator().manual_seed(seed)
        try:
            out.append(d.decode_clip(data, spec, generator=g) if plan is None else
                       d.decode_resized_clip(data, spec, plan, generator=g))
        except DecodeError as e:
            if not errors:
                raise
            out.append(e)
    return out


@pytest.mark.parametrize("spec", [
    ClipSpec(num_frames=16, stride=2, sampling="random"),
    ClipSpec(num_frames=8, stride=3, sampling="random"),
    ClipSpec(num_frames=5, stride=1, sampling="random"),
    ClipSpec(num_frames=6, fps=8.0, sampling="random"),
    ClipSpec(num_frames=7, sampling="uniform"),
])
def test_slimmed_clips_are_the_same_frames(long_mp4, spec):
    from fastmm.decode import mp4 as slim

    track = slim.parse(long_mp4)
    assert track is not None and track.num_frames == 96
    dropped = 0
    for seed in range(8):
        (clip, idx), (plain, plain_idx) = _both_ways(long_mp4, spec, seed=seed)
        assert idx == plain_idx and torch.equal(clip, plain)
        _check(clip, idx, spec.num_frames)
        cut = slim.slim_clip(long_mp4, track, idx)
        if cut is not None:  # non-reference frames left out before the clip's last frame
            last = int(np.argsort(track.pts, kind="stable")[idx].max())
            dropped += last + 1 - cut.num_frames  # (every sample after the last went too)
    if spec.stride == 2:
        assert dropped > 8  # every 2nd frame: non-reference B-frames are between them


def test_slimmed_resized_clips_are_the_same_pixels(long_mp4):
    from fastmm.decode.base import CropPlan

    spec = ClipSpec(num_frames=10, stride=2, sampling="random")
    for seed, box in enumerate([(0, 0, H, W), (3, 7, 41, 50)]):
        (clip, idx), (plain, plain_idx) = _both_ways(
            long_mp4, spec, plan=lambda w, h: CropPlan(*box, 24, 20, True), seed=seed)
        assert idx == plain_idx and torch.equal(clip, plain) and clip.shape == (10, 3, 24, 20)


@pytest.mark.parametrize("variant,slims", [
    ("no B-frames", True), ("no edit list", True), ("faststart", True), ("with audio", True),
    ("fragmented", False), ("HEVC", True)])
def test_other_encodings_and_layouts_decode_the_same(variant, slims):
    """Without B-frames only the frames after the clip go; fragmented files are decoded as
    they are; HEVC (x265) loses its non-reference frames as H.264 does; an audio track beside
    the video is kept as it is (its chunks don't move either)."""
    from fastmm.decode import mp4 as slim

    layout, codec = "moov at end", ["-c:v", "libx264"]
    if variant == "no B-frames":
        codec += ["-bf", "0"]
    elif variant == "no edit list":
        codec += ["-use_editlist", "0"]
    elif variant in ("faststart", "fragmented"):
        layout = variant
    elif variant == "HEVC":
        codec = CODECS["hevc"]
    data = make_mp4(72, keyint=24, layout=layout, codec=codec, audio=variant == "with audio")
    spec = ClipSpec(num_frames=12, stride=2, sampling="random")
    track = slim.parse(data)
    made = 0
    for seed in range(4):
        (clip, idx), (plain, _) = _both_ways(data, spec, seed=seed)
        assert torch.equal(clip, plain)
        _check(clip, idx, 12)
        made += track is not None and slim.slim_clip(data, track, idx) is not None
    assert (made > 0) == slims


def test_damaged_sample_tables_never_give_other_frames(long_mp4):
    """A byte of the moov changed: a clip or a DecodeError, never another exception; and where
    the damaged file decoded as it is still gives the frames asked for, slimming gives them
    too. (Where it doesn't, as with a damaged ctts that reorders the frames, both are wrong
    in their own way: the file's sample tables are what is damaged.)"""
    from fastmm.decode import mp4 as slim

    start, end = slim.parse(long_mp4).moov
    rng = np.random.default_rng(0)
    spec = ClipSpec(num_frames=8, stride=2, sampling="random")
    compared = 0
    for trial in range(120):
        data = bytearray(long_mp4)
        at = int(rng.integers(start, end))
        data[at] = int(rng.integers(0, 256))
        idx = spec.frame_indices(96, generator=torch.Generator().manual_seed(trial))
        slimmed, plain = (r if isinstance(r, DecodeError) else r[0]
                          for r in _both_ways(bytes(data), spec, seed=trial, errors=True))
        for clip in (slimmed, plain):
            assert isinstance(clip, DecodeError) or clip.shape == (8, 3, H, W)
        if isinstance(plain, torch.Tensor) and [read_index(f) for f in plain] == idx:
            assert isinstance(slimmed, torch.Tensor) and torch.equal(slimmed, plain), \
                f"byte {at - start} of the moov"
            compared += 1
    assert compared > 40


@pytest.mark.parametrize("box,fields", [
    ("stsz", {4: 1, 8: 0xFFFFFFFF}),  # one size for every sample, and 4 billion of them
    ("stts", {8: 0xFFFFFFFF}), ("ctts", {8: 0xFFFFFFFF}), ("stsc", {12: 0xFFFFFFFF})])
def test_absurd_sample_counts_are_refused_before_allocating(long_mp4, box, fields):
    """``fields``: offset in the box's payload -> new 32-bit value. Offset 4 is the entry count
    (stsz: the one size of every sample), 8 the first entry's first word (stsz: the sample
    count), 12 its second (stsc: samples per chunk)."""
    import resource
    import struct

    from fastmm.decode import mp4 as slim

    data = bytearray(long_mp4)
    at = data.index(box.encode()) + 4
    for field, value in fields.items():
        struct.pack_into(">I", data, at + field, value)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert slim.parse(bytes(data)) is None
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB
