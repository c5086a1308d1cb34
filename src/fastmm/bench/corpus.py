"""A deterministic synthetic JPEG corpus, generated once into a cache directory.

The images are photo-like enough for decode cost to be realistic: a smooth two-colour gradient
and a handful of filled shapes drawn at half size and upscaled (soft edges), low-frequency
shading and mild Gaussian grain, saved at JPEG quality 90.
Sizes are ImageNet-like (each side drawn from 300..500 px). Image ``i`` depends only on
``(seed, i)``, so a corpus of N images is the same on every machine with the same Pillow.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

CORPUS_VERSION = 1  # bump when the generator changes, so stale caches are not reused
JPEG_QUALITY = 90
MIN_SIDE, MAX_SIDE = 300, 500


@dataclass(frozen=True)
class Corpus:
    """A generated corpus on disk."""

    root: str
    files: tuple[str, ...]
    num_images: int
    seed: int
    total_bytes: int
    mean_width: float
    mean_height: float
    generated_s: float | None  # seconds spent generating it in this run; None when reused

    def describe(self) -> dict:
        out = asdict(self)
        out.pop("files")
        out["version"] = CORPUS_VERSION
        out["jpeg_quality"] = JPEG_QUALITY
        out["mean_file_bytes"] = self.total_bytes / max(1, self.num_images)
        return out


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastmm" / "bench"


def _image_size(seed: int, index: int) -> tuple[int, int]:
    rng = np.random.default_rng([seed, index, 1])
    width, height = rng.integers(MIN_SIDE, MAX_SIDE + 1, size=2)
    return int(width), int(height)


_NOISE_SIGMA = 6.0  # fine grain, the main source of JPEG entropy
_TEXTURE_AMPLITUDE = 18.0  # low-frequency shading across the image
_noise_tiles: dict[int, np.ndarray] = {}


def _noise_tile(seed: int) -> np.ndarray:
    """A per-corpus tile of fine Gaussian grain (int16), cropped at a random offset per image:
    much cheaper than drawing fresh noise for every pixel of every image."""
    tile = _noise_tiles.get(seed)
    if tile is None:
        rng = np.random.default_rng([seed, 0x6E6F697365])
        side = 2 * MAX_SIDE
        noise = rng.standard_normal((side, side, 3), dtype=np.float32) * _NOISE_SIGMA
        tile = _noise_tiles[seed] = np.rint(noise).astype(np.int16)
    return tile


def make_image(seed: int, index: int):
    """Image ``index`` of the corpus with ``seed``, as a PIL RGB image."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([seed, index])
    width, height = _image_size(seed, index)
    # Gradient and shapes at half resolution, upscaled bicubically: soft edges, like a photo.
    hw, hh = (width + 1) // 2, (height + 1) // 2
    c0 = rng.uniform(0, 255, 3).astype(np.float32)
    c1 = rng.uniform(0, 255, 3).astype(np.float32)
    angle = rng.uniform(0, 2 * math.pi)
    t = (
        np.arange(hw, dtype=np.float32)[None, :] * math.cos(angle)
        + np.arange(hh, dtype=np.float32)[:, None] * math.sin(angle)
    )
    t -= t.min()
    t /= max(float(t.max()), 1e-6)
    small = Image.fromarray((c0 + (c1 - c0) * t[..., None]).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(small)
    for _ in range(int(rng.integers(3, 10))):
        x0, x1 = sorted(rng.integers(-hw // 4, hw + hw // 4, 2).tolist())
        y0, y1 = sorted(rng.integers(-hh // 4, hh + hh // 4, 2).tolist())
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        kind = int(rng.integers(0, 3))
        if kind == 0:
            draw.ellipse((x0, y0, x1 + 1, y1 + 1), fill=fill)
        elif kind == 1:
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            corners = int(rng.integers(3, 7))
            draw.polygon(
                [(int(rng.integers(0, hw)), int(rng.integers(0, hh))) for _ in range(corners)],
                fill=fill,
            )
    pixels = np.asarray(small.resize((width, height), Image.BICUBIC), dtype=np.int16)
    shade = rng.standard_normal((height // 8 + 1, width // 8 + 1), dtype=np.float32)
    shade = np.asarray(Image.fromarray(shade, "F").resize((width, height), Image.BICUBIC))
    pixels += np.rint(shade * _TEXTURE_AMPLITUDE).astype(np.int16)[..., None]
    tile = _noise_tile(seed)
    oy, ox = (int(v) for v in rng.integers(0, tile.shape[0] - MAX_SIDE, 2))
    pixels += tile[oy : oy + height, ox : ox + width]
    np.clip(pixels, 0, 255, out=pixels)
    return Image.fromarray(pixels.astype(np.uint8), "RGB")


def _write_one(job: tuple[str, int, int]) -> int:
    directory, seed, index = job
    path = os.path.join(directory, f"{index:06d}.jpg")
    make_image(seed, index).save(path, "JPEG", quality=JPEG_QUALITY)
    return os.path.getsize(path)


def _corpus_dir(cache_dir: Path, num_images: int, seed: int) -> Path:
    return Path(cache_dir) / f"jpeg-v{CORPUS_VERSION}-n{num_images}-seed{seed}"


def _load(root: Path, num_images: int, seed: int, generated_s: float | None) -> Corpus | None:
    try:
        manifest = json.loads((root / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("version") != CORPUS_VERSION or manifest.get("num_images") != num_images:
        return None
    files = tuple(str(root / f"{i:06d}.jpg") for i in range(num_images))
    if not all(os.path.exists(f) for f in files):
        return None
    return Corpus(
        root=str(root),
        files=files,
        num_images=num_images,
        seed=seed,
        total_bytes=int(manifest["total_bytes"]),
        mean_width=float(manifest["mean_width"]),
        mean_height=float(manifest["mean_height"]),
        generated_s=generated_s,
    )


def ensure_corpus(cache_dir: Path, num_images: int, seed: int = 0, processes: int | None = None,
                  log=None) -> Corpus:
    """The corpus of ``num_images`` JPEGs, generated into ``cache_dir`` unless already there.

    Generation writes into a temporary directory that is renamed into place at the end, so an
    interrupted run never leaves a half corpus that a later run would trust.
    """
    if num_images < 1:
        raise ValueError(f"num_images must be at least 1, got {num_images}")
    root = _corpus_dir(cache_dir, num_images, seed)
    existing = _load(root, num_images, seed, None)
    if existing is not None:
        return existing
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if log:
        log(f"generating {num_images} JPEGs into {root} ...")
    start = time.perf_counter()
    jobs = [(str(tmp), seed, i) for i in range(num_images)]
    processes = processes or len(os.sched_getaffinity(0))
    if processes > 1 and num_images >= 16:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            sizes = pool.map(_write_one, jobs, chunksize=16)
    else:
        sizes = [_write_one(job) for job in jobs]
    dims = [_image_size(seed, i) for i in range(num_images)]
    manifest = {
        "version": CORPUS_VERSION,
        "num_images": num_images,
        "seed": seed,
        "jpeg_quality": JPEG_QUALITY,
        "total_bytes": int(sum(sizes)),
        "mean_width": float(np.mean([w for w, _ in dims])),
        "mean_height": float(np.mean([h for _, h in dims])),
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    try:
        os.rename(tmp, root)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if _load(root, num_images, seed, None) is None:  # not another run finishing first
            raise
    generated_s = time.perf_counter() - start
    corpus = _load(root, num_images, seed, generated_s)
    if corpus is None:
        raise RuntimeError(f"the corpus in {root} is incomplete after generation")
    if log:
        log(f"generated {num_images} JPEGs ({corpus.total_bytes / 2**20:.1f} MiB) in {generated_s:.1f} s")
    return corpus
