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

from .base import DecodeLimits, LibraryDecoder


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
        self._pipe = None

    def __getstate__(self):  # a built pipeline cannot travel to worker processes
        return {**self.__dict__, "_pipe": None}

    def _build(self):
        gpu = self.device.startswith("cuda")
        device_id = (int(self.device.split(":")[1]) if ":" in self.device else 0) if gpu else None

        @pipeline_def(batch_size=1, num_threads=1, device_id=device_id, prefetch_queue_depth=1)
        def pipe():
            enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1)
            # 16-bit output, shifted back to 8 bits in to_rgb_chw: exact for 8-bit sources
            # (v*257 >> 8 == v) and the shared v >> 8 rule for 16-bit ones, which DALI's own
            # 8-bit output rounds differently
            return fn.decoders.image(enc, device="mixed" if gpu else "cpu",
                                     output_type=types.RGB, dtype=types.DALIDataType.UINT16)

        p = pipe()
        p.build()
        return p

    def _decode_chw(self, data: bytes) -> torch.Tensor:
        if self._pipe is None:
            self._pipe = self._build()
        try:
            self._pipe.feed_input("enc", [np.frombuffer(data, np.uint8)])
            (out,) = self._pipe.run()
        except Exception as e:
            self._pipe = None  # a failed run may leave the pipeline unusable; rebuild next time
            raise RuntimeError(str(e)[:300]) from None  # DALI's messages run to pages
        if self.device.startswith("cuda"):
            hwc = torch.from_dlpack(out.as_tensor()._expose_dlpack_capsule())[0]
        else:
            hwc = torch.from_numpy(np.array(out.at(0)))
        return hwc.permute(2, 0, 1)
