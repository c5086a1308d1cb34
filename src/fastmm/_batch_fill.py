"""The batch a worker is fetching, for code that makes its samples one by one.

A producer (the worker's fetcher, telemetry's timed dataset, MultimodalDataset) hands each
sample it makes to ``put``; fastmm's collation (collate.py) then copies the sample's tensors
into the batch at once, while they are still in the core's cache. This module holds only the
announcement, so producers need not import the transport.
"""

from __future__ import annotations

import contextlib

_current = None  # the batch being fetched: an object with put(sample, position), copy_spans


def current():
    """The batch being fetched in this process, or None."""
    return _current


@contextlib.contextmanager
def fetching(batch):
    """``batch`` is the one being fetched until the block ends."""
    global _current
    _current = batch
    try:
        yield batch
    finally:
        _current = None


def no_batch(sample, position: int):
    """What ``sample_by_sample`` gives where no batch is being filled: the sample, unchanged."""
    return sample


@contextlib.contextmanager
def sample_by_sample():
    """``with sample_by_sample() as put:`` around making a batch's samples one by one; keep
    ``put(sample, position)`` in the batch's list in place of each sample. Only the outermost
    producer fills the batch: one nested in it (a dataset calling another's ``__getitems__``
    inside its own ``__getitem__``) gets its samples back unchanged, so no slot is filled twice."""
    global _current
    batch, _current = _current, None
    try:
        yield batch.put if batch is not None else no_batch
    finally:
        _current = batch


def copy_spans() -> list[int]:
    """The batch's copies so far, as flat (start, end) ns pairs: telemetry's collate spans."""
    return _current.copy_spans if _current is not None else []
