"""Distributed splitting: real torchrun jobs (gloo, world size 2 and 4) through fastmm's loader
and sampler -- every id once per epoch plus only the documented padding, equal batch counts, an
all-reduce every step -- and where rank and world size come from."""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import fastmm

HERE = os.path.dirname(os.path.abspath(__file__))


def _torchrun(world: int, out, *args) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", os.path.join(HERE, "_dist_job.py"), str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_torchrun_job_sees_every_id_once_per_epoch(world, tmp_path):
    ranks = _torchrun(world, tmp_path)
    n = 103
    per_rank = math.ceil(n / world)
    orders = []
    for epoch in range(2):
        seen = collections.Counter()
        for r, record in enumerate(ranks):
            assert record["world"] == world and record["sampler_rank"] == r
            e = record["epochs"][epoch]
            assert len(e["ids"]) == per_rank
            assert e["batches"] == math.ceil(per_rank / 8)  # equal on every rank
            seen.update(e["ids"])
            # interchangeable with torch's sampler at the same epoch
            reference = torch.utils.data.DistributedSampler(range(n), num_replicas=world,
                                                            rank=r, seed=5)
            reference.set_epoch(epoch)
            assert e["ids"] == list(reference)
        assert set(seen) == set(range(n))
        assert sum(seen.values()) == per_rank * world  # the padding, and nothing else, twice
        assert sum(c - 1 for c in seen.values()) == per_rank * world - n
        orders.append(ranks[0]["epochs"][epoch]["ids"])
    assert orders[0] != orders[1]  # each epoch reshuffled by itself


