"""One rank of a torchrun job that may stop mid-epoch and may resume a job of another shape
(tests/test_resume_elastic.py): ``_elastic_job.py OUT NUM_WORKERS BATCH_SIZE STOP [FROM]``.

It logs the ids of each batch it hands out to OUT/rank<R>.jsonl. With STOP >= 0 it stops after
that many batches and writes its loader state to OUT/rank<R>.state.json; with STOP < 0 it runs
to the epoch's end. With FROM it first loads the states every rank of the job in FROM wrote.
With JOB_SHARDS set (a directory or an s3:// prefix of tar shards) it reads them through a
ShardStream and logs the samples' keys instead."""

from __future__ import annotations

import glob
import json
import os
import random
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fastmm  # noqa: E402
from _resume_job import Augmented  # noqa: E402


def main(out: str, num_workers: int, batch_size: int, stop: int, before: str | None) -> None:
    rank = int(os.environ["RANK"])  # (torchrun's; fastmm.DistributedSampler reads them too)
    torch.manual_seed(rank)
    random.seed(rank)
    np.random.seed(rank)
    shards = os.environ.get("JOB_SHARDS")
    if shards:
        dataset = fastmm.ShardStream(fastmm.MultimodalDataset(
            shards, source="shards", decoder="pil", size=16, modality="image", crop="center"),
            seed=7)
        loader = fastmm.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers)
    else:
        dataset = Augmented(int(os.environ.get("JOB_SAMPLES", "101")))
        loader = fastmm.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                                   sampler=fastmm.DistributedSampler(dataset, seed=7))
    if before is not None:
        loader.load_state_dict([json.load(open(path)) for path in
                                sorted(glob.glob(os.path.join(before, "rank*.state.json")))])
    with open(os.path.join(out, f"rank{rank}.jsonl"), "w") as log:
        for n, batch in enumerate(loader):
            ids = batch["key"] if shards else [row[0] for row in batch.tolist()]
            log.write(json.dumps(ids) + "\n")
            if n + 1 == stop:
                break
    with open(os.path.join(out, f"rank{rank}.state.json"), "w") as f:
        json.dump(loader.state_dict(), f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
         sys.argv[5] if len(sys.argv) > 5 else None)
