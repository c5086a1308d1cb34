"""A dataset that wraps another (torch's Subset, fastmm's ShardStream, a user's stream) keeps it
as ``.dataset``: what fastmm needs of the inner one (its skip counts, its decode deadline, whether
it marks its own sample spans) is found through such wrappers."""

from __future__ import annotations


def wrapped(dataset, name: str):
    """``dataset``'s attribute ``name``, or that of a dataset it wraps, up to four levels."""
    for _ in range(4):
        found = getattr(dataset, name, None)
        if found is not None or not hasattr(dataset, "dataset"):
            return found
        dataset = dataset.dataset
    return None
