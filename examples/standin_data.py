"""Stand-in data for the examples, for when they are not pointed at a user's own folder.

Photo-like JPEGs (each side about 300-500 px) and short H.264 MP4s (320x240, 2-4 s), in class
folders (``<root>/<class>/<file>``, the layout of torchvision's ImageFolder), made by the
benchmark's corpus generator (:mod:`fastmm.bench.mmcorpus`): crops of scikit-image's sample
photos, each class one photo. Item ``i`` depends only on ``(seed, i)``; every video frame draws
its own index in its top-left corner (``mmcorpus.read_frame_index`` reads it back).

A folder is generated once into ``$XDG_CACHE_HOME/fastmm/examples`` (``~/.cache`` when unset),
under a temporary name renamed when complete, so an interrupted run never leaves a half folder
that a later run would trust. How many items: ``EXAMPLE_IMAGES`` / ``EXAMPLE_VIDEOS``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from fastmm.bench import mmcorpus

VERSION = 1  # bump when what is written here changes, so stale caches are not reused
DEFAULT_IMAGES = 384
DEFAULT_VIDEOS = 48

SPEC = dict(png_fraction=0.0, large_fraction=0.0, image_short_side=(300, 500),
            aspect_ratios=(1.0, 4 / 3), video_sizes=((320, 240),), video_duration_s=(2.0, 4.0))


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastmm" / "examples"


def count(variable: str, default: int) -> int:
    """A whole number of items from ``variable``; a bad value names the variable."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{variable}={text!r}: needs a whole number of at least 1")
    return value


def image_folder(seed: int = 0) -> str:
    """The stand-in image folder (``EXAMPLE_IMAGES`` JPEGs), generated on first use."""
    n = count("EXAMPLE_IMAGES", DEFAULT_IMAGES)
    return _once(f"images-v{VERSION}.{mmcorpus.MMCORPUS_VERSION}-n{n}-seed{seed}",
                 lambda out: write_images(out, n, seed))


def video_folder(seed: int = 0) -> str:
    """The stand-in video folder (``EXAMPLE_VIDEOS`` MP4s), generated on first use."""
    n = count("EXAMPLE_VIDEOS", DEFAULT_VIDEOS)
    return _once(f"videos-v{VERSION}.{mmcorpus.MMCORPUS_VERSION}-n{n}-seed{seed}",
                 lambda out: write_videos(out, n, seed))


def write_images(out: str | Path, num_images: int, seed: int = 0) -> None:
    """Write ``out/<class>/<index>.jpg`` for images ``0 .. num_images - 1``."""
    spec = mmcorpus.CorpusSpec(num_images=num_images, num_videos=0, seed=seed, **SPEC)
    backend = mmcorpus.photo_backend(spec)
    for i in range(num_images):
        _, members = mmcorpus.make_image_sample(spec, i, backend)
        folder = Path(out) / json.loads(members["json"])["class"]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:06d}.jpg").write_bytes(members["jpg"])


def write_videos(out: str | Path, num_videos: int, seed: int = 0) -> None:
    """Write ``out/<class>/<index>.mp4`` for videos ``0 .. num_videos - 1``."""
    spec = mmcorpus.CorpusSpec(num_images=0, num_videos=num_videos, seed=seed, **SPEC)
    backend = mmcorpus.photo_backend(spec)
    for i in range(num_videos):
        p, source, frames = mmcorpus.video_frames(spec, i, backend)
        folder = Path(out) / _class_of(source)
        folder.mkdir(parents=True, exist_ok=True)
        mmcorpus.encode_h264(frames, p["width"], p["height"], p["fps"], p["keyint"],
                             spec.video_crf, str(folder / f"{i:06d}.mp4"))


def _class_of(source: str) -> str:
    """The class of a sample made from photo ``source``, as mmcorpus names it."""
    names = mmcorpus.COLOUR_PHOTOS + mmcorpus.GREY_PHOTOS
    return mmcorpus.CLASS_NAMES[names.index(source)] if source in names else "shape"


def _once(name: str, write) -> str:
    """``cache_dir() / name``, written by ``write(tmp)`` and renamed into place if missing."""
    root = cache_dir() / name
    if root.is_dir():
        return str(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.with_name(f".{name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write(tmp)
        os.rename(tmp, root)
    except OSError:
        if not root.is_dir():  # else another process finished the same folder first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(root)
