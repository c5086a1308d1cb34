"""What every decoder shares: clip specs, caps, typed errors, colour rules and the registry.

Decoders turn bytes into uint8 tensors: images as 3xHxW RGB, clips as TxCxHxW RGB. They never
import fastmm.sources, slabs or collate; optional libraries are imported only inside their own
backend module, so ``import fastmm.decode`` costs nothing extra.

Colour rules, the same in every backend (so a PNG decodes to the same bytes everywhere):
grayscale is repeated into R, G and B; an alpha channel is dropped (not composited over a
background); palette images are expanded through their palette; 16-bit samples keep their top
8 bits (``v >> 8``); CMYK JPEGs become RGB by the library's own conversion (the one rule that may
differ between backends, by more than the JPEG tolerance).

Bad input raises DecodeError (a ValueError) with ``key`` and ``reason``; the dataset's on_error
policy decides what to do with it. Caps (DecodeLimits) are checked from the header or container
metadata before pixels are allocated, and raise DecodeLimitError.
"""

from __future__ import annotations

import importlib
import io
import struct
import warnings
import zlib
from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple, Protocol, runtime_checkable

import torch

from .. import _layout, _torch
from ..config import DECODE_BACKENDS, DecodeConfig
from ..errors import SampleError


class DecodeError(SampleError):
    """Bytes that could not be decoded. ``reason`` is a short counter name: "empty", "corrupt",
    "too_large", "too_short", "no_video", "unsupported", "deadline"."""

    def __init__(self, reason: str, key: str | None = None, message: str = ""):
        super().__init__(reason, key, "", message)  # key None: a worker's text (SampleError)


class DecoderFault(RuntimeError):
    """The decoder itself cannot work (a DALI pipeline that does not build on this device): an
    error for every sample alike, so never counted as a bad sample."""


# What a library raises when our call no longer fits it (an API that changed between releases)
# rather than when the bytes are bad: these propagate, where counting them as corrupt samples
# would skip every sample under on_error="skip".
NOT_SAMPLE_ERRORS = (DecoderFault, AttributeError, TypeError, NameError, ImportError,
                     NotImplementedError)


def check_gpu_usable(device: str) -> None:
    """A process forked after its parent initialised CUDA cannot use it, nor one on a machine
    without CUDA: the libraries raise for every sample, which a backend would otherwise count
    as corrupt. Say so, with the way out."""
    if not device.startswith("cuda"):
        return
    if _torch.is_in_bad_fork():
        raise DecoderFault(
            f"cannot decode on {device} in a process forked after its parent initialised CUDA; "
            "use DataLoader(multiprocessing_context='spawn') (or 'forkserver'), or decode on "
            "the CPU in workers")
    if not torch.cuda.is_available():
        raise DecoderFault(f"cannot decode on {device}: torch sees no CUDA device here; "
                           "decode on the CPU (device='cpu')")


class DecodeLimitError(DecodeError):
    """The input would exceed a DecodeLimits cap; raised before its pixels are allocated."""

    def __init__(self, key: str, message: str | None = None):
        if message is None:  # re-raised from a worker's text (SampleError)
            return super().__init__(key)
        super().__init__("too_large", key, message)


