"""Image decoding: the same pixels from every backend, colour rules, bad input, caps, draft."""

from __future__ import annotations

import io
import os
import pickle
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from fastmm.decode import DecodeError, DecodeLimitError, DecodeLimits, get_decoder

# Largest |difference| allowed between backends for the same JPEG. Backends bundle their own
# libjpeg-turbo (Pillow, torchvision) or FFmpeg's (torchcodec); builds may differ in IDCT and
# chroma upsampling by a rounding step or two. Observed here: 0.
JPEG_TOLERANCE = 2


def _video_required() -> bool:
    return os.environ.get("FASTMM_REQUIRE_VIDEO") == "1"


def _backends() -> list[str]:
    """pil and torchvision always; torchcodec unless missing and FASTMM_REQUIRE_VIDEO != "1";
    dali unless missing and FASTMM_REQUIRE_DALI != "1"."""
    names = ["pil", "torchvision"]
    for name, module, required in [("torchcodec", "torchcodec", _video_required()),
                                   ("dali", "nvidia.dali", os.environ.get("FASTMM_REQUIRE_DALI")
                                    == "1")]:
        try:
            __import__(module)
            names.append(name)
        except Exception:
            if required:
                raise
    return names


BACKENDS = _backends()


def encode(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _rgb(h=37, w=53, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _smooth(h=96, w=128) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([(x * 2) % 256, (y * 2) % 256, (x + y) % 256], -1).astype(np.uint8)


def _expected(im: Image.Image) -> torch.Tensor:
    """The colour rules of fastmm.decode.base written out with NumPy, from the source array."""
    a = np.asarray(im)
    if im.mode == "I;16":
        a = (a >> 8).astype(np.uint8)
    if im.mode == "P":
        a = np.asarray(im.convert("RGB"))
    if im.mode == "1":
        a = a.astype(np.uint8) * 255
    if a.ndim == 2:
        a = np.repeat(a[:, :, None], 3, axis=2)
    if im.mode == "LA":
        a = np.repeat(a[:, :, :1], 3, axis=2)
    return torch.from_numpy(np.ascontiguousarray(a[:, :, :3].transpose(2, 0, 1)))


def _modes() -> dict[str, Image.Image]:
    rng = np.random.default_rng(1)
    return {
        "RGB": Image.fromarray(_rgb()),
        "L": Image.fromarray(rng.integers(0, 256, (9, 11), dtype=np.uint8)),
        "RGBA": Image.fromarray(rng.integers(0, 256, (9, 11, 4), dtype=np.uint8)),
        "LA": Image.fromarray(rng.integers(0, 256, (9, 11, 4), dtype=np.uint8)).convert("LA"),
        "P": Image.fromarray(_rgb(9, 11)).quantize(16),
        "I;16": Image.fromarray(rng.integers(0, 65536, (9, 11), dtype=np.uint16)),
        "1": Image.fromarray(rng.integers(0, 2, (9, 11), dtype=np.uint8) * 255).convert("1"),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(_modes()))
def test_png_bit_exact_with_colour_rules(backend, mode):
    im = _modes()[mode]
    assert im.mode == mode
    out = get_decoder(backend).decode_image(encode(im), key="k")
    assert out.dtype == torch.uint8 and out.shape == (3, im.height, im.width)
    assert out.is_contiguous()
    assert torch.equal(out, _expected(im))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduce", [False, True])
@pytest.mark.parametrize("mode", list(_modes()))
def test_png_crops_are_the_decoded_pixels_cropped(backend, reduce, mode):
    """decode_resized_crop on a PNG gives crop_resize of its exact pixels (whatever library the
    backend decodes PNGs with), with the crop planned for the PNG's own size."""
    from fastmm.dataset import ResizedCrop
    from fastmm.decode.base import crop_resize

    im = _modes()[mode]
    plans = []

    def plan(width, height):
        plans.append((width, height))
        torch.manual_seed(3)
        return ResizedCrop(size=(5, 7)).plan(width, height)

    out = get_decoder(backend).decode_resized_crop(encode(im), plan, key="k", reduce=reduce)
    if backend == "pil" and not reduce:  # Pillow's own resize: checked against torchvision's
        return                            # elsewhere
    assert plans == [(im.width, im.height)]
    assert torch.equal(out, crop_resize(_expected(im), plan(im.width, im.height)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["smooth", "noise", "gray", "cmyk", "420"])
def test_jpeg_within_tolerance_of_pil(backend, kind):
    a = _smooth() if kind != "noise" else _rgb(96, 128)
    im = Image.fromarray(a)
    kw = {"quality": 90, "subsampling": 2 if kind == "420" else 0}
    if kind in ("gray", "cmyk"):
        im = im.convert("L" if kind == "gray" else "CMYK")
    data = encode(im, "JPEG", **kw)
    ref = get_decoder("pil").decode_image(data).int()
    out = get_decoder(backend).decode_image(data)
    assert out.dtype == torch.uint8 and out.shape == (3, 96, 128)
    assert (out.int() - ref).abs().max().item() <= JPEG_TOLERANCE
    if kind == "smooth":  # and close to the source itself
        assert (ref - torch.from_numpy(a).permute(2, 0, 1).int()).abs().float().mean() < 2


def _bad_inputs() -> dict[str, bytes]:
    png = encode(Image.fromarray(_rgb(64, 64)))
    jpg = encode(Image.fromarray(_smooth()), "JPEG", quality=90)
    return {
        "empty": b"",
        "text": b"this is a caption, not an image\n" * 4,
        "png_truncated": png[: len(png) // 2],
        "jpg_truncated": jpg[:200],
        "png_header_only": png[:33],
        "png_garbled": png[:40] + bytes(len(png) - 40),
        "random": np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_bad_input_raises_decode_error_with_key(backend, name):
    with pytest.raises(DecodeError) as e:
        get_decoder(backend).decode_image(_bad_inputs()[name], key=f"s/{name}")
    assert e.value.key == f"s/{name}"
    assert e.value.reason == ("empty" if name == "empty" else "corrupt")


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_extension_is_decided_by_content(backend):
    """A PNG stored as ".jpg" decodes (formats are sniffed); an MP4 or text as image fails."""
    im = Image.fromarray(_rgb())
    assert torch.equal(get_decoder(backend).decode_image(encode(im), key="x.jpg"), _expected(im))
    mp4ish = b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom" + bytes(64)
    with pytest.raises(DecodeError) as e:
        get_decoder(backend).decode_image(mp4ish, key="x.jpg")
    assert e.value.key == "x.jpg"


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height; its data is a few bytes only."""
    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(
            ">I", zlib.crc32(tag + body) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("header", ["png 100000x100000", "png 10000x10000", "png 20000x5",
                                    "jpeg 30000x20000"])
def test_bomb_header_is_refused_before_decoding(backend, header, monkeypatch):
    from PIL import ImageFile

    from fastmm.dataset import ResizedCrop

    kind, size = header.split()
    width, height = map(int, size.split("x"))
    data = (_png_header(width, height) if kind == "png"
            else _with_frame_size(_jpegs()["baseline"], width, height))
    dec = get_decoder(backend, limits=DecodeLimits(max_image_pixels=50_000))
    # no library's decode may be reached
    import torchvision.io

    monkeypatch.setattr(torchvision.io, "decode_image", _never)
    monkeypatch.setattr(torchvision.io, "decode_jpeg", _never)
    monkeypatch.setattr(ImageFile.ImageFile, "load", _never)
    if backend == "torchcodec":
        import torchcodec.decoders

        monkeypatch.setattr(torchcodec.decoders, "decode_image", _never)
    if backend == "dali":
        monkeypatch.setattr(type(dec), "_build", _never)
    plan = ResizedCrop(size=(56, 56)).plan
    for decode in (lambda: dec.decode_image(data, key="bomb"),
                   lambda: dec.decode_resized_crop(data, plan, key="bomb"),
                   lambda: dec.decode_resized_crop(data, plan, key="bomb", reduce=True)):
        with pytest.raises(DecodeLimitError) as e:
            decode()
        assert e.value.key == "bomb" and e.value.reason == "too_large"


def _never(*args, **kwargs):
    raise AssertionError("decoded pixels although the header was over the cap")


@pytest.mark.parametrize("backend", BACKENDS)
def test_cap_applies_to_real_images_and_default_cap_passes_them(backend):
    data = encode(Image.fromarray(_rgb(64, 64)))
    assert get_decoder(backend).decode_image(data).shape == (3, 64, 64)
    get_decoder(backend, limits=DecodeLimits(max_image_pixels=64 * 64)).decode_image(data)
    with pytest.raises(DecodeLimitError, match="64x64"):
        get_decoder(backend, limits=DecodeLimits(max_image_pixels=64 * 64 - 1)).decode_image(data)


@pytest.mark.parametrize("target,expected", [((240, 320), (240, 320)), ((100, 150), (120, 160)),
                                             ((60, 80), (60, 80)), ((10, 10), (60, 80)),
                                             ((241, 100), (480, 640))])
def test_jpeg_reduce_to_uses_dct_scaling(target, expected):
    """Pillow's draft scales by 1/2, 1/4 or 1/8 and never below the target (H, W)."""
    big = np.asarray(Image.fromarray(_smooth()).resize((640, 480)))
    data = encode(Image.fromarray(big), "JPEG", quality=90)
    out = get_decoder("pil").decode_image(data, reduce_to=target)
    assert tuple(out.shape) == (3, *expected)
    full = get_decoder("pil").decode_image(data)
    assert full.shape == (3, 480, 640)
    # close to an area-downscale of the full decode (smooth content)
    f = expected[0] and 480 // expected[0]
    ref = torch.nn.functional.avg_pool2d(full[None].float(), f)[0]
    assert (out.float() - ref).abs().mean() < 3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "GIF", "WEBP"])
def test_every_listed_image_format_decodes_in_every_backend(backend, fmt):
    """A format the backend's library lacks (torchcodec: BMP, TIFF; DALI: GIF, WebP's extended
    layout) is decoded by Pillow, never counted corrupt; the pixels are Pillow's."""
    im = Image.fromarray(_smooth(48, 64)).convert("RGBA" if fmt == "WEBP" else "RGB")
    data = encode(im, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    out = get_decoder(backend).decode_image(data, key="k")
    assert out.shape == (3, 48, 64)
    reference = get_decoder("pil").decode_image(data)
    assert (out.float() - reference.float()).abs().mean() < JPEG_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_exif_orientation_is_left_as_stored_by_every_backend(backend, fmt):
    """Pixels as stored, as Pillow and torchvision's decoders give them: FFmpeg (torchcodec,
    and torchvision's PNG path through it) and DALI would turn the image upright, and a crop
    planned from the header then failed as "corrupt" on orientations 5-8."""
    from fastmm.dataset import ResizedCrop

    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees to display
    data = encode(Image.fromarray(_smooth(48, 64)), fmt, exif=exif.tobytes(),
                  **({"quality": 95} if fmt != "PNG" else {}))
    decoder, reference = get_decoder(backend), get_decoder("pil")
    whole = decoder.decode_image(data, key="k")
    assert whole.shape == (3, 48, 64)
    assert (whole.float() - reference.decode_image(data).float()).abs().mean() < JPEG_TOLERANCE
    plan = ResizedCrop(size=(24, 32), mode="center").plan
    for reduce in (False, True):
        crop = decoder.decode_resized_crop(data, plan, key="k", reduce=reduce)
        expected = reference.decode_resized_crop(data, plan, key="k", reduce=reduce)
        assert crop.shape == (3, 24, 32)
        assert (crop.float() - expected.float()).abs().mean() < 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lossless_jpeg_takes_the_fast_path_at_full_size(backend, tmp_path):
    """A lossless JPEG (SOF3) has no DCT to scale: reduce=True decodes it whole, as reduce=False
    does, instead of counting it corrupt (Pillow's draft mode breaks it)."""
    import shutil
    import subprocess

    if shutil.which("ffmpeg") is None:
        pytest.skip("ffmpeg CLI needed to write a lossless JPEG")
    Image.fromarray(_smooth(48, 64)).save(tmp_path / "src.png")
    subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", "-i",
                    str(tmp_path / "src.png"), "-c:v", "ljpeg", "-pix_fmt", "yuvj420p",
                    str(tmp_path / "l.jpg")], check=True)
    data = (tmp_path / "l.jpg").read_bytes()
    from fastmm.dataset import ResizedCrop

    plan = ResizedCrop(size=16, mode="center").plan
    decoder = get_decoder(backend)
    whole = decoder.decode_resized_crop(data, plan, key="l", reduce=False)
    fast = decoder.decode_resized_crop(data, plan, key="l", reduce=True)
    assert fast.shape == whole.shape == (3, 16, 16)
    assert (fast.float() - whole.float()).abs().mean() < 3
    if backend == "pil":
        assert decoder.decode_image(data, reduce_to=(8, 8)).shape == (3, 48, 64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_to_is_ignored_for_png_and_other_backends(backend):
    data = encode(Image.fromarray(_rgb(64, 64)))
    assert get_decoder(backend).decode_image(data, reduce_to=(8, 8)).shape == (3, 64, 64)
    jpg = encode(Image.fromarray(_smooth()), "JPEG")
    expected = (48, 64) if backend == "pil" else (96, 128)
    assert tuple(get_decoder(backend).decode_image(jpg, reduce_to=(40, 60)).shape[1:]) == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoders_pickle_for_worker_processes(backend):
    im = Image.fromarray(_rgb())
    dec = get_decoder(backend, limits=DecodeLimits(max_image_pixels=10_000))
    dec.decode_image(encode(im))  # a used decoder (DALI: pipeline built) must still pickle
    copy = pickle.loads(pickle.dumps(dec))
    assert copy.limits == dec.limits and copy.device == "cpu" and copy.name == backend
    assert torch.equal(copy.decode_image(encode(im)), _expected(im))


def test_torchvision_jpeg_batch_on_cpu_equals_one_by_one():
    datas = [encode(Image.fromarray(_rgb(40 + i, 30, seed=i)), "JPEG") for i in range(3)]
    dec = get_decoder("torchvision")
    out = dec.decode_jpeg_batch(datas, keys=["a", "b", "c"])
    assert [tuple(t.shape) for t in out] == [(3, 40, 30), (3, 41, 30), (3, 42, 30)]
    assert all(torch.equal(o, dec.decode_image(d)) for o, d in zip(out, datas))
    with pytest.raises(DecodeError) as e:
        dec.decode_jpeg_batch([datas[0], b""], keys=["a", "b"])
    assert e.value.key == "b"


def _jpegs() -> dict[str, bytes]:
    big = Image.fromarray(_smooth()).resize((640, 480))
    exif = Image.Exif()
    exif[0x010E] = "a caption in the EXIF block " * 40  # a long APP1 segment to walk over
    base = encode(big, "JPEG", quality=90)
    return {
        "baseline": base,
        "progressive": encode(big, "JPEG", progressive=True),
        "optimized_420": encode(big, "JPEG", optimize=True, subsampling=2),
        "exif": encode(big, "JPEG", exif=exif.tobytes()),
        "gray": encode(big.convert("L"), "JPEG"),
        "cmyk": encode(big.convert("CMYK"), "JPEG"),
        "odd_size": encode(Image.fromarray(_rgb(37, 53)), "JPEG"),
        "fill_bytes": base[:2] + b"\xff\xff\xff" + base[2:],  # fill before a marker is legal
        "comment": base[:2] + b"\xff\xfe\x00\x07hello" + base[2:],
    }


def test_torchvision_without_its_image_decoders_is_refused_not_counted_corrupt(monkeypatch):
    """torchvision deprecated its decoders in 0.29: a release without them must stop the
    backend at once (ImportError naming the way out), not turn every sample into a "corrupt"
    DecodeError that on_error would skip."""
    import torchvision.io

    monkeypatch.delattr(torchvision.io, "decode_image")
    with pytest.raises(ImportError, match="torchvision.io.decode_image.*'torchcodec' decoder"):
        get_decoder("torchvision")


def test_nvjpeg_batch_in_a_worker_forked_after_cuda_init_is_a_fault(monkeypatch):
    """decode_jpeg_batch on CUDA in a process that cannot use CUDA (forked after its parent
    initialised it: torch's own flag, set as such a fork finds it) is a DecoderFault naming
    the way out, not a batch of corrupt samples."""
    from fastmm.decode import DecoderFault

    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    with pytest.raises(DecoderFault, match="forked after.*'spawn'"):
        get_decoder("torchvision", device="cuda").decode_jpeg_batch([_jpegs()["baseline"]])


@pytest.mark.parametrize("name", list(_jpegs()))
def test_jpeg_size_reads_the_frame_header_as_pillow_does(name):
    from fastmm.decode.base import jpeg_size

    data = _jpegs()[name]
    assert jpeg_size(data) == Image.open(io.BytesIO(data)).size


def test_jpeg_size_gives_none_for_anything_it_cannot_read():
    from fastmm.decode.base import jpeg_size

    jpg = _jpegs()["baseline"]
    sof = jpg.index(b"\xff\xc0")
    assert jpeg_size(encode(Image.fromarray(_rgb()))) is None  # a PNG
    assert jpeg_size(jpg[:sof + 6]) is None  # cut inside the frame header
    assert jpeg_size(jpg[:sof] + b"\xff\xda") is None  # a scan before any frame header
    assert jpeg_size(jpg[:sof + 5] + b"\x00\x00" + jpg[sof + 7:]) is None  # height 0 (DNL)
    rng = np.random.default_rng(5)
    for _ in range(300):  # never raises on damaged headers
        junk = bytearray(jpg[:sof + 20])
        for i in rng.integers(2, len(junk), 4):
            junk[i] = int(rng.integers(0, 256))
        size = jpeg_size(bytes(junk)[: int(rng.integers(2, len(junk)))])
        assert size is None or (size[0] > 0 and size[1] > 0)


def test_dali_takes_8_bit_output_only_for_8_bit_images():
    """DALI's 8-bit output (4x faster) for 8-bit JPEGs and PNGs; its 16-bit one for anything
    that may hold more bits (16-bit PNG, 12-bit JPEG, formats not read here). The pixels are
    checked for every colour mode in test_png_bit_exact_with_colour_rules."""
    pytest.importorskip("nvidia.dali")
    from fastmm.decode.dali import _may_be_wide

    jpg = _jpegs()["baseline"]
    sof = jpg.index(b"\xff\xc0")
    assert not _may_be_wide(jpg) and not _may_be_wide(_jpegs()["progressive"])
    assert _may_be_wide(jpg[:sof + 4] + bytes([12]) + jpg[sof + 5:])  # 12-bit precision
    for mode, wide in [("RGB", False), ("P", False), ("1", False), ("I;16", True)]:
        assert _may_be_wide(encode(_modes()[mode])) == wide, mode
    for fmt in ("TIFF", "BMP", "WEBP"):
        assert _may_be_wide(encode(_modes()["RGB"], fmt))


@pytest.mark.parametrize("name", list(_jpegs()))
def test_dali_decodes_only_the_crop_with_the_same_pixels(name):
    """DALI's region-of-interest decode of a JPEG crop gives the pixels of the whole image
    decoded, then cropped and resized the same way."""
    pytest.importorskip("nvidia.dali")
    from fastmm.dataset import ResizedCrop
    from fastmm.decode.base import crop_resize

    data, dec = _jpegs()[name], get_decoder("dali")
    whole = dec.decode_image(data)
    for seed in range(4):
        def plan(width, height):
            torch.manual_seed(seed)
            return ResizedCrop(size=(24, 32)).plan(width, height)

        out = dec.decode_resized_crop(data, plan, key="k")
        assert torch.equal(out, crop_resize(whole, plan(whole.shape[-1], whole.shape[-2])))


def _with_frame_size(data: bytes, width: int, height: int) -> bytes:
    sof = data.index(b"\xff\xc0")
    return data[:sof + 5] + struct.pack(">HH", height, width) + data[sof + 9:]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduce", [False, True])
def test_jpeg_with_two_frame_headers_is_corrupt_not_cropped_wrong(backend, reduce):
    """A frame header claiming another size before the real one (the header walk plans the
    crop from the first, Pillow reads the last): an error, never a crop planned for a size
    the pixels do not have."""
    from fastmm.dataset import ResizedCrop

    jpg = _jpegs()["baseline"]
    sof = jpg.index(b"\xff\xc0")
    length = struct.unpack(">H", jpg[sof + 2:sof + 4])[0]
    real = jpg[sof:sof + 2 + length]
    data = jpg[:sof] + _with_frame_size(real, 64, 48) + jpg[sof:]
    torch.manual_seed(0)
    with pytest.raises(DecodeError) as e:
        get_decoder(backend).decode_resized_crop(data, ResizedCrop(size=(16, 16)).plan,
                                                 key="two", reduce=reduce)
    assert e.value.key == "two" and e.value.reason == "corrupt"