@pytest.mark.slow
def test_torchrun_job_over_tar_shards_reads_every_sample_once(tmp_path):
    """MultimodalDataset over tar shards (random access by offset index) + DistributedSampler:
    2 ranks x 2 workers read every sample of the shards once per epoch, padding aside."""
    pytest.importorskip("PIL")
    from fastmm.bench.mmcorpus import CorpusSpec, write_corpus

    write_corpus(CorpusSpec(num_images=21, num_videos=0, seed=2, shard_bytes=200_000),
                 str(tmp_path / "c"))
    shards = tmp_path / "c" / "shards"
    assert len(list(shards.glob("*.tar"))) > 2
    ranks = _torchrun(2, tmp_path, str(shards))
    for epoch in range(2):
        seen = collections.Counter(i for r in ranks for i in r["epochs"][epoch]["ids"])
        assert set(seen) == set(range(21)) and sum(seen.values()) == 22  # one padded
        assert ranks[0]["epochs"][epoch]["batches"] == ranks[1]["epochs"][epoch]["batches"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_torchrun_job_streaming_whole_shards_keeps_ranks_in_step(world, tmp_path):
    """fastmm.ShardStream under torchrun: whole shards per (rank, worker), every sample once
    per epoch plus only the padding, the same batch count on every rank, all-reduce each step."""
    pytest.importorskip("PIL")
    from fastmm.bench.mmcorpus import CorpusSpec, write_corpus

    write_corpus(CorpusSpec(num_images=30, num_videos=0, seed=3, png_fraction=0.0,
                            image_short_side=(40, 60), large_fraction=0.0, shard_bytes=12_000),
                 str(tmp_path / "c"))
    shards = tmp_path / "c" / "shards"
    ranks = _torchrun(world, tmp_path, str(shards), "stream")
    stream = fastmm.ShardStream(fastmm.MultimodalDataset(str(shards), source="shards"),
                                rank=0, world_size=world, seed=5)
    orders = []
    for epoch in range(2):
        stream.set_epoch(epoch)
        _, per_slot = stream.plan(num_workers=2)
        seen = collections.Counter(k for r in ranks for k in r["epochs"][epoch]["ids"])
        assert set(seen) == set(stream.dataset.source.keys())
        assert sum(seen.values()) == per_slot * world * 2  # every slot the same count
        assert len({r["epochs"][epoch]["batches"] for r in ranks}) == 1
        orders.append(ranks[0]["epochs"][epoch]["ids"])
    assert orders[0] != orders[1]


@pytest.mark.slow
def test_two_node_launches_stage_once_per_node_and_read_every_sample_once(tmp_path):
    """torchrun --nnodes 2 as on a cluster, both nodes on this machine: two launches (2 ranks
    each) meeting at 127.0.0.1, each node staging the shards from an S3 store (moto's server)
    into its own node-local directory. Each node copies each shard once, its two ranks sharing
    the copy; each sample is read once per epoch across the four ranks; equal batch counts."""
    pytest.importorskip("PIL")
    pytest.importorskip("moto")
    from fastmm.bench.mmcorpus import CorpusSpec, write_corpus
    from fastmm.bench.nodes import launch_nodes
    from fastmm.bench.s3server import LocalS3

    write_corpus(CorpusSpec(num_images=24, num_videos=0, seed=6, png_fraction=0.0,
                            image_short_side=(40, 60), large_fraction=0.0, shard_bytes=12_000),
                 str(tmp_path / "c"))
    shards = sorted((tmp_path / "c" / "shards").glob("*.tar"))
    with LocalS3() as s3:
        s3.upload_dir(str(tmp_path / "c" / "shards"), "corpus", "shards/")
        done = launch_nodes(
            2, 2, [os.path.join(HERE, "_dist_job.py"), str(tmp_path), "s3://corpus/shards",
                   "staged"],
            env={**os.environ, **s3.env, "OMP_NUM_THREADS": "1"},
            node_env=lambda node: {"FASTMM_STAGE_DIR": str(tmp_path / f"node{node}-nvme")},
            timeout_s=300)
    for node in done:
        assert node.returncode == 0, node.output[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert sorted((r["node"], r["local_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for node in (0, 1):
        mine = [r for r in ranks if r["node"] == node]
        assert len({r["stage_dir"] for r in mine}) == 1  # one copy per node...
        assert mine[0]["stage_dir"].startswith(str(tmp_path / f"node{node}-nvme"))
        assert sum(r["staged_files"] for r in mine) == len(shards)  # ...made once
    for epoch in range(2):
        seen = collections.Counter(i for r in ranks for i in r["epochs"][epoch]["ids"])
        assert seen == collections.Counter(range(24))  # 24 over 4 ranks: no padding
        assert len({r["epochs"][epoch]["batches"] for r in ranks}) == 1


def test_rank_and_world_size_come_from_the_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    sampler = fastmm.DistributedSampler(range(10))
    assert (sampler.rank, sampler.num_replicas) == (2, 3)
    assert fastmm.DistributedSampler(range(10), rank=0).rank == 0  # an argument wins
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(fastmm.ConfigError, match="RANK=3 is not below WORLD_SIZE=3"):
        fastmm.DistributedSampler(range(10))
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(fastmm.ConfigError, match="WORLD_SIZE='two' is not an integer"):
        fastmm.DistributedSampler(range(10))
    # both given: the environment is not read (a launcher's stray RANK breaks nothing)
    assert fastmm.DistributedSampler(range(10), rank=1, num_replicas=2).rank == 1
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert fastmm.DistributedSampler(range(10)).num_replicas == 1  # one process


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_pass_of_a_loader_takes_the_next_epoch_without_batching(num_workers):
    """batch_size=None: the loader iterates the sampler itself, and makes iterators it never
    draws from; only a pass taken advances the epoch."""
    ours = fastmm.DistributedSampler(range(12), num_replicas=2, rank=0)
    loader = fastmm.DataLoader(range(12), sampler=ours, batch_size=None, num_workers=num_workers)
    for epoch in range(3):
        theirs = torch.utils.data.DistributedSampler(range(12), num_replicas=2, rank=0)
        theirs.set_epoch(epoch)
        assert [int(x) for x in loader] == list(theirs), epoch


def test_set_epoch_rules_as_in_torch():
    ours = fastmm.DistributedSampler(range(20), num_replicas=2, rank=1, seed=7)
    theirs = torch.utils.data.DistributedSampler(range(20), num_replicas=2, rank=1, seed=7)
    assert list(ours) == list(theirs)  # epoch 0
    theirs.set_epoch(1)
    assert list(ours) == list(theirs)  # advanced by itself
    ours.set_epoch(5)
    theirs.set_epoch(5)
    assert list(ours) == list(theirs) == list(ours)  # fixed once set
    drop = fastmm.DistributedSampler(range(9), num_replicas=4, rank=0, drop_last=True)
    assert len(list(drop)) == 2
