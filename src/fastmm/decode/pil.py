"""Pillow decoder: images only, CPU only; the default because Pillow is everywhere.

``reduce_to`` uses Pillow's JPEG draft mode (DCT scaling by 1/2, 1/4 or 1/8 inside libjpeg),
which skips most of the inverse DCT when the target is at most half the source size.
"""

from __future__ import annotations

import warnings
from typing import Callable

import numpy as np
import torch
from PIL import Image

from .base import (CropPlan, DecodeError, DecodeLimits, crop_resize, jpeg_scalable,
                   open_image_header)


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
        with open_image_header(data, key, self.limits) as im:
            if reduce_to is not None and im.format == "JPEG" and jpeg_scalable(data):
                h, w = reduce_to
                im.draft("RGB", (w, h))
            return self.pixels(im, key, to_tensor)

    def decode_resized_crop(
        self, data: bytes, plan: Callable[[int, int], CropPlan], *, key: str = "",
        reduce: bool = False,
    ) -> torch.Tensor:
        """Decode, crop and resize (bilinear, antialiased) as ``plan(width, height)`` says; the
        plan is made from the header, before any pixel is decoded.

        Args:
            data: the encoded image.
            plan: makes the CropPlan from the image's size.
            key: the sample's key, for errors.
            reduce: False: all in Pillow, bit-exact with torchvision's v2 ``resized_crop`` on a
                PIL image. True, the fast path: a JPEG whose crop box is at least twice the
                output size is decoded at 1/2, 1/4 or 1/8 scale inside libjpeg (DCT scaling,
                never below the output size) and resized from the box by Pillow at sub-pixel
                precision; any other image is resized by torch's vectorised uint8 kernel (about
                twice Pillow's speed, within one level of it). Pixels differ slightly
                (docs/dataset.md gives the figures).
        """
        with open_image_header(data, key, self.limits) as im:
            p = plan(im.width, im.height)
            if not reduce:
                return self.pixels(im, key, lambda img: _pil_resized_crop(img, p))
            scale = self.draft(im, p, data)
            if scale is not None:
                return self.reduced_crop(im, p, scale, key)
            return self.pixels(im, key, lambda img: crop_resize(hwc_view(img), p))

    def draft(self, im: Image.Image, p: CropPlan, data: bytes) -> tuple[float, float] | None:
        """Ask libjpeg for the smallest DCT scale that keeps the crop box at least as large as
        the output; the (x, y) scale if that is below 1, else None (decode at full size: also
        for a lossless JPEG, which has no DCT to scale)."""
        if im.format != "JPEG" or not jpeg_scalable(data):
            return None
        full_w, full_h = im.size
        im.draft("RGB", (-(-full_w * p.out_width // p.width), -(-full_h * p.out_height // p.height)))
        scale = (im.width / full_w, im.height / full_h)
        return None if scale == (1.0, 1.0) else scale

    def reduced_crop(self, im: Image.Image, p: CropPlan, scale: tuple[float, float],
                     key: str) -> torch.Tensor:
        """Decode a drafted JPEG and resize from the plan's box, scaled, at sub-pixel precision.

        Args:
            im: the JPEG opened by Pillow, its draft set (``draft``).
            p: the crop plan, in full-size pixels.
            scale: the (x, y) scale the draft gave (``draft``'s answer).
            key: the sample's key, for errors.
        """
        sx, sy = scale
        box = (p.left * sx, p.top * sy, (p.left + p.width) * sx, (p.top + p.height) * sy)
        return self.pixels(im, key, lambda img: _pil_resized_crop(img, p, box))

    @staticmethod
    def pixels(im: Image.Image, key: str, convert) -> torch.Tensor:
        try:
            return convert(im)
        except DecodeError:
            raise
        except Exception as e:
            raise DecodeError("corrupt", key, f"decoding failed: {e}") from None


def _pil_resized_crop(img: Image.Image, p: CropPlan, box=None) -> torch.Tensor:
    """torchvision's resized_crop on a PIL image (crop, then bilinear resize), then flip; or,
    given a float ``box``, one resize from that box (integer pre-reduction for large factors)."""
    if img.mode not in ("RGB", "I;16", "I;16B", "I;16L", "I"):
        img = img.convert("RGB")
    size = (p.out_width, p.out_height)
    if box is not None:
        img = img.resize(size, Image.BILINEAR, box=box, reducing_gap=2.0)
    else:
        img = img.crop((p.left, p.top, p.left + p.width, p.top + p.height))
        if img.size != size:
            img = img.resize(size, Image.BILINEAR)
    if p.flip:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return to_tensor(img)


def hwc_view(im: Image.Image) -> torch.Tensor:
    """The decoded pixels as a 3xHxW view of one HxWx3 copy (torch's resize takes it as is)."""
    if im.mode != "RGB":
        return to_tensor(im)
    with warnings.catch_warnings():  # read-only memory: only read by the resize
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(im)).permute(2, 0, 1)


def to_tensor(im: Image.Image) -> torch.Tensor:
    """The colour rules of fastmm.decode.base, in Pillow terms."""
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16-bit gray: top 8 bits, as other backends
        a = np.asarray(im).astype(np.int64).clip(0, 65535) >> 8
        a = np.repeat(a.astype(np.uint8)[:, :, None], 3, axis=2)
    else:
        if im.mode != "RGB":
            im = im.convert("RGB")  # L/1 repeat, RGBA/LA drop alpha, P via palette, CMYK
        a = np.asarray(im)
    return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
