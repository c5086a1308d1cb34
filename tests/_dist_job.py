"""A real distributed job for tests/test_distributed.py, run under torchrun (gloo): each rank
loads its share through fastmm.DataLoader + fastmm.DistributedSampler for two epochs, all-reduces
every step, and writes the ids it saw."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import fastmm

N = 103  # not a multiple of 2 or 4: padding shows


class Ids(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor(i)


class Keys(Dataset):
    """Samples of a MultimodalDataset over tar shards (random access through their offset
    index), reduced to their index in the dataset."""

    def __init__(self, shards: str, **source):
        self.ds = fastmm.MultimodalDataset(shards, decoder="pil", size=32, modality="image",
                                           **({"source": "shards"} | source))
        self.keys = self.ds.source.keys()

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        item = self.ds[i]
        assert item["image"].shape == (3, 32, 32)
        return torch.tensor(self.keys.index(item["key"]))


def main(out: str, shards: str | None = None, mode: str = "sampler") -> None:
    """mode "sampler": samples split by fastmm.DistributedSampler; "stream": whole shards split
    by fastmm.ShardStream (equal="pad"), ids are keys; "staged": as "sampler", over shards
    staged from ``shards`` (an s3:// prefix) into the node's FASTMM_STAGE_DIR."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "stream":
        stream = fastmm.ShardStream(fastmm.MultimodalDataset(
            shards, source="shards", decoder="pil", size=32, modality="image"), seed=5)
        loader = fastmm.DataLoader(stream, batch_size=4, num_workers=2)
        record = {"rank": rank, "world": world, "sampler_rank": stream.rank, "epochs": []}
    else:
        if mode == "staged":
            dataset = Keys(shards, source="staged", inner="shards")
        else:
            dataset = Keys(shards) if shards else Ids()
        sampler = fastmm.DistributedSampler(dataset, seed=5)  # rank and world from the job
        loader = fastmm.DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=2)
        record = {"rank": rank, "world": world, "sampler_rank": sampler.rank, "epochs": []}
        if mode == "staged":
            record |= {"node": int(os.environ["GROUP_RANK"]),
                       "local_rank": int(os.environ["LOCAL_RANK"]),
                       "stage_dir": dataset.ds.source.stage_dir,
                       "staged_files": dataset.ds.source.staging_cost["files"]}
    for epoch in range(2):
        ids, steps = [], 0
        if mode == "stream":
            stream.set_epoch(epoch)
        for batch in loader:
            ids += batch["key"] if mode == "stream" else batch.tolist()
            total = torch.ones(1)
            dist.all_reduce(total)  # every rank steps together, or this hangs
            assert int(total) == world
            steps += 1
        record["epochs"].append({"ids": ids, "batches": steps})
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
