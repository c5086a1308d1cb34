"""torchcodec decoder: video clips through FFmpeg (CPU, or NVDEC with device="cuda[:N]"),
and images through torchcodec's own image decoders.

Clip caps are checked from the container metadata (frame count and size) before any frame is
decoded. The CUDA (NVDEC) path is torchcodec's ``device=`` argument and is NOT tested here:
it needs a check on a GPU machine.
"""

from __future__ import annotations

import torch
from torchcodec import decoders as tcd

from .base import ClipSpec, DecodeError, LibraryDecoder, to_rgb_chw


class Decoder(LibraryDecoder):
    name = "torchcodec"
    label = "torchcodec"

    def _decode_chw(self, data: bytes) -> torch.Tensor:
        return tcd.decode_image(
            torch.frombuffer(bytearray(data), dtype=torch.uint8), mode="RGB", output_dtype="auto"
        )

    def decode_clip(
        self, data: bytes, spec: ClipSpec, *, key: str = "",
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """uint8 TxCxHxW RGB clip and the source frame index of each of its frames."""
        if not data:
            raise DecodeError("empty", key, "zero-byte video")
        try:
            # "exact" scans the packets once (no pixels) for true frame counts and seeking
            dec = tcd.VideoDecoder(data, device=self.device, seek_mode="exact")
            meta = dec.metadata
        except Exception as e:
            raise DecodeError(_open_failure(data), key, f"no readable video stream: {e}") from None
        total = meta.num_frames or 0
        if total < 1:
            raise DecodeError("no_video", key, "the video has no frames")
        self.limits.check_clip(spec.num_frames, meta.width, meta.height, key)  # before decoding
        idx = spec.frame_indices(total, meta.average_fps, key=key, generator=generator)
        try:
            frames = dec.get_frames_at(indices=idx).data
        except Exception as e:
            raise DecodeError("corrupt", key, f"decoding frames {idx} failed: {e}") from None
        return frames, idx


def _open_failure(data: bytes) -> str:
    """Reason a container would not open as video: "no_video" when it is readable media with no
    video stream (audio only, say), else "corrupt". Only asked on the failure path."""
    try:
        meta = tcd.get_container_metadata(data)
    except Exception:
        return "corrupt"
    media = {getattr(s, "media_type", None) for s in meta.streams}
    return "no_video" if media <= {"audio", "subtitle"} else "corrupt"  # {} : no streams
