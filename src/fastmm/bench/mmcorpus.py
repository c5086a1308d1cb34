"""A deterministic multimodal corpus: photo-like images (mostly JPEG, some PNG) and H.264 videos,
each sample with a caption and a label, written as a POSIX tree with a manifest and as
WebDataset-layout tar shards, with its composition recorded for the benchmark's environment.

Content comes from the colour and grey photographs that scikit-image ships in its wheel (only those
that load offline), cropped and rescaled; without scikit-image it falls back to the procedural
photo-like images of :mod:`fastmm.bench.corpus` and says so in the composition.
Every video frame draws its own index in its top-left 64x64 pixels (4x4 blocks of 16 px, one bit
each, white = 1: the pattern of ``tests/test_decode_video.py``), so a test can tell which frame a
decoder returned; :func:`read_frame_index` reads it back.

Sample ``i`` depends only on ``(spec, i)``: the same spec gives the same bytes (x264 runs with
``-threads 1``, which makes it deterministic), given the same Pillow, scikit-image and FFmpeg.

Run ``python -m fastmm.bench.mmcorpus --out DIR [--images N --videos N --seed S ...]``.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from . import options

MMCORPUS_VERSION = 1  # bump when the generator's output changes

# Photos in scikit-image's wheel that load without a network (checked for 0.26.0).
COLOUR_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field",
                 "immunohistochemistry", "retina")
GREY_PHOTOS = ("camera", "coins", "moon", "grass", "gravel", "brick")
CLASS_NAMES = ("person", "cat", "cup", "rocket", "galaxy", "tissue", "eye", "camera", "coin",
               "moon", "grass", "gravel", "brick")
_CLASS_OF_PHOTO = dict(zip(COLOUR_PHOTOS + GREY_PHOTOS, CLASS_NAMES))

INDEX_BLOCK = 16  # the frame-index pattern: 4x4 blocks of 16 px in the top-left corner
INDEX_SIDE = 4 * INDEX_BLOCK

SHORT_SIDE_EDGES = (0, 256, 384, 512, 768, 1080, 1440, 2160, 1 << 30)
FRAME_COUNT_EDGES = (0, 16, 32, 64, 128, 256, 512, 1024, 1 << 30)


@dataclass(frozen=True, kw_only=True)
class CorpusSpec:
    """What to generate. Ranges are inclusive ``(low, high)`` drawn uniformly; tuples of choices
    are drawn uniformly too. Image sizes: the short side is drawn from ``image_short_side``
    (ImageNet-like by default), or with probability ``large_fraction`` from ``large_short_side``
    (the 1080p+ tail); the long side is the short side times an aspect ratio from
    ``aspect_ratios``, in landscape or portrait with equal odds."""

    num_images: int = 1000
    num_videos: int = 50
    seed: int = 0
    png_fraction: float = 0.1
    jpeg_quality: int = 90
    image_short_side: tuple[int, int] = (300, 500)
    aspect_ratios: tuple[float, ...] = (1.0, 4 / 3, 3 / 2, 16 / 9)
    large_fraction: float = 0.05
    large_short_side: tuple[int, int] = (1080, 2160)
    video_duration_s: tuple[float, float] = (2.0, 10.0)
    video_fps: tuple[int, ...] = (24, 25, 30)
    video_sizes: tuple[tuple[int, int], ...] = ((320, 240), (640, 360), (1280, 720))
    video_keyint: tuple[int, ...] = (12, 30, 60)
    video_crf: int = 23
    shard_bytes: int = 256 << 20
    photos: str = "auto"  # "auto": scikit-image if importable, else "procedural"

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"CorpusSpec.{name}={getattr(self, name)!r}: {why}")

        for name in ("num_images", "num_videos", "seed"):
            if getattr(self, name) < 0:
                bad(name, "must be >= 0")
        for name in ("png_fraction", "large_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                bad(name, "must be within [0, 1]")
        for name in ("image_short_side", "large_short_side", "video_duration_s"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                bad(name, "needs 0 < low <= high")
        if not self.aspect_ratios or min(self.aspect_ratios) < 1.0:
            bad("aspect_ratios", "needs ratios >= 1 (long side / short side)")
        for name in ("video_fps", "video_keyint", "video_sizes"):
            if not getattr(self, name):
                bad(name, "needs at least one choice")
        for name in ("video_fps", "video_keyint"):
            if any(int(v) != v or v < 1 for v in getattr(self, name)):
                bad(name, "needs whole numbers >= 1")
        if not 0 <= self.video_crf <= 51:
            bad("video_crf", "must be within 0..51 (H.264)")
        if any(w < INDEX_SIDE or h < INDEX_SIDE or w % 2 or h % 2 for w, h in self.video_sizes):
            bad("video_sizes", f"sides must be even and at least {INDEX_SIDE} px")
        if not 1 <= self.jpeg_quality <= 100:
            bad("jpeg_quality", "must be within 1..100")
        if self.shard_bytes < 1:
            bad("shard_bytes", "must be >= 1")
        if self.photos not in ("auto", "skimage", "procedural"):
            bad("photos", "use 'auto', 'skimage' or 'procedural'")

    def to_json(self) -> dict:
        return json.loads(json.dumps(asdict(self)))


# -- frame-index pattern (same as tests/test_decode_video.py) ----------------------------------

def index_pattern(i: int) -> np.ndarray:
    """64x64x3 uint8 block whose 4x4 cells spell ``i`` (0..65535) in binary, white = 1."""
    if not 0 <= i < 1 << 16:
        raise ValueError(f"frame index {i} does not fit the 16-bit pattern")
    bits = [(i >> b) & 1 for b in range(16)]
    grid = np.array(bits, dtype=np.uint8).reshape(4, 4) * 255
    return np.repeat(np.repeat(grid, INDEX_BLOCK, 0), INDEX_BLOCK, 1)[:, :, None].repeat(3, 2)


def read_frame_index(frame) -> int:
    """The index drawn in a decoded frame: a CxHxW torch tensor or an HxWxC array (uint8)."""
    a = np.asarray(frame.numpy() if hasattr(frame, "numpy") else frame, dtype=np.float32)
    if a.shape[0] in (1, 3) and a.shape[-1] not in (1, 3):
        a = a.transpose(1, 2, 0)
    b = INDEX_BLOCK
    means = a[:INDEX_SIDE, :INDEX_SIDE].mean(2).reshape(4, b, 4, b).mean((1, 3)).flatten()
    return sum(1 << k for k in range(16) if means[k] > 128)


# -- photos -----------------------------------------------------------------------------------

_photos: dict[str, np.ndarray] = {}


def photo_backend(spec: CorpusSpec) -> str:
    """"skimage <version>" or "procedural": where the pixels come from."""
    if spec.photos == "procedural":
        return "procedural"
    try:
        import skimage
    except ImportError:
        if spec.photos == "skimage":
            raise ImportError("CorpusSpec.photos='skimage' needs scikit-image: "
                              "pip install scikit-image") from None
        return "procedural"
    return f"skimage {skimage.__version__}"


def _photo(name: str) -> np.ndarray:
    img = _photos.get(name)
    if img is None:
        import skimage.data

        try:
            img = np.asarray(getattr(skimage.data, name)())
        except Exception as e:  # an older wheel may fetch it over the network instead
            raise RuntimeError(
                f"scikit-image sample photo {name!r} does not load offline ({e}); use "
                "scikit-image>=0.26 or CorpusSpec(photos='procedural')") from e
        if img.ndim == 2:
            img = np.repeat(img[:, :, None], 3, 2)
        img = _photos[name] = np.ascontiguousarray(img[:, :, :3].astype(np.uint8))
    return img


def _source_photo(spec: CorpusSpec, backend: str, rng, index: int):
    """(name, HxWx3 uint8) of the photo a sample starts from."""
    if backend == "procedural":
        from .corpus import make_image

        return f"procedural-{index}", np.asarray(make_image(spec.seed, 1_000_000 + index))
    name = (COLOUR_PHOTOS + GREY_PHOTOS)[int(rng.integers(len(COLOUR_PHOTOS) + len(GREY_PHOTOS)))]
    return name, _photo(name)


def _crop_resize(img: np.ndarray, width: int, height: int, rng, scale=(0.5, 1.0)) -> np.ndarray:
    """A random crop of ``img`` with the aspect of ``width x height``, resized to that size."""
    from PIL import Image

    ih, iw = img.shape[:2]
    aspect = width / height
    cw, ch = (iw, max(1, round(iw / aspect))) if iw / ih <= aspect else (max(1, round(ih * aspect)), ih)
    s = float(rng.uniform(*scale))
    cw, ch = max(1, round(cw * s)), max(1, round(ch * s))
    x0 = int(rng.integers(0, iw - cw + 1))
    y0 = int(rng.integers(0, ih - ch + 1))
    crop = Image.fromarray(img[y0:y0 + ch, x0:x0 + cw])
    if float(rng.uniform()) < 0.5:
        crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(crop.resize((width, height), Image.BICUBIC))


# -- samples ----------------------------------------------------------------------------------

def image_size(spec: CorpusSpec, index: int) -> tuple[int, int]:
    """(width, height) of image ``index``."""
    rng = np.random.default_rng([spec.seed, 0x696D67, index, 1])
    large = float(rng.uniform()) < spec.large_fraction
    lo, hi = spec.large_short_side if large else spec.image_short_side
    short = int(rng.integers(lo, hi + 1))
    aspect = spec.aspect_ratios[int(rng.integers(len(spec.aspect_ratios)))]
    long = max(short, round(short * aspect))
    return (long, short) if float(rng.uniform()) < 0.5 else (short, long)


def video_params(spec: CorpusSpec, index: int) -> dict:
    """Size, rate, frame count and keyframe interval of video ``index``."""
    rng = np.random.default_rng([spec.seed, 0x766964, index, 1])
    width, height = spec.video_sizes[int(rng.integers(len(spec.video_sizes)))]
    fps = int(spec.video_fps[int(rng.integers(len(spec.video_fps)))])
    keyint = int(spec.video_keyint[int(rng.integers(len(spec.video_keyint)))])
    duration = float(rng.uniform(*spec.video_duration_s))
    frames = max(1, round(duration * fps))
    if frames >= 1 << 16:
        raise ValueError(f"video {index} would have {frames} frames; the index pattern holds 65535")
    return {"width": width, "height": height, "fps": fps, "keyint": keyint, "frames": frames}


def _caption(rng, what: str, cls: str, width: int, height: int, extra: str = "") -> str:
    adj = ("a", "a close-up", "a wide", "a cropped", "a bright", "a dim")[int(rng.integers(6))]
    return f"{adj} {what} of {cls}, {width}x{height}{extra}"


def make_image_sample(spec: CorpusSpec, index: int, backend: str) -> tuple[str, dict[str, bytes]]:
    from PIL import Image

    rng = np.random.default_rng([spec.seed, 0x696D67, index])
    width, height = image_size(spec, index)
    name, photo = _source_photo(spec, backend, rng, index)
    pixels = _crop_resize(photo, width, height, rng)
    fmt = "png" if float(rng.uniform()) < spec.png_fraction else "jpg"
    buf = io.BytesIO()
    if fmt == "png":
        Image.fromarray(pixels).save(buf, "PNG", compress_level=6)
    else:
        Image.fromarray(pixels).save(buf, "JPEG", quality=spec.jpeg_quality)
    cls = _CLASS_OF_PHOTO.get(name, "shape")
    label = CLASS_NAMES.index(cls) if cls in CLASS_NAMES else len(CLASS_NAMES)
    meta = {"kind": "image", "format": fmt, "width": width, "height": height, "source": name,
            "label": label, "class": cls}
    return f"image/{index:06d}", {
        fmt: buf.getvalue(),
        "txt": _caption(rng, "photo", cls, width, height).encode(),
        "cls": str(label).encode(),
        "json": json.dumps(meta, sort_keys=True).encode(),
    }


def video_frames(spec: CorpusSpec, index: int, backend: str):
    """(params, source name, iterator of HxWx3 uint8 frames) of video ``index``: a photo
    background panning slowly, with the frame's index drawn in the top-left corner."""
    p = video_params(spec, index)
    rng = np.random.default_rng([spec.seed, 0x766964, index])
    name, photo = _source_photo(spec, backend, rng, index)
    w, h, n = p["width"], p["height"], p["frames"]
    pan = max(8, min(n, w // 2))  # pixels travelled over the whole clip: about one per frame
    bg = _crop_resize(photo, w + pan, h + max(2, pan * h // w), rng)
    dy_total = bg.shape[0] - h

    def frames():
        for i in range(n):
            t = i / max(1, n - 1)
            x, y = round(t * pan), round(t * dy_total)
            frame = np.array(bg[y:y + h, x:x + w])
            frame[:INDEX_SIDE, :INDEX_SIDE] = index_pattern(i)
            yield frame

    return p, name, frames()


def encode_h264(frames, width: int, height: int, fps: int, keyint: int, crf: int, path: str):
    """Pipe RGB frames into FFmpeg (libx264, one thread: deterministic) and write an MP4; where
    there is no ffmpeg CLI (the GPU machine), the same settings through PyAV's FFmpeg."""
    if shutil.which("ffmpeg") is None:
        return _encode_h264_pyav(frames, width, height, fps, keyint, crf, path)
    cmd = ["ffmpeg", "-nostdin", "-v", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24",
           "-s", f"{width}x{height}", "-r", str(fps), "-i", "-", "-c:v", "libx264",
           "-preset", "veryfast", "-crf", str(crf), "-g", str(keyint), "-threads", "1",
           "-pix_fmt", "yuv420p", "-map_metadata", "-1", "-fflags", "+bitexact",
           "-f", "mp4", path]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for frame in frames:
            proc.stdin.write(frame.tobytes())
    except BrokenPipeError:
        pass
    finally:
        proc.stdin.close()
    err = proc.stderr.read().decode(errors="replace")
    if proc.wait() != 0:
        raise RuntimeError(f"ffmpeg failed ({proc.returncode}): {err.strip()[-2000:]}")


def _encode_h264_pyav(frames, width, height, fps, keyint, crf, path) -> None:
    import av

    with av.open(path, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps, options={
            "preset": "veryfast", "crf": str(crf), "g": str(keyint), "threads": "1"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())


def make_video_sample(spec: CorpusSpec, index: int, backend: str,
                      tmp_dir: str) -> tuple[str, dict[str, bytes]]:
    p, name, frames = video_frames(spec, index, backend)
    path = os.path.join(tmp_dir, f"v{index:06d}-{os.getpid()}.mp4")
    try:
        encode_h264(frames, p["width"], p["height"], p["fps"], p["keyint"], spec.video_crf, path)
        with open(path, "rb") as f:
            data = f.read()
    finally:
        if os.path.exists(path):
            os.unlink(path)
    rng = np.random.default_rng([spec.seed, 0x766964, index, 2])
    cls = _CLASS_OF_PHOTO.get(name, "shape")
    label = CLASS_NAMES.index(cls) if cls in CLASS_NAMES else len(CLASS_NAMES)
    meta = {"kind": "video", "format": "mp4", "codec": "h264", **p,
            "duration_s": p["frames"] / p["fps"], "source": name, "label": label, "class": cls}
    extra = f", {p['frames'] / p['fps']:.1f} s at {p['fps']} fps"
    return f"video/{index:06d}", {
        "mp4": data,
        "txt": _caption(rng, "video", cls, p["width"], p["height"], extra).encode(),
        "cls": str(label).encode(),
        "json": json.dumps(meta, sort_keys=True).encode(),
    }


def _make(job):
    spec, kind, index, backend, tmp_dir = job
    if kind == "image":
        return make_image_sample(spec, index, backend)
    return make_video_sample(spec, index, backend, tmp_dir)


# -- corpus -----------------------------------------------------------------------------------

def _histogram(values, edges) -> dict:
    counts, _ = np.histogram(np.asarray(values, dtype=np.int64), bins=np.asarray(edges))
    return {"edges": list(edges), "counts": [int(c) for c in counts]}


def _ffmpeg_version() -> str:
    """The FFmpeg that encodes the videos: the CLI's, or PyAV's where there is no CLI."""
    if shutil.which("ffmpeg") is None:
        import av

        return f"PyAV {av.__version__} (FFmpeg {av.ffmpeg_version_info})"
    out = subprocess.run(["ffmpeg", "-version"], capture_output=True, text=True).stdout
    return out.splitlines()[0] if out else "unknown"


def write_corpus(spec: CorpusSpec, out_dir: str, *,
                 progress: Callable[[str], None] | None = None,
                 processes: int | None = 1) -> dict:
    """Write the corpus of ``spec`` under ``out_dir`` and return its composition.

    Layout: ``posix/<key>.<ext>`` files with ``posix/manifest.jsonl`` (``{"key", "members":
    {ext: path relative to the manifest}}`` a line, keys sorted), ``shards/shard-%06d.tar``
    (WebDataset layout, a new shard past ``spec.shard_bytes``) and ``composition.json``.
    Existing ``posix/`` and ``shards/`` under ``out_dir`` are replaced. ``processes`` > 1 (or
    None: every CPU) makes samples in a process pool; the bytes are the same either way.
    ``progress`` gets a line now and then (counts, elapsed seconds)."""
    from fastmm.sources.shards import write_shards

    if shutil.which("ffmpeg") is None and spec.num_videos:
        try:
            import av  # noqa: F401
        except ImportError:
            raise RuntimeError("encoding videos needs the ffmpeg CLI (or PyAV); install FFmpeg")
    backend = photo_backend(spec)
    out_dir = os.path.abspath(out_dir)
    posix_dir, shard_dir = os.path.join(out_dir, "posix"), os.path.join(out_dir, "shards")
    for d in (posix_dir, shard_dir):
        shutil.rmtree(d, ignore_errors=True)
    os.makedirs(posix_dir)
    tmp_dir = os.path.join(out_dir, ".tmp")
    os.makedirs(tmp_dir, exist_ok=True)
    jobs = [(spec, "image", i, backend, tmp_dir) for i in range(spec.num_images)]
    jobs += [(spec, "video", i, backend, tmp_dir) for i in range(spec.num_videos)]
    total, start, last = len(jobs), time.perf_counter(), [0.0]
    if progress:
        progress(f"mmcorpus: {spec.num_images} images + {spec.num_videos} videos into {out_dir} "
                 f"(photos: {backend})")

    stats = {"image_sizes": [], "image_bytes": {"jpg": 0, "png": 0}, "image_counts":
             {"jpg": 0, "png": 0}, "large": 0, "video": [], "video_bytes": 0, "text_bytes": 0,
             "sources": {}, "labels": {}}
    manifest = []

    def written(done_samples):
        for n, (key, members) in enumerate(done_samples, 1):
            rel = {}
            for ext, data in members.items():
                path = os.path.join(posix_dir, f"{key}.{ext}")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data)
                rel[ext] = f"{key}.{ext}"
            meta = json.loads(members["json"])
            stats["text_bytes"] += len(members["txt"]) + len(members["cls"]) + len(members["json"])
            stats["sources"][meta["source"]] = stats["sources"].get(meta["source"], 0) + 1
            stats["labels"][meta["label"]] = stats["labels"].get(meta["label"], 0) + 1
            if meta["kind"] == "image":
                fmt = meta["format"]
                stats["image_sizes"].append((meta["width"], meta["height"]))
                stats["image_bytes"][fmt] += len(members[fmt])
                stats["image_counts"][fmt] += 1
            else:
                stats["video"].append(meta)
                stats["video_bytes"] += len(members["mp4"])
            manifest.append({"key": key, "members": rel})
            now = time.perf_counter()
            if progress and (now - last[0] > 2.0 or n == total):
                last[0] = now
                progress(f"mmcorpus: {n}/{total} samples, {now - start:.1f} s")
            yield key, members

    procs = processes or len(os.sched_getaffinity(0))
    try:
        if procs > 1 and total > 1:
            with multiprocessing.get_context("fork").Pool(procs) as pool:
                shard_paths = write_shards(written(pool.imap(_make, jobs, chunksize=1)), shard_dir,
                                           max_bytes=spec.shard_bytes)
        else:
            shard_paths = write_shards(written(map(_make, jobs)), shard_dir,
                                       max_bytes=spec.shard_bytes)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    manifest.sort(key=lambda m: m["key"])
    with open(os.path.join(posix_dir, "manifest.jsonl"), "w", encoding="utf-8") as f:
        for m in manifest:
            f.write(json.dumps(m, sort_keys=True) + "\n")

    from PIL import __version__ as pil_version

    sizes, videos = stats["image_sizes"], stats["video"]
    shorts = [min(s) for s in sizes]
    composition = {
        "version": MMCORPUS_VERSION,
        "spec": spec.to_json(),
        "photos": backend,
        "tools": {"pillow": pil_version, "ffmpeg": _ffmpeg_version() if videos else None},
        "counts": {
            "samples": len(manifest), "images": len(sizes), "jpg": stats["image_counts"]["jpg"],
            "png": stats["image_counts"]["png"], "videos": len(videos),
            "video_frames": sum(v["frames"] for v in videos), "shards": len(shard_paths),
            "large_images": sum(1 for s in shorts if s >= 1080),
        },
        "bytes": {
            "jpg": stats["image_bytes"]["jpg"], "png": stats["image_bytes"]["png"],
            "mp4": stats["video_bytes"], "text": stats["text_bytes"],
            "posix_total": (stats["image_bytes"]["jpg"] + stats["image_bytes"]["png"]
                            + stats["video_bytes"] + stats["text_bytes"]),
            "shards_total": sum(os.path.getsize(p) for p in shard_paths),
        },
        "image_short_side_hist": _histogram(shorts, SHORT_SIDE_EDGES),
        "image_megapixels": {
            "mean": float(np.mean([w * h for w, h in sizes]) / 1e6) if sizes else 0.0,
            "max": float(max((w * h for w, h in sizes), default=0) / 1e6),
        },
        "image_resolutions": _counts(f"{w}x{h}" for w, h in sizes) if len(sizes) <= 64 else None,
        "video_frames_hist": _histogram([v["frames"] for v in videos], FRAME_COUNT_EDGES),
        "video_fps": _counts(str(v["fps"]) for v in videos),
        "video_sizes": _counts(f"{v['width']}x{v['height']}" for v in videos),
        "video_keyint": _counts(str(v["keyint"]) for v in videos),
        "video_duration_s": {
            "total": float(sum(v["duration_s"] for v in videos)),
            "min": float(min((v["duration_s"] for v in videos), default=0.0)),
            "max": float(max((v["duration_s"] for v in videos), default=0.0)),
        },
        "sources": dict(sorted(stats["sources"].items())),
        "labels": {str(k): v for k, v in sorted(stats["labels"].items())},
        "shards": [os.path.basename(p) for p in shard_paths],
    }
    with open(os.path.join(out_dir, "composition.json"), "w", encoding="utf-8") as f:
        json.dump(composition, f, indent=1, sort_keys=True)
        f.write("\n")
    if progress:
        progress(f"mmcorpus: done: {len(manifest)} samples, {len(shard_paths)} shards, "
                 f"{composition['bytes']['shards_total'] / 2**20:.1f} MiB in shards, "
                 f"{time.perf_counter() - start:.1f} s")
    return composition


def _counts(values) -> dict:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


def _size(text: str) -> tuple[int, int]:
    """A WIDTHxHEIGHT video size."""
    try:
        width, height = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not WIDTHxHEIGHT: {text!r}") from None
    return width, height


@options.command
def main(argv=None) -> int:
    d = CorpusSpec()
    ap = argparse.ArgumentParser(prog="python -m fastmm.bench.mmcorpus",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=options.directory, required=True, help="output directory")
    ap.add_argument("--images", type=options.whole(0), default=d.num_images)
    ap.add_argument("--videos", type=options.whole(0), default=d.num_videos)
    ap.add_argument("--seed", type=options.whole(0), default=d.seed)
    ap.add_argument("--shard-bytes", type=options.whole(1), default=d.shard_bytes)
    ap.add_argument("--png-fraction", type=float, default=d.png_fraction)
    ap.add_argument("--jpeg-quality", type=int, default=d.jpeg_quality)
    ap.add_argument("--short-side", type=int, nargs=2, default=d.image_short_side,
                    metavar=("LO", "HI"))
    ap.add_argument("--large-fraction", type=float, default=d.large_fraction)
    ap.add_argument("--large-short-side", type=int, nargs=2, default=d.large_short_side,
                    metavar=("LO", "HI"))
    ap.add_argument("--duration", type=float, nargs=2, default=d.video_duration_s,
                    metavar=("LO", "HI"), help="video duration range in seconds")
    ap.add_argument("--fps", type=options.listed(options.whole(1)),
                    default=",".join(map(str, d.video_fps)), help="choices, e.g. 24,30")
    ap.add_argument("--video-sizes", type=options.listed(_size),
                    default=",".join(f"{w}x{h}" for w, h in d.video_sizes))
    ap.add_argument("--keyint", type=options.listed(options.whole(1)),
                    default=",".join(map(str, d.video_keyint)))
    ap.add_argument("--photos", choices=("auto", "skimage", "procedural"), default=d.photos)
    ap.add_argument("--processes", type=options.whole(0), default=0, help="0: every CPU")
    a = ap.parse_args(argv)
    try:
        spec = CorpusSpec(
            num_images=a.images, num_videos=a.videos, seed=a.seed, shard_bytes=a.shard_bytes,
            png_fraction=a.png_fraction, jpeg_quality=a.jpeg_quality,
            image_short_side=tuple(a.short_side), large_fraction=a.large_fraction,
            large_short_side=tuple(a.large_short_side), video_duration_s=tuple(a.duration),
            video_fps=tuple(a.fps), video_sizes=tuple(a.video_sizes),
            video_keyint=tuple(a.keyint), photos=a.photos)
    except ValueError as e:
        ap.error(str(e))
    comp = write_corpus(spec, a.out, processes=a.processes or None,
                        progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(json.dumps({"out": os.path.abspath(a.out), "counts": comp["counts"],
                      "bytes": comp["bytes"]}, indent=1))
    return 0


__all__ = ["CorpusSpec", "index_pattern", "read_frame_index", "write_corpus", "main"]

if __name__ == "__main__":
    sys.exit(main())
