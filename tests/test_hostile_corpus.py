"""A generated corpus of over 200 damaged samples (truncated at many points, bit-flipped, zero
bytes, garbage, bogus dimensions, wrong extensions, missing members, videos with no index or
absurd frame counts and durations, a shard cut short) through every decoder: no
crash and no hang; every sample either decodes to the asked shape or is counted as skipped with
its key; under on_error="replace" every batch is full."""

from __future__ import annotations

import io
import json
import pathlib
import random
import re
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from PIL import Image

import fastmm
from fastmm.bench.mmcorpus import CorpusSpec, write_corpus
from fastmm.decode import ClipSpec
from fastmm.sources import write_shards

if shutil.which("ffmpeg") is None:
    pytest.skip("the ffmpeg CLI is needed to encode the video", allow_module_level=True)


def _damaged(data: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    cuts = [data[: int(len(data) * k / 40)] for k in range(40)]
    flips = []
    for _ in range(40):
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        flips.append(bytes(b))
    garbage = [bytes(rng.randrange(256) for _ in range(n)) for n in (1, 100, 5000)]
    return cuts + flips + garbage + [b""]


def _bogus_jpeg_size(jpeg: bytes) -> bytes:
    i = jpeg.index(b"\xff\xc0")  # SOF0: length(2) precision(1) height(2) width(2)
    return jpeg[: i + 5] + struct.pack(">HH", 65000, 65000) + jpeg[i + 9:]


def _bogus_png_size(png: bytes) -> bytes:
    return png[:16] + struct.pack(">II", 60000, 60000) + png[24:]  # IHDR, CRC now wrong too


def _mp4_patched(mp4: bytes, box: bytes, offset: int, value: int) -> bytes:
    """One 32-bit field of an MP4 box, ``offset`` bytes after its type, set to ``value``."""
    at = mp4.index(box) + 4 + offset
    return mp4[:at] + struct.pack(">I", value) + mp4[at + 4:]


def _bad_video_headers(mp4: bytes) -> list[bytes]:
    """No index (the moov box renamed), absurd frame counts (stsz, stts), durations, a zero
    timescale, chunk offsets past the end."""
    return [mp4.replace(b"moov", b"free"), _mp4_patched(mp4, b"stsz", 8, 0x7FFFFFFF),
            _mp4_patched(mp4, b"stts", 8, 0x7FFFFFFF), _mp4_patched(mp4, b"mdhd", 16, 0xFFFFFFFF),
            _mp4_patched(mp4, b"mvhd", 16, 0xFFFFFFFF), _mp4_patched(mp4, b"mdhd", 12, 0),
            _mp4_patched(mp4, b"stco", 8, 0x7FFFFFFF)]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    write_corpus(CorpusSpec(num_images=0, num_videos=1, seed=2, video_duration_s=(1.0, 1.0),
                            video_fps=(24,), video_sizes=((96, 64),), video_keyint=(8,)),
                 str(root / "src"))
    mp4 = next((root / "src" / "posix").rglob("*.mp4")).read_bytes()
    jpg, png = io.BytesIO(), io.BytesIO()
    img = Image.effect_mandelbrot((64, 48), (-2, -1, 1, 1), 50).convert("RGB")
    img.save(jpg, "JPEG")
    img.save(png, "PNG")
    jpg, png = jpg.getvalue(), png.getvalue()
    images, videos = [], []
    for ext, data, seed in (("jpg", jpg, 1), ("png", png, 2)):
        images += [(ext, d) for d in _damaged(data, seed)]
    images += [("jpg", _bogus_jpeg_size(jpg)), ("png", _bogus_png_size(png)), ("jpg", png),
               ("png", jpg), ("jpg", mp4), ("jpg", jpg), ("png", png)]
    videos += [("mp4", d) for d in _damaged(mp4, 3)[::2] + _bad_video_headers(mp4)]
    videos += [("mp4", jpg), ("mp4", mp4)]
    samples = [(f"img{i:04d}", {ext: d, "cls": b"1"}) for i, (ext, d) in enumerate(images)]
    samples += [(f"vid{i:04d}", {ext: d, "cls": b"2"}) for i, (ext, d) in enumerate(videos)]
    samples += [(f"nomedia{i}", {"txt": b"caption only", "cls": b"3"}) for i in range(3)]
    assert len(samples) >= 200
    shards = write_shards(samples, str(root / "shards"), max_count=25)
    whole = pathlib.Path(shards[0]).read_bytes()  # and a shard cut short: a truncated member
    (root / "shards" / "zz-cut.tar").write_bytes(whole[: len(whole) * 3 // 5])
    return str(root / "shards"), {k for k, _ in samples}


def _check(ds, keys, modality):
    # sample by sample (a batch of only bad samples is an error under skip, by design)
    loader = fastmm.DataLoader(ds, batch_size=None, num_workers=2, timeout=120,
                               collate_fn=lambda item: item)
    decoded = [item for item in loader if item is not None]
    for item in decoded:
        tensor = item["image"] if modality == "image" else item["video"]
        assert tensor.shape[-2:] == (16, 16) and tensor.dtype == torch.uint8
    problems = ds.skipped
    assert len(decoded) + sum(problems.values()) == len(ds)
    assert "deadline" not in problems  # no sample took a decoder anywhere near a hang
    assert {p.key for p in ds.problems} <= keys  # every skip names its sample (last 100 kept)
    return len(decoded), problems


@pytest.mark.parametrize("decoder", ["pil", "torchvision", "torchcodec", "dali"])
def test_every_damaged_image_decodes_or_is_counted(hostile, decoder):
    if decoder == "dali":
        pytest.importorskip("nvidia.dali")
    shards, keys = hostile
    ds = fastmm.MultimodalDataset(shards, source="shards", decoder=decoder, size=16,
                                  modality="image", on_error="skip", keep_problems=1000,
                                  decode_deadline=60)
    good, problems = _check(ds, keys, "image")
    assert good >= 3 and sum(problems.values()) >= 100  # the intact ones decode, most don't
    assert problems.get("truncated")  # the shard cut short


@pytest.mark.slow
@pytest.mark.parametrize("decoder", ["torchvision", "torchcodec", "dali"])
def test_damaged_images_of_every_format_fail_as_decode_errors(decoder):
    """A library error of the kinds that say our call no longer fits the library (TypeError,
    AttributeError, ...: decode.base.NOT_SAMPLE_ERRORS) stops the loop instead of counting a
    bad sample, so bad bytes must never raise them: damaged images of every format Pillow
    writes, through each library decoder, decode or raise DecodeError."""
    if decoder == "dali":
        pytest.importorskip("nvidia.dali")
    from fastmm.decode import DecodeError, get_decoder
    from fastmm.decode.base import CropPlan

    dec = get_decoder(decoder)
    img = Image.effect_mandelbrot((40, 30), (-2, -1, 1, 1), 50).convert("RGB")
    failed = 0
    for seed, (fmt, extra) in enumerate([("JPEG", {}), ("JPEG", {"progressive": True}),
                                         ("PNG", {}), ("WEBP", {}), ("GIF", {}), ("BMP", {}),
                                         ("TIFF", {})]):
        out = io.BytesIO()
        img.save(out, fmt, **extra)
        for data in _damaged(out.getvalue(), seed):
            for decode in (lambda: dec.decode_image(data),
                           lambda: dec.decode_resized_crop(
                               data, lambda w, h: CropPlan(0, 0, h, w, 16, 16, False))):
                try:
                    decode()
                except DecodeError:
                    failed += 1
    assert failed > 300  # most of them are damaged beyond decoding


def test_every_damaged_video_decodes_or_is_counted(hostile):
    shards, keys = hostile
    ds = fastmm.MultimodalDataset(shards, source="shards", decoder="torchcodec", size=16,
                                  modality="video", clip=ClipSpec(num_frames=4), crop="center",
                                  on_error="skip", keep_problems=1000, decode_deadline=60)
    good, problems = _check(ds, keys, "video")
    assert good >= 1 and sum(problems.values()) >= 10


def test_replace_keeps_every_batch_full(hostile):
    shards, _ = hostile
    ds = fastmm.MultimodalDataset(shards, source="shards", decoder="pil", size=16,
                                  modality="image", on_error="replace", max_replace=200)
    sizes = [len(b["image"]) for b in fastmm.DataLoader(ds, batch_size=8, num_workers=2,
                                                        drop_last=True)]
    assert sizes and set(sizes) == {8} and ds.replaced > 0


_REPORT_JOB = """
import json, sys, fastmm
ds = fastmm.MultimodalDataset(sys.argv[1], source="shards", decoder="pil", size=16,
                              modality="image", on_error="skip")
loader = fastmm.DataLoader(ds, batch_size=None, num_workers=2, collate_fn=lambda item: item)
print(json.dumps({"decoded": sum(item is not None for item in loader), "skipped": ds.skipped}))
"""


@pytest.mark.slow
def test_every_skip_is_reported_with_its_key(hostile):
    """In a plain process (no test harness holding the log): one 'fastmm' log line per counted
    sample, naming its key and where its bytes came from, written by the worker that met it."""
    shards, keys = hostile
    run = subprocess.run([sys.executable, "-c", _REPORT_JOB, shards], capture_output=True,
                         text=True, timeout=300, check=True)
    result = json.loads(run.stdout)
    lines = re.findall(r"^fastmm: skipped sample '([^']+)' \(([^)]*)\): (\w+):", run.stderr, re.M)
    assert len(lines) == sum(result["skipped"].values()) >= 100
    assert {key for key, _, _ in lines} <= keys
    assert all(origin.startswith(shards) and ".tar:" in origin for _, origin, _ in lines)
    by_reason = {}
    for _, _, reason in lines:
        by_reason[reason] = by_reason.get(reason, 0) + 1
    assert by_reason == result["skipped"]
