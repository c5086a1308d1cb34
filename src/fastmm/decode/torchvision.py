"""torchvision decoder: libjpeg-turbo on the CPU, nvJPEG on CUDA for batches of JPEGs; PNGs
through torchcodec's libpng decoder where torchcodec is installed, else Pillow.

The CUDA path (``device="cuda[:N]"``, ``decode_jpeg_batch``) is written to torchvision's
documented API but NOT tested here: it needs a check on a GPU machine.
"""

from __future__ import annotations

import functools
import io
import warnings
from typing import Callable

import torch
import torchvision.io as tvio
from PIL import Image

from .library import LibraryDecoder
from .base import (
    NOT_SAMPLE_ERRORS,
    CropPlan,
    DecodeError,
    DecodeLimits,
    PNG_SIGNATURE,
    check_gpu_usable,
    crop_resize,
    jpeg_size,
    open_image_header,
    probe_image,
    to_rgb_chw,
)
from .pil import hwc_view
from .pil import to_tensor as pil_to_tensor


def _decode(data: bytes) -> torch.Tensor:
    """JPEGs through torchvision (libjpeg-turbo), PNGs through torchcodec where it is installed,
    other formats through Pillow."""
    if data.startswith(PNG_SIGNATURE) and _png_decoder() is not None:
        return _png_decoder()(_as_tensor(data), mode="RGB", output_dtype="auto")
    if not data.startswith(b"\xff\xd8"):
        with Image.open(io.BytesIO(data)) as im:
            return pil_to_tensor(im)
    # torchvision 0.29 warns on every decode that torchcodec supersedes it; picking this backend
    # is the user's informed choice (torchcodec is a backend too), so the warning is noise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return tvio.decode_image(_as_tensor(data), mode=tvio.ImageReadMode.RGB)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@functools.cache
def _png_decoder():
    """torchcodec's decode_png, or None without torchcodec (or the FFmpeg libraries it loads).
    It decodes PNGs about 1.5x as fast as Pillow here with the same pixels, and raised on each of
    5,000 damaged PNGs (their CRCs made valid again) where torchvision's own libpng binding
    killed the process (SIGSEGV after "libpng error: IDAT: invalid distance too far back")."""
    try:
        from torchcodec.decoders import decode_png
    except Exception:  # ImportError, or RuntimeError when FFmpeg's libraries are missing
        return None
    return decode_png


class Decoder(LibraryDecoder):
    name = "torchvision"
    label = "torchvision"
    turns_upright = ("png",)  # torchcodec's PNG decoder (_png_decoder) does

    def __init__(self, *, device: str = "cpu", limits: DecodeLimits | None = None):
        # torchvision deprecated its image decoders in 0.29 for torchcodec's: once a release
        # drops them, every decode would fail and be counted as a corrupt sample instead
        missing = [name for name in ("decode_image", "decode_jpeg", "ImageReadMode")
                   if not hasattr(tvio, name)]
        if missing:
            import torchvision

            raise ImportError(
                f"decoder 'torchvision': torchvision {torchvision.__version__} has no "
                f"torchvision.io.{', '.join(missing)} (its image decoders, deprecated since "
                "0.29); use the 'torchcodec' decoder, or torchvision<=0.29"
            )
        super().__init__(device=device, limits=limits)  # self._pil: headers, DCT-scaled JPEGs

    def _decode_chw(self, data: bytes) -> torch.Tensor:
        return _decode(data)

    def decode_resized_crop(
        self, data: bytes, plan: Callable[[int, int], CropPlan], *, key: str = "",
        reduce: bool = False,
    ) -> torch.Tensor:
        """Decode, crop and resize as ``plan(width, height)`` says, the plan made from the
        header (a JPEG's frame header is read directly, other formats' through Pillow).
        libjpeg-turbo decodes straight into a tensor, cropped as a view and resized by torch's
        vectorised uint8 kernel.

        Args:
            data: the encoded image.
            plan: makes the CropPlan from the image's size.
            key: the sample's key, for errors.
            reduce: a JPEG whose crop box is at least twice the output size is decoded at a
                DCT-reduced scale, through Pillow (torchvision does not expose libjpeg's
                scaling).
        """
        size = jpeg_size(data)
        if size is not None:
            self.limits.check_image(*size, key)
            return self._jpeg_resized_crop(data, plan(*size), key, reduce)
        im = open_image_header(data, key, self.limits, unidentified_ok=True)
        if im is None:  # a header Pillow does not know: decode first, plan from the pixels
            return super().decode_resized_crop(data, plan, key=key)
        with im:
            p = plan(im.width, im.height)
            if data.startswith(b"\xff\xd8"):  # a JPEG whose header only Pillow could read
                return self._jpeg_resized_crop(data, p, key, reduce)
            if im.format == "PNG" and _png_decoder() is not None:
                img = to_rgb_chw(self._decoded(data, key), key, contiguous=False)
                if img.shape[-2:] != (im.height, im.width):
                    raise DecodeError("corrupt", key, f"decoded {tuple(img.shape[-2:])}, the "
                                      f"header says {(im.height, im.width)}")
                return crop_resize(img, p)
            return self._pil.pixels(im, key, lambda img: crop_resize(hwc_view(img), p))

    def _jpeg_resized_crop(self, data: bytes, p: CropPlan, key: str, reduce: bool) -> torch.Tensor:
        """A JPEG decoded, cropped and resized as its plan says: by libjpeg-turbo, or, with
        ``reduce`` and a box large enough, at a DCT-reduced scale through Pillow.

        Args:
            data: the encoded JPEG.
            p: the crop plan, made from its size.
            key: the sample's key, for errors.
            reduce: allow the DCT-reduced decode (decode_resized_crop's ``reduce``).
        """
        if reduce and p.width >= 2 * p.out_width and p.height >= 2 * p.out_height:
            # a box under twice the output in either direction never gets a reduced scale, so
            # only these are opened in Pillow
            with open_image_header(data, key, self.limits) as im:
                scale = self._pil.draft(im, p, data)
                if scale is not None:
                    return self._pil.reduced_crop(im, p, scale, key)
        img = self._decoded(data, key)
        return crop_resize(to_rgb_chw(img, key, self.limits, contiguous=False), p)

    def decode_jpeg_batch(self, datas: list[bytes], *, keys: list[str] | None = None):
        """Decode JPEGs together; on CUDA through nvJPEG in one call (GPU check pending).

        Returns a list of uint8 3xHxW RGB tensors on ``self.device``."""
        keys = keys or [""] * len(datas)
        for d, k in zip(datas, keys):
            probe_image(d, k, self.limits)
        if not self.device.startswith("cuda"):
            return [self.decode_image(d, key=k) for d, k in zip(datas, keys)]
        check_gpu_usable(self.device)
        try:
            out = tvio.decode_jpeg(
                [_as_tensor(d) for d in datas], mode=tvio.ImageReadMode.RGB, device=self.device
            )
        except NOT_SAMPLE_ERRORS:
            raise
        except Exception as e:
            raise DecodeError("corrupt", ",".join(keys), f"nvJPEG batch failed: {e}") from None
        return list(out)
