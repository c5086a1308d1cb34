"""Resuming mid-epoch at another shape (issue 54): a map-style loader saved with one worker
count and batch size goes on with another, every sample not handed out yet exactly once, in
an order that is the same every time the state is resumed."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch

import fastmm
from fastmm import resume
from _resume_job import Augmented

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

N = 37  # samples an epoch (Augmented's)

pytestmark = pytest.mark.filterwarnings("ignore:.*worker processes in total")


def _seed_main(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _loader(num_workers: int, batch_size: int, in_order: bool = True, drop_last: bool = False,
            **kwargs):
    return fastmm.DataLoader(Augmented(N), batch_size=batch_size, shuffle=True,
                             num_workers=num_workers, in_order=in_order, drop_last=drop_last,
                             **kwargs)


def _take(loader, count: int | None, state_in: dict | None = None):
    """``count`` batches of one epoch (all: None) as lists of rows, and the state after them
    (through JSON), from ``loader`` restored from ``state_in`` if given."""
    if state_in is not None:
        _seed_main(99)  # elsewhere: the restored loader must not depend on it
        loader.load_state_dict(state_in)
    out, it = [], iter(loader)
    while count is None or len(out) < count:
        try:
            out.append(next(it).tolist())
        except StopIteration:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    return out, state


def _ids(batches) -> list[int]:
    return [row[0] for batch in batches for row in batch]


def _stopped(num_workers: int, batch_size: int, stop: int, in_order: bool = True):
    _seed_main(0)
    return _take(_loader(num_workers, batch_size, in_order), stop)


@pytest.mark.parametrize("before, after", [((2, 4), (3, 4)), ((2, 4), (0, 4)), ((0, 4), (2, 4)),
                                           ((2, 4), (2, 5)), ((2, 8), (1, 3)), ((1, 3), (3, 10))])
@pytest.mark.parametrize("in_order", [True, False])
def test_the_rest_of_the_epoch_at_another_shape_has_each_sample_once(before, after, in_order):
    head, state = _stopped(*before, stop=3, in_order=in_order)
    tail, _ = _take(_loader(*after, in_order=in_order), None, state)
    assert sorted(_ids(head + tail)) == list(range(N))
    sizes = sorted(len(b) for b in tail)  # (in_order=False: the short one anywhere)
    assert all(size == after[1] for size in sizes[1:]) and 0 < sizes[0] <= after[1]
    again, _ = _take(_loader(*after, in_order=in_order), None, state)
    if in_order:  # the same state resumed twice: the same batches, augmentation draws included
        assert again == tail
    else:  # which worker makes a batch, so its draws, follows the workers' timing
        assert sorted(_ids(again)) == sorted(_ids(tail))


def test_a_second_and_third_stop_within_the_epoch_at_other_shapes():
    head, state = _stopped(2, 4, stop=2)
    middle, state = _take(_loader(3, 5), 3, state)
    assert state["handed_out_before"] == [[0, 8]]  # (the first 8 places of the order)
    more, state = _take(_loader(1, 3, in_order=False), 2, state)
    tail, end = _take(_loader(2, 7), None, state)
    assert sorted(_ids(head + middle + more + tail)) == list(range(N))
    assert end["epoch_done"] and end["handed_out_before"] == []


def test_an_unchanged_shape_after_a_change_resumes_the_same_batches():
    """Saved again at the new shape and resumed at it: the batches the resumed run had next."""
    _, state = _stopped(2, 4, stop=3)
    resumed = _loader(3, 5)
    whole, _ = _take(resumed, None, state)
    head, again = _take(_loader(3, 5), 2, state)
    tail, _ = _take(_loader(3, 5), None, again)
    assert head + tail == whole


def test_drop_last_drops_the_short_batch_of_the_rest():
    head, state = _stopped(2, 4, stop=3)
    _seed_main(0)
    tail, _ = _take(_loader(2, 5, drop_last=False), None, state)
    dropped, _ = _take(fastmm.DataLoader(Augmented(N), batch_size=5, shuffle=True, num_workers=2),
                       None, state)
    assert tail == dropped  # (drop_last unchanged: the same loader)
    with pytest.raises(ValueError, match="drop_last: saved False, now True"):
        _loader(2, 5, drop_last=True).load_state_dict(state)


def test_what_cannot_be_reshaped_says_what_changed():
    _, state = _stopped(2, 4, stop=3)
    batches = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(range(N)), 5, False)
    own = fastmm.DataLoader(Augmented(N), batch_sampler=batches, num_workers=2)
    with pytest.raises(ValueError, match=r"batch_size: saved 4, now None.*torch's BatchSampler"):
        own.load_state_dict(state)
    same_size = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(range(N)), 4, False)
    with pytest.raises(ValueError, match="batch_size: saved 4, now None"):
        fastmm.DataLoader(Augmented(N), batch_sampler=same_size).load_state_dict(state)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 9), st.booleans(),
                                 st.integers(0, 6)), min_size=2, max_size=4))
def test_any_chain_of_shapes_hands_out_each_sample_once(shapes):
    """Against the set model of an epoch: each loader of the chain takes some batches at its
    shape (the last one the rest); together they hand out every sample exactly once."""
    state, seen = None, []
    _seed_main(0)
    for k, (workers, size, in_order, count) in enumerate(shapes):
        last = k == len(shapes) - 1
        batches, state = _take(_loader(workers, size, in_order), None if last else count, state)
        seen += _ids(batches)
        assert all(len(b) <= size for b in batches)
        if state["epoch_done"]:
            break
    assert sorted(seen) == list(range(N))
    assert resume.merge_places([[3, 5], [0, 2], [2, 3], [7, 9]]) == [[0, 5], [7, 9]]


# -- another world size (each rank's loader in this process: the job's ranks side by side) --------


def _rank_loader(rank: int, world: int, batch_size: int, num_workers: int = 0, n: int = N,
                 drop_last: bool = False):
    ds = Augmented(n)
    sampler = fastmm.DistributedSampler(ds, num_replicas=world, rank=rank, seed=3,
                                        drop_last=drop_last)
    return fastmm.DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=num_workers)


def _job(world: int, batch_size: int, stops: list[int | None], states=None, num_workers: int = 0,
         n: int = N):
    """Each rank's batches (``stops[rank]`` of them; None: the rest of the epoch) and its state
    after them, each rank restored from ``states`` (every rank's of the job before) if given."""
    batches, saved = [], []
    for rank in range(world):
        _seed_main(rank)  # (each rank's process)
        loader = _rank_loader(rank, world, batch_size, num_workers, n)
        got, state = _take(loader, stops[rank], states)
        batches.append(got)
        saved.append(state)
    return batches, saved


def _padded(n: int, world: int) -> int:
    return -n % world  # the places DistributedSampler repeats to deal n samples evenly


@pytest.mark.parametrize("world, stops, world2, batch2", [
    (4, [2, 2, 2, 2], 2, 4), (4, [2, 2, 2, 2], 3, 3), (4, [3, 2, 3, 1], 3, 5), (2, [0, 1], 4, 2),
    (3, [4, 4, 4], 1, 7), (1, [3], 3, 4)])  # (a one-rank job's one state is every rank's)
def test_another_world_size_deals_out_the_rest_once_in_equal_batch_counts(world, stops, world2,
                                                                         batch2):
    head, states = _job(world, 4, stops)
    tail, ends = _job(world2, batch2, [None] * world2, states)
    ids = _ids(sum(head, []) + sum(tail, []))
    assert set(ids) == set(range(N))
    # repeated only where a deal padded: the first job's, and the rest's to world2 ranks
    assert len(ids) - N <= _padded(N, world) + world2 - 1
    assert len({len(batches) for batches in tail}) == 1  # no rank waits at a collective
    assert all(end["epoch_done"] for end in ends)
    again, _ = _job(world2, batch2, [None] * world2, states)
    assert again == tail  # the same states: the same batches, augmentation draws included


def test_two_changes_of_world_size_within_one_epoch():
    head, states = _job(4, 3, [2, 2, 2, 2], num_workers=2)
    middle, states = _job(3, 4, [1, 1, 1], states, num_workers=1)
    assert states[0]["deal"][0] == 4 and states[0]["deal"][3] == 3
    tail, _ = _job(2, 2, [None, None], states, num_workers=0)
    ids = _ids(sum(head + middle + tail, []))
    assert set(ids) == set(range(N)) and len(ids) - N <= _padded(N, 4) + 2 + 1


def test_the_same_world_given_every_ranks_state_resumes_as_before():
    head, states = _job(3, 4, [2, 2, 2], num_workers=2)  # (their RNGs in the state)
    whole, _ = _job(3, 4, [None] * 3, num_workers=2)
    tail, _ = _job(3, 4, [None] * 3, states, num_workers=2)
    for rank in range(3):
        assert head[rank] + tail[rank] == whole[rank]


def test_the_next_epoch_after_a_change_of_world_is_the_new_worlds():
    _, states = _job(4, 4, [1, 1, 1, 1])
    loader = _rank_loader(1, 2, 4)
    _seed_main(5)
    loader.load_state_dict(states)
    list(loader)
    following = [b.tolist() for b in loader]
    fresh = _rank_loader(1, 2, 4)
    list(fresh)
    assert _ids(following) == _ids([b.tolist() for b in fresh])


def test_every_ranks_state_between_epochs_loads_at_another_world_size():
    """At an epoch boundary any shape goes on (as from one state): the next epoch is a whole
    epoch of the new world, its ranks the same number of batches."""
    _, states = _job(4, 4, [None] * 4)
    assert all(state["epoch_done"] for state in states)
    tail, _ = _job(2, 4, [None, None], states)
    assert set(_ids(sum(tail, []))) == set(range(N)) and len(_ids(sum(tail, []))) == N + 1
    assert len({len(batches) for batches in tail}) == 1


def test_a_change_of_world_names_what_it_lacks():
    _, states = _job(4, 4, [1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"every rank of the saved job.*\(0, 4\), \(1, 4\), "
                                         r"\(3, 4\)"):
        _rank_loader(0, 2, 4).load_state_dict([states[0], states[1], states[3]])
    with pytest.raises(ValueError, match="world: saved"):
        _rank_loader(0, 2, 4).load_state_dict(states[0])  # one rank's alone: as before
    plain = fastmm.DataLoader(Augmented(N), batch_size=4, shuffle=True)
    with pytest.raises(ValueError, match="over a DistributedSampler"):
        plain.load_state_dict(states)


def _torchrun(out, world: int, *args, env: dict | None = None) -> None:
    out.mkdir()
    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_elastic_job.py")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={world}", job, str(out), *map(str, args)],
                          capture_output=True, text=True, timeout=300,
                          env=None if env is None else {**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]


def _job_ids(out, world: int) -> list[list[list[int]]]:
    return [[json.loads(line) for line in open(out / f"rank{rank}.jsonl")]
            for rank in range(world)]


@pytest.mark.slow
def test_torchrun_jobs_stopped_and_resumed_at_other_shapes(tmp_path):
    """4 ranks x 2 workers stopped at a random step; resumed as 2 ranks x 3 workers and stopped
    again within the epoch; resumed as 3 ranks x 1 worker to the epoch's end: each of the 101
    samples handed out, repeated only where a deal padded, every job's ranks the same number of
    batches."""
    stop = random.Random().randint(1, 5)
    _torchrun(tmp_path / "a", 4, 2, 4, stop)
    _torchrun(tmp_path / "b", 2, 3, 5, 3, tmp_path / "a")
    _torchrun(tmp_path / "c", 3, 1, 6, -1, tmp_path / "b")
    seen = []
    for name, world in (("a", 4), ("b", 2), ("c", 3)):
        ranks = _job_ids(tmp_path / name, world)
        assert len({len(batches) for batches in ranks}) == 1, (name, stop)
        seen += [i for batches in ranks for batch in batches for i in batch]
    assert set(seen) == set(range(101)), stop
    assert len(seen) - 101 <= _padded(101, 4) + 1 + 2, stop
    # the same states resumed again: the same batches
    _torchrun(tmp_path / "c2", 3, 1, 6, -1, tmp_path / "b")
    assert _job_ids(tmp_path / "c2", 3) == _job_ids(tmp_path / "c", 3)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["local", "s3"])
