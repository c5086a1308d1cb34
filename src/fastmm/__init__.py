"""fastmm: a drop-in torch DataLoader for image and video pretraining that measures what it replaces.

The names below load their module when first used (PEP 562), so ``import fastmm.loader`` loads
the loader side only, and ``import fastmm`` costs little more than torch itself.
"""

from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.1.0"

_HOME = {  # public name -> the module that defines it
    "ClipSpec": "fastmm.decode",
    "ConfigError": "fastmm.config",
    "DataLoader": "fastmm.loader",
    "DecodeError": "fastmm.decode",
    "DecodeLimitError": "fastmm.decode",
    "DecodeLimits": "fastmm.decode",
    "DecoderFault": "fastmm.decode",
    "DistributedSampler": "fastmm.distributed",
    "FastmmWarning": "fastmm.errors",
    "MultimodalDataset": "fastmm.dataset",
    "ObjectStoreError": "fastmm.sources",
    "ResizedCrop": "fastmm.dataset",
    "ShardStream": "fastmm.stream",
    "SharedMemoryError": "fastmm.slabs",
    "SourceError": "fastmm.sources",
    "StagingError": "fastmm.sources",
    "TransportConfig": "fastmm.config",
    "get_worker_info": "torch.utils.data",
    "uses_cpp": "fastmm._native",
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:  # fastmm.telemetry, ...
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
