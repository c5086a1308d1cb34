"""Pure-Python twin of fastmm._C: the same functions with the same errors, for machines
without a compiler and for FASTMM_PURE_PYTHON=1. Tests run the loader against both."""

from __future__ import annotations

import errno
import os

import numpy as np


def create_slab(dir: str, nbytes: int) -> int:
    """An unnamed shared-memory file in ``dir`` with ``nbytes`` reserved; returns its fd."""
    if nbytes <= 0:
        raise ValueError("slab size must be positive")
    try:
        fd = os.open(dir, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        fd = os.memfd_create("fastmm-slab", os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        raise OSError(exc.errno, os.strerror(exc.errno), dir) from None
    return fd


def gather(dst, offset: int, srcs, stride: int) -> None:
    """Copy ``srcs[i]`` into ``dst`` at ``offset + i*stride``, as fastmm._C.gather.

    Args:
        dst: a writable buffer.
        offset: where the first source goes, in bytes.
        srcs: buffers to copy, in order.
        stride: bytes from one source's place to the next's.
    """
    if offset < 0 or stride < 0:
        raise ValueError("offset and stride must be non-negative")
    out = _writable_bytes(dst)
    views = []
    for i, src in enumerate(srcs):
        view = np.frombuffer(src, dtype=np.uint8)
        start = offset + i * stride
        if view.nbytes > stride or start + view.nbytes > out.nbytes:
            raise ValueError(
                f"sample {i} ({view.nbytes} bytes) does not fit its slot (slot {i} of {stride} "
                f"bytes after offset {offset}, buffer of {out.nbytes} bytes)"
            )
        views.append((start, view))
    for start, view in views:
        out[start : start + view.nbytes] = view


def planes(dst, src) -> None:
    """Copy ``src``, bytes viewed as (..., C, H, W) with each pixel's C channels side by side,
    into the C-contiguous ``dst`` of as many bytes."""
    out = _writable_bytes(dst)
    view = memoryview(src)
    nd, strides = view.ndim, view.strides
    if not (view.itemsize == 1 and nd >= 3 and strides[-3] == 1 and view.shape[-3] > 1
            and view.shape[-3] <= strides[-1] <= 4):
        raise ValueError("src must be 1-byte elements viewed as (..., C, H, W) with each "
                         "pixel's channels side by side (strides (..., 1, row, P), "
                         "1 < C <= P <= 4)")
    if out.nbytes != view.nbytes:
        raise ValueError(f"dst holds {out.nbytes} bytes, src {view.nbytes}")
    np.copyto(out.reshape(view.shape), np.asarray(view).view(np.uint8))


def _writable_bytes(dst) -> np.ndarray:
    """``dst``'s bytes, refused as C refuses a read-only buffer."""
    if memoryview(dst).readonly:
        raise BufferError("Object is not writable.")
    return np.frombuffer(dst, dtype=np.uint8)