def test_torchrun_stream_jobs_stopped_and_resumed_at_other_shapes(tmp_path, store):
    """A ShardStream over tar shards (on disk, or in place in a local S3 store): 4 ranks x 2
    workers stopped at a random step; resumed as 2 ranks x 3 workers and stopped again; resumed
    as 3 ranks x 1 worker to the epoch's end: every sample handed out, one handed out never
    read again by a later job unless that job had read everything left, every job's ranks the
    same number of batches; the same states resumed again give the same batches."""
    from fastmm.bench.mmcorpus import CorpusSpec, write_corpus

    write_corpus(CorpusSpec(num_images=64, num_videos=0, seed=5, png_fraction=0.0,
                            image_short_side=(40, 60), large_fraction=0.0, shard_bytes=8_000),
                 str(tmp_path / "corpus"))
    local = tmp_path / "corpus" / "shards"
    assert len(list(local.glob("*.tar"))) >= 8  # a shard for each of 4 ranks x 2 workers
    keys = {m.rsplit(".", 1)[0] for shard in local.glob("*.tar") for m in _members(shard)}
    with contextlib.ExitStack() as stack:
        env = {"JOB_SHARDS": str(local), "OMP_NUM_THREADS": "1"}
        if store == "s3":
            pytest.importorskip("moto")
            from fastmm.bench.s3server import LocalS3

            s3 = stack.enter_context(LocalS3())
            s3.upload_dir(str(local), "corpus", "shards/")
            env |= s3.env | {"JOB_SHARDS": "s3://corpus/shards"}
        stop = random.Random().randint(1, 3)
        _torchrun(tmp_path / "a", 4, 2, 3, stop, env=env)
        _torchrun(tmp_path / "b", 2, 3, 2, 2, tmp_path / "a", env=env)
        _torchrun(tmp_path / "c", 3, 1, 4, -1, tmp_path / "b", env=env)
        _torchrun(tmp_path / "c2", 3, 1, 4, -1, tmp_path / "b", env=env)
    seen: set[str] = set()
    for name, world in (("a", 4), ("b", 2), ("c", 3)):
        ranks = _job_ids(tmp_path / name, world)
        assert len({len(batches) for batches in ranks}) == 1, (name, stop)
        got = {k for batches in ranks for batch in batches for k in batch}
        assert not got & seen or got | seen == keys, (name, stop)
        seen |= got
    assert seen == keys, stop
    assert _job_ids(tmp_path / "c2", 3) == _job_ids(tmp_path / "c", 3)


def _members(shard) -> list[str]:
    with tarfile.open(shard) as t:
        return [m.name for m in t.getmembers() if m.isfile()]
