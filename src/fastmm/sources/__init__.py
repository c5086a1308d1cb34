"""Storage sources: where sample bytes come from (a posix tree or manifest, a staged local copy,
WebDataset tar shards), on local disks or in an S3 store (``s3://``). Sources deal in bytes
only; decoding happens elsewhere.

Every source has ``keys()``, ``len()``, ``read(index) -> Sample`` and
``iter_samples(rank, world_size, worker, num_workers)``; ``open_source`` picks one by name.
"""

from __future__ import annotations

from ..config import SourceConfig
from .base import Problem, Sample, Source, SourceError, slot_of
from .files import FileSource
from .s3 import ObjectStoreError, S3Store
from .shards import ShardSource, write_shards
from .staged import StagedSource, StagingError, write_file_manifest

PosixSource = FileSource  # its older name: it reads s3:// prefixes and manifests too

SOURCES: dict[str, type[Source]] = {
    "posix": FileSource,
    "staged": StagedSource,
    "shards": ShardSource,
}


def source_kind(kind: str | None) -> str:
    """The source name ``kind`` stands for: itself, or for None FASTMM_SOURCE, else "posix"."""
    # stage_dir is the staged source's own business; "" keeps resolve from reading it here
    return SourceConfig.resolve(kind=kind, stage_dir="").kind


def open_source(kind: str | None, root, **options) -> Source:
    """Open a source by name (see ``source_kind``)."""
    return SOURCES[source_kind(kind)](root, **options)


__all__ = [
    "ObjectStoreError",
    "FileSource",
    "PosixSource",
    "Problem",
    "S3Store",
    "SOURCES",
    "Sample",
    "ShardSource",
    "Source",
    "SourceError",
    "StagedSource",
    "StagingError",
    "open_source",
    "slot_of",
    "source_kind",
    "write_file_manifest",
    "write_shards",
]
