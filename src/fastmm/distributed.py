"""Samples split across the ranks of a distributed job without glue code.

``DistributedSampler`` is torch's (same split, same padding rule, same seeded shuffle, so it is
interchangeable with it), except that it finds rank and world size the way torchrun sets them
(torch.distributed when initialised, else RANK / WORLD_SIZE) instead of requiring an initialised
process group, and that each new pass over it reshuffles by itself (unless ``set_epoch`` is
called, which then rules as in torch). Every rank gets ``ceil(N / world_size)`` samples: the
shuffled order is padded by repeating its first samples (``drop_last=True``: the tail is
dropped instead), so all ranks yield the same number of batches and no collective waits for a
rank that ran out. Workers of one rank then share that rank's samples through the loader's
batches, disjointly, as always. ``state_dict()`` keeps the epoch, so a resumed job reshuffles as
the uninterrupted one would.
"""

from __future__ import annotations

import torch.utils.data

from .config import DistConfig


class DistributedSampler(torch.utils.data.DistributedSampler):
    """torch's DistributedSampler that finds rank and world size the way torchrun sets them and
    reshuffles each pass by itself (see the module).

    Args:
        dataset: the dataset whose indices are split (only its length is used).
        num_replicas: the world size; None: torch.distributed's when initialised, else
            WORLD_SIZE, else 1.
        rank: this process's rank; None: torch.distributed's when initialised, else RANK,
            else 0.
        shuffle: shuffle the indices, from ``seed`` and the epoch (the same order on every
            rank).
        seed: the shuffle's seed; the same on every rank.
        drop_last: drop the tail so that the ranks split the indices evenly, instead of
            padding by repeating the first ones.
    """

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        where = DistConfig.resolve(rank=rank, world_size=num_replicas)
        super().__init__(dataset, num_replicas=where.world_size, rank=where.rank,
                         shuffle=shuffle, seed=seed, drop_last=drop_last)
        self._epoch_set = False

    def set_epoch(self, epoch: int) -> None:
        """Fix the epoch (as in torch); from then on the sampler no longer advances by itself."""
        self._epoch_set = True
        super().set_epoch(epoch)

    def __iter__(self):
        """A pass: drawn for ``self.epoch`` at its first index, not when made (a loader makes
        iterators it never draws from: batch_size=None, workers), so only a pass taken
        advances the epoch."""
        indices = super().__iter__()
        if not self._epoch_set:
            self.epoch += 1  # the next pass reshuffles, the same way on every rank
        yield from indices

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "epoch_set": self._epoch_set,
                "rank": self.rank, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        """The epoch (and whether set_epoch fixed it); the split stays this sampler's own (the
        loader refuses a mid-epoch resume onto another world size)."""
        self.epoch = int(state["epoch"])
        self._epoch_set = bool(state["epoch_set"])
