"""torchcodec decoder: video clips through FFmpeg (CPU, or NVDEC with device="cuda[:N]"),
and images through torchcodec's own image decoders.

Clip caps are checked from the container metadata (frame count and size) before any frame is
decoded. On the CPU, an H.264 or HEVC MP4 is first slimmed (``mp4.slim_clip``): the frames the
clip's frames don't need (non-reference ones it does not return, and all after its last) are
left out before FFmpeg sees them, with the same pixels. The CUDA (NVDEC) path is torchcodec's
``device=`` argument and is NOT tested here: it needs a check on a GPU machine.
"""

from __future__ import annotations

from typing import Callable

import torch
import torchcodec
from torchcodec import decoders as tcd
from torchcodec.transforms import DecoderTransform

from . import mp4
from .library import LibraryDecoder
from .base import (
    NOT_SAMPLE_ERRORS,
    ClipSpec,
    CropPlan,
    DecodeError,
    DecoderFault,
    check_gpu_usable,
    crop_resize,
)


class Decoder(LibraryDecoder):
    name = "torchcodec"
    label = "torchcodec"
    not_native = ("bmp", "tiff")
    turns_upright = ("jpeg", "png", "webp extended")  # FFmpeg does

    def __init__(self, *, skip_unused_frames: bool | None = None, **kwargs):
        """``skip_unused_frames``: None (default) slims MP4s on the CPU only; True on NVDEC
        too (to be checked on a GPU machine first: tests/test_gpu.py); False decodes every
        frame from the keyframe on, as torchcodec alone does (the frames returned are the
        same)."""
        super().__init__(**kwargs)
        self.skip_unused_frames = skip_unused_frames

    def _decode_chw(self, data: bytes) -> torch.Tensor:
        return tcd.decode_image(
            torch.frombuffer(bytearray(data), dtype=torch.uint8), mode="RGB", output_dtype="auto"
        )

    def decode_clip(
        self, data: bytes, spec: ClipSpec, *, key: str = "",
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """uint8 TxCxHxW RGB clip and the source frame index of each of its frames.

        Args:
            data: the encoded video.
            spec: which frames make the clip.
            key: the sample's key, for errors and a seeded ClipSpec's draw.
            generator: the RNG of a "random" clip (see ClipSpec).
        """
        return self._clip(data, spec, key, generator, [])

    def decode_resized_clip(
        self, data: bytes, spec: ClipSpec, plan: Callable[[int, int], CropPlan], *,
        key: str = "", generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """The clip cropped and resized as ``plan(width, height)`` says (one plan for all its
        frames). FFmpeg crops each frame before it is handed over, so only the box is converted
        to RGB and copied (the same pixels as cropping afterwards); the plan is drawn when the
        video is opened, before the clip's start frame. The clip may be channels-last in
        memory: the batch's stack makes the one copy it needs.

        Args:
            data: the encoded video.
            spec: which frames make the clip.
            plan: makes the CropPlan from the frame size; where the container gives none, from
                the decoded frames' size.
            key: the sample's key, for errors and a seeded ClipSpec's draw.
            generator: the RNG of a "random" clip (see ClipSpec).
        """
        crop = _PlannedCrop(plan)
        try:
            frames, idx = self._clip(data, spec, key, generator, [crop])
        except DecodeError:
            if crop.plan is not None:
                raise
            # no frame size in the container (or no video at all): plan from decoded frames
            frames, idx = self._clip(data, spec, key, generator, [])
            return crop_resize(frames, plan(frames.shape[-1], frames.shape[-2]), contiguous=False), idx
        return crop_resize(frames, crop.plan._replace(top=0, left=0), contiguous=False), idx

    def _clip(self, data, spec, key, generator, transforms):
        """The clip's frames and their source indices: from the slimmed MP4 where it can be
        slimmed (``skip_unused_frames``), else from the video as it is; caps checked from the
        container's metadata before any frame is decoded.

        Args:
            data: the encoded video.
            spec: which frames make the clip (a ClipSpec).
            key: the sample's key, for errors and a seeded ClipSpec's draw.
            generator: the RNG of a "random" clip (see ClipSpec).
            transforms: torchcodec decoder transforms applied to each frame (a _PlannedCrop),
                or [].
        """
        if not data:
            raise DecodeError("empty", key, "zero-byte video")
        check_gpu_usable(self.device)
        slims = self.skip_unused_frames or self.skip_unused_frames is None and self.device == "cpu"
        track = mp4.parse(data) if slims else None
        idx = None
        if track is not None:
            try:
                idx = spec.frame_indices(track.num_frames, track.average_fps(), key=key,
                                         generator=generator)
            except DecodeError:  # the decoder's own count decides
                track = None
        if track is not None:
            slim = mp4.slim_clip(data, track, idx)
            frames = slim and self._slim_clip(slim, spec, key, transforms)
            if frames is not None:
                return frames, idx
        try:
            # "exact" scans the packets once (no pixels) for true frame counts and seeking
            dec = tcd.VideoDecoder(data, device=self.device, seek_mode="exact",
                                   transforms=transforms or None)
            meta = dec.metadata
        except NOT_SAMPLE_ERRORS:
            raise
        except Exception as e:
            if built_without_cuda(e):
                raise DecoderFault(
                    f"torchcodec {torchcodec.__version__} was built without CUDA: install a "
                    "CUDA build (PyPI's torchcodec 0.17 is one, for CUDA 13; PyPI's 0.11 is "
                    "CPU-only, its CUDA builds are at https://download.pytorch.org/whl/cu130) "
                    "or decode on the CPU") from None
            raise DecodeError(_open_failure(data), key, f"no readable video stream: {e}") from None
        total = meta.num_frames or 0
        if total < 1:
            raise DecodeError("no_video", key, "the video has no frames")
        self.limits.check_clip(spec.num_frames, meta.width, meta.height, key)  # before decoding
        if track is None or total != track.num_frames:  # else the draw made from our own parse
            idx = spec.frame_indices(total, meta.average_fps, key=key, generator=generator)
        try:
            frames = dec.get_frames_at(indices=idx).data
        except NOT_SAMPLE_ERRORS:
            raise
        except Exception as e:
            raise DecodeError("corrupt", key, f"decoding frames {idx} failed: {e}") from None
        return frames, idx

    def _slim_clip(self, slim: mp4.Slim, spec, key, transforms) -> torch.Tensor | None:
        """The clip's frames from the slimmed MP4, or None where FFmpeg does not read it as
        mp4.slim_clip expects (then the file is decoded as it is).

        Args:
            slim: the slimmed MP4 and the clip's frames in it (mp4.slim_clip).
            spec: which frames make the clip, for the caps.
            key: the sample's key, for errors.
            transforms: torchcodec decoder transforms applied to each frame, or [].
        """
        try:
            dec = tcd.VideoDecoder(slim.data, device=self.device, seek_mode="exact",
                                   transforms=transforms or None)
            meta = dec.metadata
            if meta.num_frames != slim.num_frames:
                return None
            self.limits.check_clip(spec.num_frames, meta.width, meta.height, key)
            batch = dec.get_frames_at(indices=slim.indices)
        except (DecodeError, *NOT_SAMPLE_ERRORS):
            raise
        except Exception:
            return None
        return batch.data if batch.pts_seconds.tolist() == slim.pts_seconds else None


class _PlannedCrop(DecoderTransform):
    """A decoder-side crop to the box a CropPlan picks once the frame size is known."""

    def __init__(self, plan: Callable[[int, int], CropPlan]):
        self._make_plan = plan
        self.plan: CropPlan | None = None

    def _make_transform_spec(self, input_dims: tuple[int | None, int | None]) -> str:
        height, width = input_dims
        if height is None or width is None:
            raise ValueError("the container gives no frame size to plan the crop from")
        if self.plan is None:  # one plan per clip, however often the video is opened
            self.plan = self._make_plan(width, height)
        p = self.plan
        return f"crop, {p.height}, {p.width}, {p.left}, {p.top}"


def built_without_cuda(error) -> bool:
    """Whether torchcodec refused a CUDA device because it was built without CUDA (as PyPI's
    0.11 wheels are): the error, or its text."""
    return "Unsupported device: cuda" in str(error)


def _open_failure(data: bytes) -> str:
    """Reason a container would not open as video: "no_video" when it is readable media with no
    video stream (audio only, say), else "corrupt". Only asked on the failure path."""
    try:
        meta = tcd.get_container_metadata(data)
    except Exception:
        return "corrupt"
    media = {getattr(s, "media_type", None) for s in meta.streams}
    return "no_video" if media <= {"audio", "subtitle"} else "corrupt"  # {} : no streams
