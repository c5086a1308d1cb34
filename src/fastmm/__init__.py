"""fastmm: a drop-in torch DataLoader for image and video pretraining that measures what it replaces."""

from torch.utils.data import get_worker_info

from .config import ConfigError, TransportConfig
from .dataset import MultimodalDataset, ResizedCrop
from .decode import ClipSpec, DecodeError, DecodeLimitError, DecodeLimits, DecoderFault
from .distributed import DistributedSampler
from .errors import FastmmWarning
from .loader import DataLoader
from .slabs import SharedMemoryError, uses_cpp
from .stream import ShardStream
from .sources import ObjectStoreError, SourceError, StagingError

__version__ = "0.1.0"

__all__ = [
    "ClipSpec",
    "ConfigError",
    "DataLoader",
    "DecodeError",
    "DecodeLimitError",
    "DecodeLimits",
    "DecoderFault",
    "DistributedSampler",
    "FastmmWarning",
    "MultimodalDataset",
    "ObjectStoreError",
    "ResizedCrop",
    "ShardStream",
    "SharedMemoryError",
    "SourceError",
    "StagingError",
    "TransportConfig",
    "get_worker_info",
    "uses_cpp",
]
