"""Decoders: bytes to uint8 tensors (images 3xHxW RGB, clips TxCxHxW RGB).

``get_decoder(name)`` picks a backend from DECODERS (argument, then FASTMM_DECODE, then "pil");
each backend's library is imported only when that backend is asked for.
"""

from __future__ import annotations

from .base import (
    DECODERS,
    ClipSpec,
    DecodeError,
    DecodeLimitError,
    DecodeLimits,
    DecoderFault,
    ImageDecoder,
    VideoDecoder,
    get_decoder,
)

__all__ = [
    "ClipSpec",
    "DECODERS",
    "DecodeError",
    "DecodeLimitError",
    "DecodeLimits",
    "DecoderFault",
    "ImageDecoder",
    "VideoDecoder",
    "get_decoder",
]
