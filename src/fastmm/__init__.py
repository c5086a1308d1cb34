"""fastmm: a drop-in torch DataLoader for image and video pretraining that measures what it replaces."""

from torch.utils.data import get_worker_info

from .config import ConfigError, TransportConfig
from .loader import DataLoader
from .slabs import SharedMemoryError, uses_cpp

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DataLoader",
    "SharedMemoryError",
    "TransportConfig",
    "get_worker_info",
    "uses_cpp",
]
