"""What the library-backed image decoders (torchvision, torchcodec, DALI) share; Pillow
decodes the formats they lack."""

from __future__ import annotations

from typing import Callable

import torch

from .base import (NOT_SAMPLE_ERRORS, CropPlan, DecodeError, DecodeLimits, crop_resize,
                   exif_oriented, image_format, probe_image, to_rgb_chw)
from .pil import Decoder as PilDecoder


class LibraryDecoder:
    """What the library-backed image decoders share: caps from the header first, the
    library's errors as DecodeError, then the common colour rules. Subclasses set ``label``
    and implement ``_decode_chw(data)``."""

    name = ""
    label = ""
    # image formats (image_format's names) Pillow decodes instead of the library: those it
    # lacks (a valid BMP or GIF is never counted corrupt for the backend's sake), and those it
    # turns upright by their EXIF orientation (every backend gives pixels as stored, as Pillow
    # and torchvision's decoders do), when they carry one
    not_native: tuple[str, ...] = ()
    turns_upright: tuple[str, ...] = ()

    def __init__(self, *, device: str = "cpu", limits: DecodeLimits | None = None):
        self.device = device
        self.limits = limits or DecodeLimits()
        self._pil = PilDecoder(limits=self.limits)

    def decode_image(
        self, data: bytes, *, key: str = "", reduce_to: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """uint8 3xHxW RGB (``reduce_to`` is accepted and ignored: full size)."""
        probe_image(data, key, self.limits)
        return to_rgb_chw(self._decoded(data, key), key, self.limits)

    def decode_resized_crop(
        self, data: bytes, plan: Callable[[int, int], CropPlan], *, key: str = "",
        reduce: bool = False,
    ) -> torch.Tensor:
        """Decode, then crop and resize as ``plan(width, height)`` says. The crop reads the
        decoder's memory as it is: only the output is copied.

        Args:
            data: the encoded image.
            plan: makes the CropPlan from the decoded image's size.
            key: the sample's key, for errors.
            reduce: a hint this backend ignores: it decodes at full size.
        """
        probe_image(data, key, self.limits)
        img = to_rgb_chw(self._decoded(data, key), key, self.limits, contiguous=False)
        return crop_resize(img, plan(img.shape[-1], img.shape[-2]))

    def _decoded(self, data: bytes, key: str, decode=None):
        """What ``decode(data)`` gives (by default the library's CHW tensor,
        ``_decode_chw``); an error of the library about the bytes is a DecodeError "corrupt"."""
        if decode is None and self._for_pillow(data):
            decode = self._pil.decode_image
        try:
            return (decode or self._decode_chw)(data)
        except NOT_SAMPLE_ERRORS:
            raise
        except Exception as e:
            raise DecodeError("corrupt", key, f"{self.label} could not decode: {e}") from None

    def _for_pillow(self, data: bytes) -> bool:
        """Whether Pillow decodes this image instead of the library (see not_native)."""
        fmt = image_format(data)
        return fmt in self.not_native or (fmt in self.turns_upright and exif_oriented(data, fmt))

    def _decode_chw(self, data: bytes) -> torch.Tensor:
        raise NotImplementedError
