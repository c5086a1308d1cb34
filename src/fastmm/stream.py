"""Tar shards streamed to a distributed job: whole shards per (rank, worker), and the same number
of samples from each, so every rank yields the same number of batches and no collective waits
for a rank that ran out."""

from __future__ import annotations

from typing import Literal

import torch
from torch.utils.data import IterableDataset, get_worker_info

from .config import DistConfig


class ShardStream(IterableDataset):
    """An IterableDataset over a ``MultimodalDataset`` whose source is tar shards ("shards", or
    "staged" shards): each (rank, worker) slot reads whole shards front to back.

    Each epoch the shards are shuffled with ``seed + epoch`` (the same order on every rank) and
    dealt out one by one, each to the slot holding the fewest samples so far. Then every slot
    yields the same number of samples: ``equal="pad"`` (default) as many as the fullest slot
    holds, a slot with fewer going round its own shards again for the rest (every sample at
    least once per epoch, like DistributedSampler's padding); ``equal="drop"`` as many as the
    emptiest slot holds (the rest of that epoch's samples are left out; other epochs deal the
    shards differently). With the same ``num_workers`` and ``batch_size`` on every rank, every
    rank yields the same number of batches. A bad sample that ``on_error="skip"`` leaves out is
    made up by the slot's next one, so the counts stay equal.

    Rank and world size: arguments, else torch.distributed, else torchrun's RANK / WORLD_SIZE.
    Call ``set_epoch(epoch)`` before each epoch to reshuffle, as with torch's
    DistributedSampler; ``fastmm.DataLoader`` passes it on to persistent workers too.
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

    def __iter__(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        slots, per_slot = self.plan(num_workers)
        indices = [i for shard in slots[self.rank * num_workers + worker] for i in self.shards[shard]]
        yielded = 0
        while yielded < per_slot:
            made = 0
            for i in indices:
                item = self.dataset[i]
                if item is None:  # left out by on_error="skip": the next sample stands in
                    continue
                yield item
                made += 1
                yielded += 1
                if yielded == per_slot:
                    return
            if not made:
                raise RuntimeError(
                    f"every sample of rank {self.rank} worker {worker}'s shards was bad "
                    f"(counts so far: {self.dataset.skipped})"
                )

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "dataset": self.dataset.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.dataset.load_state_dict(state["dataset"])


__all__ = ["ShardStream"]
