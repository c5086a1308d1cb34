"""The copy kernels: fastmm._C (C++) or its pure-Python twin (fastmm._twin), the one place that
picks between them. The slab transport (slab creation, gather) and the decoders (planes, via
_layout.py) both come here, so decoding never reaches into the transport."""

from __future__ import annotations

from .config import TransportConfig


def _load(pure_python: bool):
    if not pure_python:
        try:
            from . import _C

            return _C
        except ImportError:
            pass
    from . import _twin

    return _twin


def native_backend(config: TransportConfig | None = None):
    """fastmm._C, or the twin where FASTMM_PURE_PYTHON=1 (``config.pure_python``) or the
    extension is not built."""
    config = config or TransportConfig.from_env()
    return _load(config.pure_python)


def uses_cpp(config: TransportConfig | None = None) -> bool:
    """True when the C++ extension is in use (not forced off and importable)."""
    return native_backend(config).__name__ == "fastmm._C"
