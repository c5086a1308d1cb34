"""What a dataset may offer fastmm.DataLoader, by attribute, found on it or on the datasets it
wraps (``.dataset``; ConcatDataset's ``.datasets``). The loader, its workers and its state
know datasets only through these, so a user's dataset can offer what fastmm's own do.

- ``fastmm_skip_counts``: counts of bad samples met, one row per process in shared memory
  (``MultimodalDataset``'s): ``ROWS``, ``row(worker_id)`` (None: the main process),
  ``set_row(worker_id, counts)``, ``met()`` (the total) and ``handed_out(rows)`` (a context in
  which its totals are those of the batches handed out). A worker sends its row with each
  batch, so a replacement worker starts from the row of its predecessor's last batch received,
  and a loader's state counts only the batches handed out.
- ``fastmm_decode_deadline``: a decode deadline (``dataset.DecodeDeadline``): which sample each
  worker is on and since when; the loader replaces a worker stuck past it. (Its older name,
  ``fastmm_sample_watch``, is read too.)
- ``fastmm_marks_sample_stage = True``: the dataset records its own per-sample telemetry spans.
- ``fastmm_epoch``: the epoch its ``set_epoch`` was given in the main process; persistent
  workers' copies are given it too at each new epoch (``ShardStream``'s). torch passes nothing
  to persistent workers, so other datasets' copies keep their own, as there.
"""

from __future__ import annotations

import contextlib

from ._wrappers import all_wrapped


def skip_counts(dataset) -> "SkipCountsOf | None":
    """The skip counts ``dataset`` or the datasets it wraps offer (several, as one), or None."""
    parts = all_wrapped(dataset, "fastmm_skip_counts")
    return SkipCountsOf(parts) if parts else None


def decode_deadlines(dataset, enforce: bool = False) -> list:
    """The decode deadlines ``dataset`` or the datasets it wraps offer (also under the older
    name ``fastmm_sample_watch``); ``enforce``: marked as held to by a loader."""
    found = all_wrapped(dataset, "fastmm_decode_deadline")
    found += [d for d in all_wrapped(dataset, "fastmm_sample_watch")
              if not any(d is f for f in found)]
    for deadline in found if enforce else ():
        deadline.enforced = True
    return found


def marks_sample_stage(dataset) -> bool:
    return any(all_wrapped(dataset, "fastmm_marks_sample_stage"))


def epoch(dataset) -> int | None:
    """The epoch to give persistent workers' copies of ``dataset``, if it asks for that."""
    return getattr(dataset, "fastmm_epoch", None)


class SkipCountsOf:
    """Several datasets' skip counts, their rows end to end."""

    def __init__(self, parts: list):
        self.parts = parts
        self.ROWS = min(part.ROWS for part in parts)
        self._widths = [len(part.row(None)) for part in parts]

    def _split(self, counts: list[int]) -> list[list[int]]:
        out, start = [], 0
        for width in self._widths:
            out.append(counts[start:start + width])
            start += width
        return out

    def row(self, worker_id: int | None) -> list[int]:
        return [n for part in self.parts for n in part.row(worker_id)]

    def met(self) -> int:
        """Bad samples met so far (skipped or replaced), in every process."""
        return sum(part.met() for part in self.parts)

    def set_row(self, worker_id: int | None, counts: list[int]) -> None:
        for part, row in zip(self.parts, self._split(counts)):
            part.set_row(worker_id, row)

    @contextlib.contextmanager
    def handed_out(self, rows: list):
        split = [None if r is None else self._split(r) for r in rows]
        with contextlib.ExitStack() as stack:
            for i, part in enumerate(self.parts):
                stack.enter_context(part.handed_out([None if r is None else r[i] for r in split]))
            yield