@dataclass(frozen=True, kw_only=True)
class DecodeLimits:
    """Caps that stop decompression bombs and runaway clips before any pixels are allocated.

    ``max_image_pixels`` bounds width*height of an image and of each video frame (default as
    Pillow's warning threshold); ``max_clip_frames`` bounds T; ``max_clip_pixels`` bounds
    T*H*W of one clip (default 2**29, 1.5 GiB of uint8 RGB)."""

    max_image_pixels: int = 89_478_485
    max_clip_frames: int = 1024
    max_clip_pixels: int = 2**29

    def check_image(self, width: int, height: int, key: str) -> None:
        if width <= 0 or height <= 0:
            raise DecodeError("corrupt", key, f"image header says {width}x{height}")
        if width * height > self.max_image_pixels:
            raise DecodeLimitError(
                key, f"{width}x{height} image exceeds max_image_pixels={self.max_image_pixels}"
            )

    def check_clip(self, frames: int, width: int, height: int, key: str) -> None:
        """DecodeLimitError where a clip of this size would pass a cap (each frame is checked
        as an image too).

        Args:
            frames: the clip's frame count (T).
            width: its frames' width in pixels.
            height: its frames' height in pixels.
            key: the sample's key, for the error.
        """
        self.check_image(width, height, key)
        if frames > self.max_clip_frames:
            raise DecodeLimitError(
                key, f"{frames}-frame clip exceeds max_clip_frames={self.max_clip_frames}"
            )
        if frames * width * height > self.max_clip_pixels:
            raise DecodeLimitError(
                key,
                f"{frames}x{width}x{height} clip exceeds max_clip_pixels={self.max_clip_pixels}",
            )


