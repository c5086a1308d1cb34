"""Tar shards streamed to a distributed job: whole shards per (rank, worker), and the same number
of samples from each, so every rank yields the same number of batches and no collective waits
for a rank that ran out."""

from __future__ import annotations

import copy
from typing import Literal

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ._shared import this_worker
from .config import DistConfig


class ShardStream(IterableDataset):
    """An IterableDataset over a ``MultimodalDataset`` whose source is tar shards ("shards", or
    "staged" shards): each (rank, worker) slot reads whole shards front to back.

    Each epoch the shards are shuffled (the same order on every rank) and dealt out one by one,
    each to the slot holding the fewest samples so far. Then every slot yields the same number
    of samples (``equal``). With the same ``num_workers`` and ``batch_size`` on every rank,
    every rank yields the same number of batches. A bad sample that ``on_error="skip"`` leaves
    out is made up by the slot's next one, so the counts stay equal; it is counted once per
    epoch, even when padding tries it again.

    Call ``set_epoch(epoch)`` before each epoch to reshuffle, as with torch's
    DistributedSampler; ``fastmm.DataLoader`` passes it on to persistent workers too. Its
    iterators keep their place in state_dict(), so a resumed loader goes on from there without
    reading again what was handed out. A loader restored mid-epoch with another
    ``num_workers`` or ``batch_size``, or, given every rank's state, at another world size,
    deals the samples not read yet to its slots (``rest_of_epoch``).

    Args:
        dataset: the MultimodalDataset over tar shards.
        equal: "pad" (default): every slot yields as many samples as the fullest slot holds, a
            slot with fewer going round its own shards again for the rest (every sample at
            least once per epoch, like DistributedSampler's padding); "drop": as many as the
            emptiest slot holds (the rest of that epoch's samples are left out; other epochs
            deal the shards differently).
        shuffle: shuffle the shards each epoch; False: the source's order.
        seed: the shards are shuffled with ``seed + epoch``.
        rank: this process's rank; None: torch.distributed's, else torchrun's RANK.
        world_size: ranks in the job; None: torch.distributed's, else torchrun's WORLD_SIZE.
    """

    def __init__(self, dataset, *, equal: Literal["pad", "drop"] = "pad", shuffle: bool = True,
                 seed: int = 0, rank: int | None = None, world_size: int | None = None):
        if equal not in ("pad", "drop"):
            raise ValueError(f"equal={equal!r}; use 'pad' or 'drop'")
        where = DistConfig.resolve(rank=rank, world_size=world_size)
        self.dataset = dataset
        self.equal = equal
        self.shuffle = shuffle
        self.seed = seed
        self.rank, self.world_size = where.rank, where.world_size
        self.epoch = 0
        self.shards = self._group()
        self.rest: dict | None = None  # this epoch's samples left when a job of another shape stopped

    def _group(self) -> list[list[int]]:
        """The dataset's indices, shard by shard (in file order within each)."""
        source = self.dataset.source
        groups: dict[int, list[int]] = {}
        for i, source_index in enumerate(self.dataset._index()):
            shard = source.shard_of(source_index)
            if shard is None:
                raise ValueError(f"ShardStream needs tar shards; the {source.kind!r} source "
                                 "has none (use a DistributedSampler for files)")
            groups.setdefault(shard, []).append(i)
        return [groups[s] for s in sorted(groups)]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        if self.rest is not None and self.rest["epoch"] != self.epoch:
            self.rest = None

    @property
    def fastmm_epoch(self) -> int:
        """The epoch persistent workers' copies are given too (offers.py)."""
        return self.epoch

    def plan(self, num_workers: int = 1) -> tuple[list[list[int]], int]:
        """This epoch's shards (positions in ``self.shards``) for every slot, slot
        ``rank * num_workers + worker``, and the number of samples each slot yields."""
        order = list(range(len(self.shards)))
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = [order[i] for i in torch.randperm(len(order), generator=g).tolist()]
        count = self.world_size * num_workers
        slots: list[list[int]] = [[] for _ in range(count)]
        load = [0] * count
        for shard in order:
            k = min(range(count), key=lambda j: (load[j], j))
            slots[k].append(shard)
            load[k] += len(self.shards[shard])
        if min(load) == 0:
            raise ValueError(
                f"{len(self.shards)} shards cannot feed {self.world_size} ranks x {num_workers} "
                "workers: every (rank, worker) needs a shard of its own. Write smaller shards "
                "or use fewer workers"
            )
        return slots, max(load) if self.equal == "pad" else min(load)

    def slots(self, num_workers: int) -> tuple[list[list[int]], int, int]:
        """This epoch's samples (dataset indices, in read order) of each slot this rank's plan
        covers, how many each yields, and this rank's first slot among them. The slots of
        every rank, from ``plan``; after ``rest_of_epoch``, the samples left dealt in even
        runs to the slots of the ranks the rest is for (every rank's, or this one's)."""
        rest = self._rest_now()
        if rest is not None and rest["ranks"] not in (1, self.world_size):
            raise ValueError(f"this stream's rest of epoch {self.epoch} is for {rest['ranks']} "
                             f"ranks, not {self.world_size}: load every rank's loader state "
                             "(DataLoader.load_state_dict([...])) to deal it anew")
        if rest is None:
            plan, per_slot = self.plan(num_workers)
            return ([[i for shard in shards for i in self.shards[shard]] for shards in plan],
                    per_slot, self.rank * num_workers)
        left = [i for start, end in rest["ranges"] for i in range(start, end)]
        count = rest["ranks"] * num_workers
        runs = [left[k * len(left) // count:(k + 1) * len(left) // count] for k in range(count)]
        samples = rest["samples"]
        per_slot = -(-samples // count) if self.equal == "pad" else samples // count
        if self.equal == "pad" and per_slot:  # a slot dealt nothing goes round another sample
            again = left or [i for shard in self.shards for i in shard]
            runs = [run or [again[k % len(again)]] for k, run in enumerate(runs)]
        return runs, per_slot, (self.rank if rest["ranks"] > 1 else 0) * num_workers

    def __iter__(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        slots, per_slot, first = self.slots(num_workers)
        rest = self._rest_now()  # (its counts go to the first slot of the ranks it is for)
        carried = rest["counted"] if rest is not None and first + worker == 0 else None
        return _Slot(self, slots[first + worker], per_slot, worker, carried)

    def _rest_now(self) -> dict | None:
        """The rest of this epoch (rest_of_epoch's), if the stream is in that epoch."""
        return self.rest if self.rest is not None and self.rest["epoch"] == self.epoch else None

    def rest_of_epoch(self, saved: list[dict]) -> None:
        """Go on with the rest of this epoch at this job's shape, where a job of another shape
        stopped (fastmm.DataLoader calls it when a state saved mid-epoch is loaded at another
        ``num_workers``, ``batch_size`` or world size). Every sample no slot had read is read
        once, in even runs over the new slots (the same on every rank); each slot yields its
        share of what the stopped slots still had to yield, ``equal`` as before; the bad
        samples they counted are counted by this job's first slot.

        Args:
            saved: each stopped rank's place: ``rank``, ``world``, ``num_workers``,
                ``stream`` (this ShardStream's state_dict() as the epoch began) and
                ``slots`` (each of its workers' slot state_dict(), None where it handed out
                nothing, "ended" where it yielded its last). Every rank's, or only this
                rank's where the world size is the same (the rest is then this rank's alone).
        """
        try:
            left, samples, counted = self._left_by(saved)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise ValueError(f"a damaged ShardStream position ({type(e).__name__}: {e})") from None
        ranks = 1 if len(saved) == 1 and saved[0]["world"] == self.world_size else self.world_size
        self.rest = {"epoch": self.epoch, "ranges": _runs(left), "samples": samples,
                     "ranks": ranks, "counted": counted}

    def _left_by(self, saved: list[dict]) -> tuple[list[int], int, list[int] | None]:
        """What the stopped slots of ``saved`` (rest_of_epoch's) had not read, in slot order;
        how many samples they still owed; the bad samples they counted."""
        left, samples, counted = [], 0, None
        for place in sorted(saved, key=lambda p: p["rank"]):
            view = copy.copy(self)
            view.rank, view.world_size = int(place["rank"]), int(place["world"])
            view.epoch = int(place["stream"]["epoch"])
            view.rest = _checked_rest(place["stream"].get("rest"), len(self.dataset),
                                      view.world_size)
            slots, per_slot, first = view.slots(max(1, int(place["num_workers"])))
            for worker, state in enumerate(place["slots"]):
                tried, yielded = ((0, 0) if state is None else (per_slot, per_slot)
                                  if state == "ended" else (state["tried"], state["yielded"]))
                if not (type(tried) is int and type(yielded) is int and 0 <= yielded <= tried):
                    raise ValueError(f"a slot's place {state!r:.80}")
                owed = max(0, per_slot - yielded)
                run = slots[first + worker][tried:]
                left += run if self.equal == "pad" else run[:owed]
                samples += owed
                if isinstance(state, dict):
                    counted = [a + int(b) for a, b in zip(counted or [0] * len(state["counted"]),
                                                          state["counted"])]
        return left, samples, counted

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "dataset": self.dataset.state_dict(), "rest": self.rest}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.dataset.load_state_dict(state["dataset"])
        # (older states have none; one of another world size is dealt anew by rest_of_epoch)
        self.rest = _checked_rest(state.get("rest"), len(self.dataset), None)


def _checked_rest(rest, size: int, world: int | None) -> dict | None:
    """A saved ``rest`` (ShardStream.rest_of_epoch's), checked before it is used: its runs are
    within the dataset's ``size`` samples and it is for one rank or the ``world`` of ranks
    (None: for at most ``size`` ranks, a shard each), so a damaged or hostile one cannot make
    the stream list billions of indices or slots."""
    if rest is None:
        return None
    try:
        runs, epoch, samples, ranks = rest["ranges"], rest["epoch"], rest["samples"], rest["ranks"]
        counted = rest["counted"]
        ok = (all(type(x) is int for x in (epoch, samples, ranks)) and samples >= 0
              and (ranks in (1, world) if world is not None else 1 <= ranks <= max(1, size))
              and all(type(a) is int and type(b) is int and 0 <= a < b <= size for a, b in runs)
              and sum(b - a for a, b in runs) <= size
              and (counted is None or all(type(c) is int and c >= 0 for c in counted)))
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"a damaged ShardStream state: its rest of the epoch {rest!r:.120}")
    return rest


def _runs(indices: list[int]) -> list[list[int]]:
    """``indices`` as [start, end) runs of consecutive values, in their order."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, i + 1])
    return runs


class _Slot:
    """One (rank, worker) slot's samples for an epoch. Its state_dict() is its place in them and
    the bad samples it met, so a resumed loader goes on from there (fastmm.DataLoader and
    torchdata's StatefulDataLoader ask the iterator) instead of reading again what was handed
    out.

    Args:
        stream: the ShardStream it serves.
        indices: the dataset's indices in the slot's shards, in the order they are read.
        per_slot: how many samples the slot yields this epoch (ShardStream.plan).
        worker: the worker it runs in (0 without workers), for errors.
        carried: bad samples counted this epoch by the job of another shape it goes on from.
    """

    def __init__(self, stream: ShardStream, indices: list[int], per_slot: int, worker: int,
                 carried: list[int] | None = None):
        self.stream, self.indices, self.per_slot, self.worker = stream, indices, per_slot, worker
        self.tried = 0  # samples tried, going round the slot's shards again under "pad"
        self.yielded = 0
        self.made = 0  # yielded in this round of the shards: a round with none was all bad
        self._counters = stream.dataset.fastmm_skip_counts
        self._base = self._counts()  # this process's counts as the slot began
        # bad samples a job of another shape counted this epoch, counted as ours when the slot
        # first reads or says its place (a place loaded over it has them already)
        self._carried = carried or None

    def __iter__(self):
        return self

    def __next__(self):
        self._count_carried()
        n = len(self.indices)
        while self.yielded < self.per_slot:
            if self.tried and self.tried % n == 0:
                if not self.made:
                    raise RuntimeError(
                        f"every sample of rank {self.stream.rank} worker {self.worker}'s shards "
                        f"was bad (counts so far: {self.stream.dataset.skipped})"
                    )
                self.made = 0
            # a sample met again on a later round of the slot's shards is not counted again
            item = self.stream.dataset._get(self.indices[self.tried % n], count=self.tried < n)
            self.tried += 1
            if item is None:  # left out by on_error="skip": the next sample stands in
                continue
            self.made += 1
            self.yielded += 1
            return item
        raise StopIteration

    def _counts(self) -> list[int]:
        return self._counters.row(this_worker())

    def _count_carried(self) -> None:
        if self._carried:
            self._counters.set_row(this_worker(),
                                   [n + c for n, c in zip(self._counts(), self._carried)])
            self._carried = None

    def state_dict(self) -> dict:
        self._count_carried()
        now = self._counts()
        return {"tried": self.tried, "yielded": self.yielded, "made": self.made,
                "counted": [n - base for n, base in zip(now, self._base)], "row": now}

    def load_state_dict(self, state: dict) -> None:
        """Go on from ``state``; the bad samples it counted are added to this process's counts
        (the loader restored the dataset's counts as the epoch began), unless they are there:
        fastmm.DataLoader puts a replaced worker's counts back to its last batch received."""
        try:
            tried, yielded, made = (int(state[k]) for k in ("tried", "yielded", "made"))
            counted = [int(n) for n in state["counted"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a damaged ShardStream position ({type(e).__name__}: {e})") from None
        if not (0 <= made <= yielded <= self.per_slot and yielded <= tried
                and len(counted) == len(self._base) and min(counted) >= 0):
            raise ValueError(f"a ShardStream position that does not fit this epoch: {state}")
        self.tried, self.yielded, self.made = tried, yielded, made
        self._carried = None  # (in its counts already: state_dict() counted them first)
        now = self._counts()
        if now != state.get("row"):
            now = [n + c for n, c in zip(now, counted)]
            self._counters.set_row(this_worker(), now)
        self._base = [n - c for n, c in zip(now, counted)]


__all__ = ["ShardStream"]
