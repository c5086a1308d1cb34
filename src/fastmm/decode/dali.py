"""NVIDIA DALI decoder: one small pipeline per decoder object, fed one image per run.

CPU mode (``device="cpu"``: a pipeline with ``device_id=None``) runs anywhere and is tested.
``device="cuda[:N]"`` uses DALI's "mixed" decoder (nvJPEG / nvImageCodec on the GPU) and
returns a CUDA tensor; that path is NOT tested here and needs a check on a GPU machine.
Images only; DALI's video readers want files and whole pipelines, not a bytes-in API.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import torch
from nvidia.dali import fn, pipeline_def, types

from .base import DecodeLimits, LibraryDecoder, jpeg_frame_header


# A DALI pipeline that became cyclic garbage must not be finalized in a forked child: its
# destructor waits on the executor's threads, which the child does not have, and the child hangs
# (seen: a DataLoader worker stuck in ~Executor2 under the garbage collector). Objects a child
# inherits are frozen there, out of the collector's reach; their memory is the parent's anyway.
os.register_at_fork(after_in_child=gc.freeze)


class Decoder(LibraryDecoder):
    name = "dali"
    label = "DALI"

    def __init__(self, *, device: str = "cpu", limits: DecodeLimits | None = None):
        super().__init__(device=device, limits=limits)
        self._pipes: dict[bool, object] = {}  # wide output? -> built pipeline

    def __getstate__(self):  # a built pipeline cannot travel to worker processes
        return {**self.__dict__, "_pipes": {}}

    def _build(self, wide: bool):
        gpu = self.device.startswith("cuda")
        device_id = (int(self.device.split(":")[1]) if ":" in self.device else 0) if gpu else None
        dtype = types.DALIDataType.UINT16 if wide else types.DALIDataType.UINT8

        @pipeline_def(batch_size=1, num_threads=1, device_id=device_id, prefetch_queue_depth=1)
        def pipe():
            enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1)
            return fn.decoders.image(enc, device="mixed" if gpu else "cpu",
                                     output_type=types.RGB, dtype=dtype)

        p = pipe()
        p.build()
        return p

    def _decode_chw(self, data: bytes) -> torch.Tensor:
        wide = _may_be_wide(data)
        if wide not in self._pipes:
            self._pipes[wide] = self._build(wide)
        try:
            self._pipes[wide].feed_input("enc", [np.frombuffer(data, np.uint8)])
            (out,) = self._pipes[wide].run()
        except Exception as e:
            del self._pipes[wide]  # a failed run may leave it unusable; rebuild next time
            raise RuntimeError(str(e)[:300]) from None  # DALI's messages run to pages
        if self.device.startswith("cuda"):
            hwc = torch.from_dlpack(out.as_tensor()._expose_dlpack_capsule())[0]
        else:
            hwc = torch.from_numpy(np.array(out.at(0)))
        return hwc.permute(2, 0, 1)


def _may_be_wide(data: bytes) -> bool:
    """Whether an image may hold more than 8 bits per sample, so DALI must hand out 16 bits
    (shifted back to 8 in to_rgb_chw: the v >> 8 rule every backend follows, which DALI's own
    8-bit output rounds differently). 8-bit JPEGs and PNGs, nearly all images, take DALI's
    8-bit output, exact for them and about 4x faster on the CPU here."""
    frame = jpeg_frame_header(data)
    if frame is not None:
        return data[frame + 4] > 8  # sample precision: 8, or 12 (rare)
    if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR" and len(data) > 24:
        return data[24] > 8  # IHDR bit depth
    return True
