"""Pillow decoder: images only, CPU only; the default because Pillow is everywhere.

``reduce_to`` uses Pillow's JPEG draft mode (DCT scaling by 1/2, 1/4 or 1/8 inside libjpeg),
which skips most of the inverse DCT when the target is at most half the source size.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch
from PIL import Image

from .base import DecodeError, DecodeLimitError, DecodeLimits


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
        with im:
            self.limits.check_image(im.width, im.height, key)  # header only, nothing decoded yet
            if reduce_to is not None and im.format == "JPEG":
                h, w = reduce_to
                im.draft("RGB", (w, h))
            try:
                return _to_tensor(im)
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
