"""Pillow decoder: images only, CPU only; the default because Pillow is everywhere.

``reduce_to`` uses Pillow's JPEG draft mode (DCT scaling by 1/2, 1/4 or 1/8 inside libjpeg),
which skips most of the inverse DCT when the target is at most half the source size.
"""

from __future__ import annotations

import io
import warnings
from typing import Callable

import numpy as np
import torch
from PIL import Image

from .base import CropPlan, DecodeError, DecodeLimitError, DecodeLimits


class Decoder:
    name = "pil"

    def __init__(self, *, device: str = "cpu", limits: DecodeLimits | None = None):
        if device != "cpu":
            raise ValueError(f"the pil decoder decodes on the CPU only; got device={device!r}")
        self.device = device
        self.limits = limits or DecodeLimits()

    def decode_image(
        self, data: bytes, *, key: str = "", reduce_to: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """uint8 3xHxW RGB. ``reduce_to=(h, w)``: a JPEG may come back smaller than its full
        size but never smaller than (h, w); other formats come back at full size."""
        with self._open(data, key) as im:
            if reduce_to is not None and im.format == "JPEG":
                h, w = reduce_to
                im.draft("RGB", (w, h))
            return self._pixels(im, key, _to_tensor)

    def decode_resized_crop(
        self, data: bytes, plan: Callable[[int, int], CropPlan], *, key: str = "",
        reduce: bool = False,
    ) -> torch.Tensor:
        """Decode, crop and resize (bilinear, antialiased) as ``plan(width, height)`` says, in
        Pillow: the plan is made from the header, before any pixel is decoded.

        Without ``reduce`` the result is bit-exact with torchvision's v2 ``resized_crop`` on a
        PIL image. With ``reduce``, a JPEG whose crop box is at least twice the output size is
        decoded at 1/2, 1/4 or 1/8 scale inside libjpeg (DCT scaling), never below the output
        size; pixels then differ slightly (see docs/decode.md for the measured gain and error)."""
        with self._open(data, key) as im:
            p = plan(im.width, im.height)
            box = (p.left, p.top, p.left + p.width, p.top + p.height)
            if reduce and im.format == "JPEG":
                full_w, full_h = im.size
                im.draft("RGB", (-(-full_w * p.out_width // p.width),
                                 -(-full_h * p.out_height // p.height)))
                sx, sy = im.width / full_w, im.height / full_h
                if (sx, sy) != (1.0, 1.0):
                    box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)

            def crop(img: Image.Image) -> torch.Tensor:
                if img.mode not in ("RGB", "I;16", "I;16B", "I;16L", "I"):
                    img = img.convert("RGB")
                if reduce:  # box-filter integer reduction first where the factor is large
                    img = img.resize((p.out_width, p.out_height), Image.BILINEAR, box=box,
                                     reducing_gap=2.0)
                else:
                    img = img.crop(box)
                    if img.size != (p.out_width, p.out_height):
                        img = img.resize((p.out_width, p.out_height), Image.BILINEAR)
                if p.flip:
                    img = img.transpose(Image.FLIP_LEFT_RIGHT)
                return _to_tensor(img)

            return self._pixels(im, key, crop)

    def _open(self, data: bytes, key: str) -> Image.Image:
        """The image, header read and caps checked; no pixel decoded yet."""
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
            raise DecodeError("corrupt", key, f"not a readable image: {e}") from None
        try:
            self.limits.check_image(im.width, im.height, key)
        except DecodeError:
            im.close()
            raise
        return im

    @staticmethod
    def _pixels(im: Image.Image, key: str, convert) -> torch.Tensor:
        try:
            return convert(im)
        except DecodeError:
            raise
        except Exception as e:
            raise DecodeError("corrupt", key, f"decoding failed: {e}") from None


def _to_tensor(im: Image.Image) -> torch.Tensor:
    """The colour rules of fastmm.decode.base, in Pillow terms."""
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16-bit gray: top 8 bits, as other backends
        a = np.asarray(im).astype(np.int64).clip(0, 65535) >> 8
        a = np.repeat(a.astype(np.uint8)[:, :, None], 3, axis=2)
    else:
        if im.mode != "RGB":
            im = im.convert("RGB")  # L/1 repeat, RGBA/LA drop alpha, P via palette, CMYK
        a = np.asarray(im)
    return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
