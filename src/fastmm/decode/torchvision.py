"""torchvision decoder: libjpeg-turbo/libpng on the CPU; nvJPEG on CUDA for batches of JPEGs.

The CUDA path (``device="cuda[:N]"``, ``decode_jpeg_batch``) is written to torchvision's
documented API but NOT tested here: it needs a check on a GPU machine.
"""

from __future__ import annotations

import warnings

import torch
import torchvision.io as tvio

from .base import DecodeError, LibraryDecoder, probe_image


def _decode(data: bytes) -> torch.Tensor:
    # torchvision 0.29 warns on every decode that torchcodec supersedes it; picking this backend
    # is the user's informed choice (torchcodec is a backend too), so the warning is noise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return tvio.decode_image(_as_tensor(data), mode=tvio.ImageReadMode.RGB)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class Decoder(LibraryDecoder):
    name = "torchvision"
    label = "torchvision"

    def _decode_chw(self, data: bytes) -> torch.Tensor:
        return _decode(data)

    def decode_jpeg_batch(self, datas: list[bytes], *, keys: list[str] | None = None):
        """Decode JPEGs together; on CUDA through nvJPEG in one call (GPU check pending).

        Returns a list of uint8 3xHxW RGB tensors on ``self.device``."""
        keys = keys or [""] * len(datas)
        for d, k in zip(datas, keys):
            probe_image(d, k, self.limits)
        if not self.device.startswith("cuda"):
            return [self.decode_image(d, key=k) for d, k in zip(datas, keys)]
        try:
            out = tvio.decode_jpeg(
                [_as_tensor(d) for d in datas], mode=tvio.ImageReadMode.RGB, device=self.device
            )
        except Exception as e:
            raise DecodeError("corrupt", ",".join(keys), f"nvJPEG batch failed: {e}") from None
        return list(out)