@dataclass(frozen=True, kw_only=True)
class ClipSpec:
    """Which frames make a clip.

    ``num_frames`` frames are taken every ``stride`` source frames, or at ``fps`` frames per
    second (indices are computed from the stream's average rate, i.e. constant frame rate is
    assumed). Neither given means stride 1. ``sampling`` places the clip:

    - "start": the clip begins at frame 0;
    - "random": the start is drawn uniformly from every start that fits the video;
    - "uniform": ``num_frames`` indices spread evenly over the whole video (stride/fps must be
      None; a video shorter than ``num_frames`` repeats frames).

    A video too short for a "start"/"random" clip raises DecodeError(reason="too_short").

    Randomness ("random" only): a ``generator`` passed to ``decode_clip`` is used if given;
    else, with ``seed`` set, a generator seeded from (seed, sample key), so a sample gets the
    same clip in any worker and any epoch; else torch's global RNG, which the DataLoader seeds
    per worker (reproducible the way torch's loader is).
    """

    num_frames: int
    stride: int | None = None
    fps: float | None = None
    sampling: Literal["uniform", "random", "start"] = "start"
    seed: int | None = None

    def __post_init__(self):
        if self.num_frames < 1:
            raise ValueError(f"num_frames={self.num_frames}; need at least 1")
        if self.stride is not None and self.fps is not None:
            raise ValueError("give stride or fps, not both")
        if self.stride is not None and self.stride < 1:
            raise ValueError(f"stride={self.stride}; need at least 1")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"fps={self.fps}; need a positive rate")
        if self.sampling not in ("uniform", "random", "start"):
            raise ValueError(f"sampling={self.sampling!r}; use 'uniform', 'random' or 'start'")
        if self.sampling == "uniform" and (self.stride is not None or self.fps is not None):
            raise ValueError("sampling='uniform' spreads frames over the whole video; "
                             "it takes no stride or fps")

    def frame_indices(
        self,
        total_frames: int,
        average_fps: float | None = None,
        *,
        key: str = "",
        generator: torch.Generator | None = None,
    ) -> list[int]:
        """Source frame indices of the clip, for a video of ``total_frames`` frames.

        Args:
            total_frames: the video's frame count.
            average_fps: the stream's average frame rate, which ``fps`` sampling needs.
            key: the sample's key, for errors and, with ``seed``, the seeded draw.
            generator: the RNG of a "random" clip; None: as the class says.
        """
        if total_frames < 1:
            raise DecodeError("no_video", key, "the video has no frames")
        n = self.num_frames
        if self.sampling == "uniform":
            if n == 1:
                return [(total_frames - 1) // 2]
            return [round(i * (total_frames - 1) / (n - 1)) for i in range(n)]
        if self.fps is not None:
            if not average_fps or average_fps <= 0:
                raise DecodeError("corrupt", key, "fps sampling needs the stream's frame rate")
            step = average_fps / self.fps
        else:
            step = float(self.stride or 1)
        offsets = [int(i * step + 1e-9) for i in range(n)]
        last_start = total_frames - 1 - offsets[-1]
        if last_start < 0:
            raise DecodeError(
                "too_short", key,
                f"a {n}-frame clip spans {offsets[-1] + 1} frames; the video has {total_frames}",
            )
        start = 0
        if self.sampling == "random" and last_start > 0:
            if generator is None and self.seed is not None:
                generator = torch.Generator()
                generator.manual_seed((self.seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
            start = int(torch.randint(last_start + 1, (1,), generator=generator))
        return [start + o for o in offsets]


class CropPlan(NamedTuple):
    """A crop box of the source image (top, left, height, width), the output size it is resized
    to (bilinear, antialiased) and whether to flip it left-right afterwards."""

    top: int
    left: int
    height: int
    width: int
    out_height: int
    out_width: int
    flip: bool = False


def crop_resize(img: torch.Tensor, plan: CropPlan, *, contiguous: bool = True) -> torch.Tensor:
    """Apply a CropPlan to a uint8 CxHxW image or TxCxHxW clip: crop, bilinear antialiased
    resize, flip. ``contiguous=False`` may return the layout the input had (decoded clips are
    channels-last), leaving the one copy to whoever stacks the batch."""
    img = img[..., plan.top : plan.top + plan.height, plan.left : plan.left + plan.width]
    if (plan.height, plan.width) != (plan.out_height, plan.out_width):
        frames = img if img.dim() == 4 else img[None]
        # torch's CPU kernel takes uint8 directly (vectorised, rounds); elsewhere go via float
        cpu = frames.device.type == "cpu"
        out = torch.nn.functional.interpolate(
            frames if cpu else frames.float(), size=(plan.out_height, plan.out_width),
            mode="bilinear", align_corners=False, antialias=True,
        )
        if not cpu:
            out = out.round_().clamp_(0, 255).to(torch.uint8)
        img = out if img.dim() == 4 else out[0]
    if plan.flip:
        img = img.flip(-1)
    return _layout.contiguous(img) if contiguous else img


def open_image_header(data: bytes, key: str, limits: DecodeLimits, *,
                      unidentified_ok: bool = False):
    """The image opened by Pillow, header read and caps checked, no pixel decoded yet (close
    it, or use it in a ``with``).

    Args:
        data: the encoded image.
        key: the sample's key, for errors.
        limits: the caps its size is checked against.
        unidentified_ok: bytes Pillow cannot identify give None; without it they raise
            DecodeError "corrupt".
    """
    from PIL import Image

    if not data:
        raise DecodeError("empty", key, "zero-byte image")
    try:
        with warnings.catch_warnings():
            # our own cap below replaces Pillow's warning; its hard error still applies
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise DecodeLimitError(key, str(e)) from None
    except Exception as e:
        if unidentified_ok:
            return None
        raise DecodeError("corrupt", key, f"not a readable image: {e}") from None
    try:
        limits.check_image(im.width, im.height, key)
    except DecodeError:
        im.close()
        raise
    return im


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_JPEG_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """A JPEG's (width, height) from its frame header (a few microseconds; Pillow's open takes
    ~0.2 ms). None for anything else, or where no usable size is found: callers then open the
    image with Pillow as before."""
    frame = jpeg_frame_header(data)
    if frame is None:
        return None
    height, width = struct.unpack_from(">HH", data, frame + 5)
    return (width, height) if width and height else None  # 0: height in a DNL


def jpeg_frame_header(data: bytes) -> int | None:
    """Offset of a JPEG's frame header (SOFn marker: then length, precision, height, width),
    found by walking the marker segments; None for anything else or a header cut short."""
    if not data.startswith(b"\xff\xd8"):
        return None
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
        elif marker in _JPEG_SOF:
            return i if i + 9 <= n else None
        elif marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:  # no length field
            i += 2
        elif marker in (0xD9, 0xDA):  # end of image, or scan data before any frame header
            return None
        else:
            i += 2 + struct.unpack_from(">H", data, i + 2)[0]
    return None


_MAGIC = ((b"\xff\xd8", "jpeg"), (PNG_SIGNATURE, "png"), (b"GIF87a", "gif"), (b"GIF89a", "gif"),
          (b"BM", "bmp"), (b"II*\x00", "tiff"), (b"MM\x00*", "tiff"))


def image_format(data: bytes) -> str | None:
    """The image format by its first bytes (jpeg, png, gif, bmp, tiff, webp, or "webp extended":
    the VP8X layout, with EXIF, alpha or animation), else None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp extended" if data[12:16] == b"VP8X" else "webp"
    return next((name for magic, name in _MAGIC if data.startswith(magic)), None)


def exif_oriented(data: bytes, fmt: str | None) -> bool:
    """Whether a JPEG, PNG or WebP (``fmt``: its image_format) carries an EXIF orientation other
    than 1. A byte check first (the EXIF block before a JPEG's frame or a PNG's image data, a
    WebP's VP8X flag), so images without one cost nothing more."""
    if fmt == "jpeg":
        frame = jpeg_frame_header(data)
        present = b"Exif\x00\x00" in data[:frame if frame is not None else 65536]
    elif fmt == "png":
        idat = data.find(b"IDAT")
        present = b"eXIf" in data[:idat if idat > 0 else len(data)]
    elif fmt == "webp extended" and len(data) > 20:
        present = bool(data[20] & 0x08)
    else:
        return False
    if not present:
        return False
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.getexif().get(0x0112, 1) != 1
    except Exception:  # a damaged header: the decode says what is wrong
        return False


def jpeg_scalable(data: bytes) -> bool:
    """Whether libjpeg can decode this JPEG at a reduced scale: a DCT frame, not a lossless one
    (SOF3, 7, 11, 15), which draft mode breaks."""
    frame = jpeg_frame_header(data)
    return frame is not None and data[frame + 1] not in (0xC3, 0xC7, 0xCB, 0xCF)


def probe_image(data: bytes, key: str, limits: DecodeLimits) -> None:
    """Check the caps from the image header (a JPEG's read directly, others' by Pillow, which
    reads the header only, lazily).

    Formats Pillow cannot identify (or no Pillow at all) pass through; their backend may still
    decode them, and to_rgb_chw checks the caps after the fact."""
    if not data:
        raise DecodeError("empty", key, "zero-byte image")
    size = jpeg_size(data)
    if size is not None:
        limits.check_image(*size, key)
        return
    try:
        im = open_image_header(data, key, limits, unidentified_ok=True)
    except ImportError:
        return
    if im is not None:
        im.close()


def to_rgb_chw(img: torch.Tensor, key: str, limits: DecodeLimits | None = None, *,
               contiguous: bool = True) -> torch.Tensor:
    """Apply the colour rules to a CHW (or NCHW) tensor from a library decoder.

    Args:
        img: the decoded tensor, CHW (NCHW: an animated image, whose first frame is kept).
        key: the sample's key, for errors.
        limits: check the caps too (for images whose header probe_image could not read); None:
            no check.
        contiguous: False may return a view (of a decoder's HWC memory) for a caller that
            copies anyway.
    """
    if img.dim() == 4:  # animated formats: first frame, as Pillow does
        img = img[0]
    if limits is not None:
        limits.check_image(img.shape[-1], img.shape[-2], key)
    if img.dtype == torch.uint16:
        img = (img.to(torch.int32) >> 8).to(torch.uint8)  # uint16 has no shift kernel
    elif img.dtype != torch.uint8:
        raise DecodeError("unsupported", key, f"decoder returned {img.dtype}")
    c = img.shape[0]
    if c in (1, 2):
        img = img[:1].expand(3, -1, -1)
    elif c == 4:
        img = img[:3]
    elif c != 3:
        raise DecodeError("unsupported", key, f"decoder returned {c} channels")
    return _layout.contiguous(img) if contiguous else img


@runtime_checkable
class ImageDecoder(Protocol):
    """What MultimodalDataset asks of a decoder (every backend's ``Decoder``, or a user's own):
    a name for messages, and images decoded to uint8 3xHxW RGB, whole or cropped and resized
    as a plan made from the image's size says."""

    name: str

    def decode_image(self, data: bytes, *, key: str = "",
                     reduce_to: tuple[int, int] | None = None) -> torch.Tensor: ...

    def decode_resized_crop(self, data: bytes, plan: Callable[[int, int], CropPlan], *,
                            key: str = "", reduce: bool = False) -> torch.Tensor:
        """The image decoded, cropped and resized as ``plan(width, height)`` says.

        Args:
            data: the encoded image.
            plan: makes the CropPlan from the image's size (a ResizedCrop's ``plan``).
            key: the sample's key, for errors.
            reduce: the fast path, where the backend has one (MultimodalDataset's ``reduce``).
        """
        ...


@runtime_checkable
class VideoDecoder(ImageDecoder, Protocol):
    """An ImageDecoder that also decodes clips (uint8 TxCxHxW RGB, and the frame indices)."""

    def decode_clip(self, data: bytes, spec: ClipSpec, *, key: str = "",
                    generator: torch.Generator | None = None
                    ) -> tuple[torch.Tensor, list[int]]:
        """The clip ``spec`` picks (uint8 TxCxHxW RGB) and the source frame index of each of
        its frames.

        Args:
            data: the encoded video.
            spec: which frames make the clip.
            key: the sample's key, for errors and a seeded ClipSpec's draw.
            generator: the RNG of a "random" clip (see ClipSpec).
        """
        ...

    def decode_resized_clip(self, data: bytes, spec: ClipSpec,
                            plan: Callable[[int, int], CropPlan], *, key: str = "",
                            generator: torch.Generator | None = None
                            ) -> tuple[torch.Tensor, list[int]]:
        """The clip, as decode_clip gives it, cropped and resized as ``plan(width, height)``
        says.

        Args:
            data: the encoded video.
            spec: which frames make the clip.
            plan: makes the CropPlan from the frame size: one plan for all the clip's frames.
            key: the sample's key, for errors and a seeded ClipSpec's draw.
            generator: the RNG of a "random" clip (see ClipSpec).
        """
        ...


# name -> module path; each module defines ``Decoder``. What to pip install for each is in
# _PACKAGES here, since a missing package means its module cannot be imported to ask it.
DECODERS: dict[str, str] = {
    "pil": "fastmm.decode.pil",
    "torchvision": "fastmm.decode.torchvision",
    "torchcodec": "fastmm.decode.torchcodec",
    "dali": "fastmm.decode.dali",
}
_PACKAGES = {"pil": "pillow", "torchvision": "torchvision", "torchcodec": "torchcodec",
             "dali": "nvidia-dali-cuda130"}
assert tuple(DECODERS) == DECODE_BACKENDS


def get_decoder(name: str | None = None, *, device: str | None = None,
                limits: DecodeLimits | None = None) -> ImageDecoder:
    """A decoder by name: argument, then FASTMM_DECODE, then "pil"; device likewise with
    FASTMM_DEVICE, then "cpu". A backend whose library is missing raises ImportError naming
    the pip package to install."""
    cfg = DecodeConfig.resolve(backend=name, device=device)
    try:
        module = importlib.import_module(DECODERS[cfg.backend])
    except ImportError as e:
        raise ImportError(
            f"decoder {cfg.backend!r} needs the {_PACKAGES[cfg.backend]!r} package: "
            f"pip install {_PACKAGES[cfg.backend]} ({e})"
        ) from e
    return module.Decoder(device=cfg.device, limits=limits or DecodeLimits())
