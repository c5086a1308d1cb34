"""NVIDIA DALI decoder: small pipelines per decoder object (8-bit, 16-bit, and a JPEG crop
decoding only its region), each fed one image per run.

CPU mode (``device="cpu"``: a pipeline with ``device_id=None``) runs anywhere and is tested.
``device="cuda[:N]"`` uses DALI's "mixed" decoder (nvJPEG / nvImageCodec on the GPU) and
returns a CUDA tensor; that path is NOT tested here and needs a check on a GPU machine.
Images only; DALI's video readers want files and whole pipelines, not a bytes-in API.
"""

from __future__ import annotations

import gc
import os
from typing import Callable

import numpy as np
import torch
from nvidia.dali import fn, pipeline_def, types

from .library import LibraryDecoder
from .base import (
    NOT_SAMPLE_ERRORS,
    PNG_SIGNATURE,
    CropPlan,
    DecodeError,
    DecoderFault,
    DecodeLimits,
    check_gpu_usable,
    crop_resize,
    jpeg_frame_header,
    jpeg_size,
    to_rgb_chw,
)


# A DALI pipeline that became cyclic garbage must not be finalized in a forked child: its
# destructor waits on the executor's threads, which the child does not have, and the child hangs
# (seen: a DataLoader worker stuck in ~Executor2 under the garbage collector). Objects a child
# inherits are frozen there, out of the collector's reach; their memory is the parent's anyway.
os.register_at_fork(after_in_child=gc.freeze)


class Decoder(LibraryDecoder):
    name = "dali"
    label = "DALI"
    not_native = ("gif", "webp extended")  # DALI reads the simple WebP layout only

    def __init__(self, *, device: str = "cpu", limits: DecodeLimits | None = None):
        super().__init__(device=device, limits=limits)
        self._pipes: dict[str, object] = {}  # "8 bits", "16 bits" or "crop" -> built pipeline

    def __getstate__(self):  # a built pipeline cannot travel to worker processes
        return {**self.__dict__, "_pipes": {}}

    def decode_resized_crop(
        self, data: bytes, plan: Callable[[int, int], CropPlan], *, key: str = "",
        reduce: bool = False,
    ) -> torch.Tensor:
        """An 8-bit JPEG's crop is planned from its frame header and only the crop's region is
        decoded (DALI's region-of-interest decode: the same pixels as cropping the whole
        image, 25% less time per 224 crop here); other images as every library backend does.

        Args:
            data: the encoded image.
            plan: makes the CropPlan from the image's size, ``plan(width, height)``.
            key: the sample's key, for errors.
            reduce: a hint this backend ignores: it decodes at full size.
        """
        size = jpeg_size(data)
        if size is None or _may_be_wide(data):
            return super().decode_resized_crop(data, plan, key=key, reduce=reduce)
        self.limits.check_image(*size, key)
        p = plan(*size)
        window = np.array([p.top, p.left], np.int32), np.array([p.height, p.width], np.int32)
        region, shape = self._decoded(data, key, lambda d: self._run("crop", d, *window))
        if tuple(shape[:2]) != size[::-1]:  # the decoder read another frame header
            raise DecodeError("corrupt", key, f"the decoder sees {tuple(shape[:2])}, the frame "
                              f"header says {size[::-1]}")
        img = to_rgb_chw(region.permute(2, 0, 1), key, contiguous=False)
        return crop_resize(img, p._replace(top=0, left=0))

    def _decode_chw(self, data: bytes) -> torch.Tensor:
        (hwc,) = self._run("16 bits" if _may_be_wide(data) else "8 bits", data)
        return hwc.permute(2, 0, 1)

    def _run(self, kind: str, data: bytes, *window: np.ndarray) -> list:
        """One image through the pipeline of that kind: the HWC pixels as a torch tensor (then,
        from the crop pipeline, the shape DALI read, as a numpy array); RuntimeError if DALI
        fails."""
        if kind not in self._pipes:
            check_gpu_usable(self.device)
            try:
                self._pipes[kind] = self._build(kind)
            except Exception as e:
                raise DecoderFault(f"DALI could not build its {kind} pipeline on "
                                   f"{self.device}: {str(e)[:300]}") from e
        pipe = self._pipes[kind]
        try:
            pipe.feed_input("enc", [np.frombuffer(data, np.uint8)])
            if window:
                pipe.feed_input("anchor", [window[0]])
                pipe.feed_input("shape", [window[1]])
            outs = pipe.run()
        except NOT_SAMPLE_ERRORS:
            raise
        except Exception as e:
            del self._pipes[kind]  # a failed run may leave it unusable; rebuild next time
            raise RuntimeError(str(e)[:300]) from None  # DALI's messages run to pages
        if self.device.startswith("cuda"):
            # __dlpack__ makes torch's stream wait for DALI's; DALI's default (dynamic) executor
            # leaves the output to us, so the next run does not write over it
            first = torch.from_dlpack(outs[0].as_tensor())[0]
        else:
            first = torch.from_numpy(np.array(outs[0].at(0)))
        return [first, *(np.array(o.at(0)) for o in outs[1:])]  # peek_image_shape: a CPU op

    def _build(self, kind: str):
        gpu = self.device.startswith("cuda")
        device_id = (int(self.device.split(":")[1]) if ":" in self.device else 0) if gpu else None
        where = "mixed" if gpu else "cpu"

        @pipeline_def(batch_size=1, num_threads=1, device_id=device_id, prefetch_queue_depth=1)
        def pipe():
            enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1)
            if kind != "crop":
                dtype = types.DALIDataType.UINT16 if kind == "16 bits" else types.DALIDataType.UINT8
                return fn.decoders.image(enc, device=where, output_type=types.RGB, dtype=dtype,
                                         adjust_orientation=False)
            anchor = fn.external_source(name="anchor", dtype=types.INT32, ndim=1)
            shape = fn.external_source(name="shape", dtype=types.INT32, ndim=1)
            region = fn.decoders.image_slice(enc, anchor, shape, device=where,
                                             output_type=types.RGB, axis_names="HW",
                                             normalized_anchor=False, normalized_shape=False,
                                             adjust_orientation=False)
            return region, fn.peek_image_shape(enc, adjust_orientation=False)

        p = pipe()
        p.build()
        return p


def _may_be_wide(data: bytes) -> bool:
    """Whether an image may hold more than 8 bits per sample, so DALI must hand out 16 bits
    (shifted back to 8 in to_rgb_chw: the v >> 8 rule every backend follows, which DALI's own
    8-bit output rounds differently). 8-bit JPEGs and PNGs, nearly all images, take DALI's
    8-bit output, exact for them and about 4x faster on the CPU here."""
    frame = jpeg_frame_header(data)
    if frame is not None:
        return data[frame + 4] > 8  # sample precision: 8, or 12 (rare)
    if data.startswith(PNG_SIGNATURE) and data[12:16] == b"IHDR" and len(data) > 24:
        return data[24] > 8  # IHDR bit depth
    return True
