"""A dataset that wraps another (torch's Subset, fastmm's ShardStream, a user's stream) keeps it
as ``.dataset``; torch's ConcatDataset keeps several as ``.datasets``. What fastmm needs of the
inner ones (their skip counts, their decode deadlines, whether they mark their own sample spans,
their state) is found through such wrappers."""

from __future__ import annotations

_DEPTH = 4  # levels of wrapping looked through


def all_wrapped(dataset, name: str) -> list:
    """Every distinct attribute ``name`` of ``dataset`` or of the datasets it wraps (through
    ``.dataset`` and ConcatDataset's ``.datasets``), in the same order in every process."""
    found, level = [], [dataset]
    for _ in range(_DEPTH):
        inner = []
        for d in level:
            value = getattr(d, name, None)
            if value is not None:
                if not any(value is f for f in found):
                    found.append(value)
                continue
            if getattr(d, "dataset", None) is not None:
                inner.append(d.dataset)
            datasets = getattr(d, "datasets", None)
            if isinstance(datasets, (list, tuple)):
                inner.extend(datasets)
        level = inner
    return found
