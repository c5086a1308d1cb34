"""A training job for tests/test_resume.py: one rank (RANK / WORLD_SIZE from the environment)
reads two epochs through fastmm.DataLoader (shuffled, augmented from all three RNGs, persistent
workers, prefetching), appends every batch to a file, and after each batch saves the loader's
state and the main process's RNG states atomically, as a training checkpoint would. With
``--resume`` it starts from the saved checkpoint instead."""

import json
import os
import random
import sys
import time

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import fastmm
from fastmm import resume

EPOCHS = 2


class Augmented(Dataset):
    """Item i with one draw from each RNG a transform may use."""

    def __init__(self, n: int = 37):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i, torch.randint(0, 10**6, ()).item(), random.randrange(10**6),
                             np.random.randint(10**6)])


class GaussianEvery(Dataset):
    """Item i with one NumPy Gaussian: NumPy makes them in pairs and keeps the second, so every
    other item uses up the cached one without moving the generator's words."""

    def __init__(self, n: int = 13):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i), float(np.random.standard_normal())], dtype=torch.float64)


class AugmentedStream(IterableDataset):
    """Ids split across workers unevenly (worker w gets every n-th id from w, and worker 0 has
    a longer tail), each with one draw from each RNG."""

    def __init__(self, n: int = 29):
        self.n = n

    def ids(self) -> list[int]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        return list(range(wid, self.n, nw)) + ([100 + k for k in range(5)] if wid == 0 else [])

    @staticmethod
    def augment(i: int) -> torch.Tensor:
        return torch.tensor([i, torch.randint(0, 10**6, ()).item(), random.randrange(10**6),
                             np.random.randint(10**6)])

    def __iter__(self):
        for i in self.ids():
            yield self.augment(i)


class PositionedStream(AugmentedStream):
    """Keeps its own position in state_dict() and starts there after load_state_dict(), as
    torchdata's and HF datasets' resumable streams do (skipping to it draws nothing)."""

    def __init__(self, n: int = 29):
        super().__init__(n)
        self.pos = self.start = 0

    def __iter__(self):
        start, self.start = self.start, 0
        for k, i in enumerate(self.ids()):
            if k >= start:
                self.pos = k + 1
                yield self.augment(i)
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.start = state["pos"]


class StaysAtItsEnd(AugmentedStream):
    """Keeps how far it got in state_dict() and starts its next iterator there after
    load_state_dict(), its end included, as torchdata's GeneratorIterable and Hugging Face's
    resumable streams do: its state as an epoch ran out says "nothing left"."""

    def __init__(self, n: int = 29):
        super().__init__(n)
        self.pos, self.start = 0, None

    def __iter__(self):
        start, self.start = self.start or 0, None
        self.pos = start
        for k, i in enumerate(self.ids()):
            if k >= start:
                self.pos = k + 1
                yield self.augment(i)

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.start = state["pos"]


class EpochStream(PositionedStream):
    """Also counts its own epochs in each copy, advanced as its iterator runs out (as streams
    that reshuffle without set_epoch() do), and puts the count in its ids."""

    def __init__(self, n: int = 29):
        super().__init__(n)
        self.epoch = 0

    def __iter__(self):
        for item in super().__iter__():
            item[0] += 1000 * self.epoch
            yield item
        self.epoch += 1

    def state_dict(self):
        return {**super().state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.epoch = state["epoch"]


def make_loader(num_workers: int = 2) -> fastmm.DataLoader:
    dataset = Augmented()
    sampler = fastmm.DistributedSampler(dataset, seed=3)  # rank and world from the environment
    return fastmm.DataLoader(dataset, batch_size=3, sampler=sampler, num_workers=num_workers,
                             persistent_workers=num_workers > 0,
                             prefetch_factor=3 if num_workers else None)


def _save(path: str, state: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(out: str, resume_from_checkpoint: bool) -> None:
    rank = os.environ.get("RANK", "0")
    log_path, ckpt_path = f"{out}/rank{rank}.jsonl", f"{out}/rank{rank}.ckpt.json"
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    loader = make_loader()
    done = 0  # batches over all epochs
    if resume_from_checkpoint:
        with open(ckpt_path) as f:
            ckpt = json.load(f)
        loader.load_state_dict(ckpt["loader"])
        resume.apply_rng(resume.decode_rng(ckpt["rng"]))
        done = ckpt["done"]
    total = EPOCHS * len(loader)
    with open(log_path, "a") as log:
        while done < total:
            for batch in loader:
                log.write(json.dumps({"step": done, "batch": batch.tolist()}) + "\n")
                log.flush()
                done += 1
                _save(ckpt_path, {"loader": loader.state_dict(), "done": done,
                                  "rng": resume.encode_rng(resume.capture_rng())})
                time.sleep(float(os.environ.get("JOB_STEP_SLEEP", "0")))


if __name__ == "__main__":
    main(sys.argv[1], "--resume" in sys.argv[2:])
