"""Copies out of interleaved byte layouts: the one case where torch's own copy is slow.

Decoders hand pixels over as HWC memory viewed as CHW (channels-last). Copying such a view
into CHW order, with ``.contiguous()`` or ``torch.stack`` into a batch, torch and NumPy make one
byte at a time: 52-53 us for a 224x224 RGB image on a 2-core Xeon VM, where fastmm._C's
``planes`` (rows vectorized by the compiler) takes 11 us. For other transposes (a float matrix,
say) torch is as fast or faster, so those stay with torch.
"""

from __future__ import annotations

import torch

from ._native import native_backend


def interleaved_bytes(t: torch.Tensor) -> bool:
    """A CPU tensor of 1-byte elements whose channels (dim -3) sit next to each other, in
    pixels of at most 4 bytes."""
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.element_size() == 1
        and t.dim() >= 3
        and 1 < t.shape[-3] <= t.stride(-1) <= 4  # RGB, RGBA, or RGB of RGBA pixels
        and t.stride(-3) == 1
        and not t.requires_grad
    )


def copy_into(out: torch.Tensor, t: torch.Tensor, planes=None) -> torch.Tensor:
    """``out.copy_(t)`` for a contiguous ``out`` of ``t``'s shape and dtype. ``planes``:
    the backend's copy of interleaved bytes (a SlabWriter's; by default FASTMM_PURE_PYTHON's)."""
    if interleaved_bytes(t) and out.dtype == t.dtype and out.shape == t.shape:
        planes = planes or native_backend().planes
        planes(out.view(torch.uint8).numpy(), t.view(torch.uint8).numpy())
        return out
    return out.copy_(t)


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``."""
    if t.is_contiguous() or not interleaved_bytes(t):
        return t.contiguous()
    return copy_into(torch.empty(t.shape, dtype=t.dtype), t)
