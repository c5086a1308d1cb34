"""ShardStream: whole tar shards per (rank, worker), equal samples per slot under the pad and
drop rules, skips made up, per-epoch reshuffles reaching persistent workers, and mid-epoch
resume through the loader."""

from __future__ import annotations

import collections
import itertools
import io
import json
import os
import tarfile

import pytest
import torch

import fastmm
from fastmm.bench.mmcorpus import CorpusSpec, write_corpus

N = 40


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    write_corpus(CorpusSpec(num_images=N, num_videos=0, seed=4, png_fraction=0.0,
                            image_short_side=(40, 60), large_fraction=0.0, shard_bytes=9_000),
                 str(root))
    out = root / "shards"
    assert len(list(out.glob("*.tar"))) >= 9
    return str(out)


def _dataset(shards, **kw):
    kw = {"crop": "center"} | kw
    return fastmm.MultimodalDataset(shards, source="shards", decoder="pil", size=16,
                                    modality="image", **kw)


def _keys_by_rank(shards, world, *, workers=2, equal="pad", epoch=0, dataset_kw=None):
    out = []
    for rank in range(world):
        stream = fastmm.ShardStream(_dataset(shards, **(dataset_kw or {})), equal=equal,
                                    rank=rank, world_size=world, seed=1)
        stream.set_epoch(epoch)
        loader = fastmm.DataLoader(stream, batch_size=4, num_workers=workers)
        batches = [b["key"] for b in loader]
        out.append(batches)
    return out


def test_plan_deals_every_shard_once_and_the_same_on_every_rank(shards):
    a = fastmm.ShardStream(_dataset(shards), rank=0, world_size=2)
    b = fastmm.ShardStream(_dataset(shards), rank=1, world_size=2)
    slots, per_slot = a.plan(num_workers=2)
    assert (slots, per_slot) == b.plan(num_workers=2)
    dealt = sorted(s for slot in slots for s in slot)
    assert dealt == list(range(len(a.shards)))
    loads = [sum(len(a.shards[s]) for s in slot) for slot in slots]
    assert per_slot == max(loads) and sum(len(s) for s in a.shards) == N
    a.set_epoch(1)
    assert a.plan(num_workers=2)[0] != slots  # another epoch, another deal


@pytest.mark.parametrize("world", [1, 2, 3])
def test_pad_yields_every_sample_and_equal_batches_on_every_rank(shards, world):
    ranks = _keys_by_rank(shards, world)
    assert len({len(r) for r in ranks}) == 1  # equal batch counts
    keys = [k for r in ranks for b in r for k in b]
    stream = fastmm.ShardStream(_dataset(shards), rank=0, world_size=world, seed=1)
    _, per_slot = stream.plan(num_workers=2)
    assert len(keys) == per_slot * world * 2
    assert set(keys) == set(stream.dataset.source.keys())  # every sample at least once
    extra = collections.Counter(keys)
    assert sum(c - 1 for c in extra.values()) == per_slot * world * 2 - N  # only the padding


def test_drop_yields_each_sample_at_most_once(shards):
    ranks = _keys_by_rank(shards, 2, equal="drop")
    assert len({len(r) for r in ranks}) == 1
    keys = [k for r in ranks for b in r for k in b]
    per_slot = fastmm.ShardStream(_dataset(shards), equal="drop", rank=0, world_size=2,
                                  seed=1).plan(2)[1]
    assert len(keys) == len(set(keys)) == per_slot * 4


def test_a_skipped_sample_is_made_up_and_counts_stay_equal(shards, tmp_path):
    import shutil

    from fastmm.sources import ShardSource, write_shards

    src = ShardSource(shards)
    bad_key = src.keys()[5]
    samples = []
    for i in range(len(src)):
        s = src.read(i)
        members = dict(s.members)
        if s.key == bad_key:
            members["jpg"] = b"\xff\xd8 not a jpeg"
        samples.append((s.key, members))
    out = tmp_path / "damaged"
    write_shards(samples, str(out), max_count=4)
    ranks = _keys_by_rank(str(out), 2, dataset_kw={"on_error": "skip"})
    assert len(ranks[0]) == len(ranks[1])
    keys = [k for r in ranks for b in r for k in b]
    per_slot = fastmm.ShardStream(_dataset(str(out)), rank=0, world_size=2, seed=1).plan(2)[1]
    assert bad_key not in keys and len(keys) == per_slot * 4
    shutil.rmtree(out)


def test_too_few_shards_for_the_slots_is_a_clear_error(shards):
    stream = fastmm.ShardStream(_dataset(shards), rank=0, world_size=N)  # N samples, < N shards
    with pytest.raises(ValueError, match=f"shards cannot feed {N} ranks x 4 workers"):
        stream.plan(num_workers=4)


def test_files_are_not_shards(tmp_path):
    write_corpus(CorpusSpec(num_images=3, num_videos=0, seed=1, png_fraction=0.0,
                            image_short_side=(40, 60), large_fraction=0.0), str(tmp_path))
    files = fastmm.MultimodalDataset(str(tmp_path / "posix"), source="posix", size=16)
    with pytest.raises(ValueError, match="needs tar shards"):
        fastmm.ShardStream(files)


def test_set_epoch_reaches_persistent_workers(shards):
    stream = fastmm.ShardStream(_dataset(shards), rank=0, world_size=1, seed=1)
    loader = fastmm.DataLoader(stream, batch_size=4, num_workers=2, persistent_workers=True)
    epochs = []
    for epoch in range(2):
        stream.set_epoch(epoch)
        epochs.append([k for b in loader for k in b["key"]])
    fresh = fastmm.ShardStream(_dataset(shards), rank=0, world_size=1, seed=1)
    fresh.set_epoch(1)
    expected = [k for b in fastmm.DataLoader(fresh, batch_size=4, num_workers=2) for k in b["key"]]
    assert epochs[1] == expected and epochs[0] != epochs[1]


def test_a_stream_resumes_mid_epoch(shards):
    def make():
        stream = fastmm.ShardStream(_dataset(shards, crop="random"), rank=1, world_size=2)
        stream.set_epoch(3)
        return fastmm.DataLoader(stream, batch_size=3, num_workers=2)

    def rows(batch):
        return [batch["key"], batch["image"].float().mean(dim=(1, 2, 3)).tolist()]

    torch.manual_seed(0)
    full = [rows(b) for b in make()]
    for stop in (0, 1, 4, len(full) - 1):
        torch.manual_seed(0)
        loader = make()
        it = iter(loader)
        head = [rows(next(it)) for _ in range(stop)]
        state = json.loads(json.dumps(loader.state_dict()))
        assert state["dataset"]["epoch"] == 3
        del it
        again = fastmm.DataLoader(fastmm.ShardStream(_dataset(shards, crop="random"), rank=1,
                                                     world_size=2), batch_size=3, num_workers=2)
        again.load_state_dict(state)
        assert head + [rows(b) for b in again] == full, f"stop {stop}"
    assert os.environ.get("RANK") is None  # the ranks above came from arguments


class _LogKeys:
    """A transform noting each item's key in a file of its process."""

    def __init__(self, log_dir):
        self.log_dir = log_dir

    def __call__(self, item):
        with open(os.path.join(self.log_dir, str(os.getpid())), "a") as f:
            f.write(item["key"] + "\n")
        return item

    def made(self) -> list[str]:
        keys = []
        for name in os.listdir(self.log_dir):
            with open(os.path.join(self.log_dir, name)) as f:
                keys += f.read().split()
            os.remove(os.path.join(self.log_dir, name))
        return keys


def test_a_stream_state_refuses_another_rank_or_world_size_mid_epoch(shards):
    """Another slot's place would skip samples it never handed out: refused, by name."""
    def make(rank, world):
        stream = fastmm.ShardStream(_dataset(shards), rank=rank, world_size=world, seed=1)
        return fastmm.DataLoader(stream, batch_size=4, num_workers=0)

    saved = make(1, 2)
    it = iter(saved)
    next(it), next(it)
    state = saved.state_dict()
    for rank, world in ((0, 2), (0, 3)):
        with pytest.raises(ValueError, match=rf"world: saved \[1, 2\], now \[{rank}, {world}\]"):
            make(rank, world).load_state_dict(state)
    make(1, 2).load_state_dict(state)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resumed_stream_counts_each_bad_sample_once(shards, tmp_path, num_workers):
    """The resumed stream goes on from each slot's position (nothing handed out is read
    again) and counts each bad sample once: the counts as the epoch began, plus what each slot
    had met up to its last batch handed out."""
    garbled = 0
    for name in sorted(os.listdir(shards)):
        with tarfile.open(os.path.join(shards, name)) as t:
            members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
        with tarfile.open(tmp_path / name, "w") as t:
            for m, data in members:
                if m.name.endswith(".jpg"):
                    garbled += 1
                    data = b"not a jpeg" if garbled % 5 == 0 else data
                m.size = len(data)
                t.addfile(m, io.BytesIO(data))

    log = _LogKeys(str(tmp_path / "made"))
    os.mkdir(log.log_dir)

    def make():
        dataset = _dataset(str(tmp_path), on_error="skip", transform=log)
        return fastmm.DataLoader(fastmm.ShardStream(dataset), batch_size=3,
                                 num_workers=num_workers)

    whole = make()
    keys = [k for b in whole for k in b["key"]]
    assert whole.dataset.dataset.skipped == {"corrupt": N // 5}  # each once, padding or not
    loader = make()
    it = iter(loader)
    head = [k for _ in range(4) for k in next(it)["key"]]
    state = json.loads(json.dumps(loader.state_dict()))
    assert all(s[0] == "iterator" for s in state["worker_streams"])
    del it
    log.made()
    again = make()
    again.load_state_dict(state)
    tail = [k for b in again for k in b["key"]]
    assert head + tail == keys
    assert again.dataset.dataset.skipped == whole.dataset.dataset.skipped
    assert sorted(log.made()) == sorted(tail)  # before, the head was made again too


# -- the rest of an epoch at another shape (issue 54) -----------------------------------------

def _stream_loader(root, rank, world, workers, batch_size, equal):
    stream = fastmm.ShardStream(_dataset(root), equal=equal, rank=rank, world_size=world, seed=1)
    stream.set_epoch(2)
    return fastmm.DataLoader(stream, batch_size=batch_size, num_workers=workers)


def _pieces(root, shapes, stops, equal):
    """One epoch run as jobs of ``shapes`` (world, workers, batch size), each stopped after
    ``stops[i]`` batches a rank (the last runs to the end) and resumed by the next from every
    rank's state (its own, where the world size is the same). Each job's keys, rank by rank,
    batch by batch."""
    jobs, states = [], None
    for i, (world, workers, batch_size) in enumerate(shapes):
        ranks, saved = [], []
        for rank in range(world):
            loader = _stream_loader(root, rank, world, workers, batch_size, equal)
            if states is not None:
                same = len(states) == world
                loader.load_state_dict(states[rank] if same and i % 2 else states)
            it = iter(loader)
            stop = stops[i] if i < len(stops) else None
            ranks.append([b["key"] for b in (itertools.islice(it, stop) if stop else it)])
            saved.append(json.loads(json.dumps(loader.state_dict())))
            del it
        jobs.append(ranks)
        states = saved
        if all(state["epoch_done"] for state in states):  # (the epoch ran out before the stop)
            break
    return jobs


ELASTIC = [  # (shapes, stops)
    ([(2, 2, 3), (2, 3, 3)], [3]),               # more workers, the same world
    ([(2, 2, 3), (3, 2, 4)], [2]),               # another world size and batch size
    ([(2, 2, 3), (1, 0, 5)], [4]),               # one process, no workers
    ([(1, 2, 4), (4, 1, 2), (2, 2, 3)], [1, 2]),  # changed twice within the epoch
    ([(2, 1, 3), (3, 2, 2), (3, 2, 2)], [2, 1]),  # a change, then the same shape again
]


@pytest.mark.parametrize("shapes, stops", ELASTIC)
def test_the_rest_of_a_streams_epoch_at_another_shape_pads_as_before(shards, shapes, stops):
    """equal="pad": every sample at least once over the pieces of the epoch, a sample handed
    out never read again by a later piece unless that piece ran out of samples to read, and
    every rank of each piece the same number of batches."""
    jobs = _pieces(shards, shapes, stops, "pad")
    everything = set(_dataset(shards).source.keys())
    seen: list[str] = []
    for ranks in jobs:
        assert len({len(batches) for batches in ranks}) == 1
        keys = [k for batches in ranks for batch in batches for k in batch]
        fresh = set(keys) - set(seen)
        assert not set(keys) & set(seen) or fresh | set(seen) == everything
        seen += keys
    assert set(seen) == everything


@pytest.mark.parametrize("shapes, stops", ELASTIC)
def test_the_rest_of_a_streams_epoch_at_another_shape_drops_as_before(shards, shapes, stops):
    """equal="drop": each sample at most once, every rank the same number of batches."""
    jobs = _pieces(shards, shapes, stops, "drop")
    keys = [k for ranks in jobs for batches in ranks for batch in batches for k in batch]
    assert len(keys) == len(set(keys))
    for ranks in jobs:
        assert len({len(batches) for batches in ranks}) == 1


def test_a_streams_rest_is_the_same_each_time_it_is_resumed(shards):
    """The same states resumed twice at the same new shape: the same batches."""
    first = _pieces(shards, [(2, 2, 3), (3, 1, 2)], [2], "pad")
    again = _pieces(shards, [(2, 2, 3), (3, 1, 2)], [2], "pad")
    assert first == again


def test_a_streams_rest_counts_the_bad_samples_of_the_job_it_goes_on_from(shards, tmp_path):
    """Bad samples counted before the change stay counted, once, on the new job's first slot."""
    for name in sorted(os.listdir(shards)):
        with tarfile.open(os.path.join(shards, name)) as t:
            members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
        with tarfile.open(tmp_path / name, "w") as t:
            for m, data in members:
                data = b"not a jpeg" if m.name.endswith(".jpg") and "3" in m.name else data
                m.size = len(data)
                t.addfile(m, io.BytesIO(data))

    def make(workers):
        return fastmm.DataLoader(fastmm.ShardStream(_dataset(str(tmp_path), on_error="skip")),
                                 batch_size=3, num_workers=workers)

    whole = make(2)
    list(whole)
    bad = whole.dataset.dataset.skipped
    assert bad
    loader = make(2)
    it = iter(loader)
    head = [k for _ in range(4) for k in next(it)["key"]]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    again = make(1)
    again.load_state_dict(state)
    tail = [k for b in again for k in b["key"]]
    assert set(head) | set(tail) == {k for b in make(2) for k in b["key"]}
    assert again.dataset.dataset.skipped == bad
    # stopped again at the new shape and resumed at it: the carried counts still count once
    for stop in (1, 2, 3):
        moved = make(1)
        moved.load_state_dict(state)
        it = iter(moved)
        middle = [k for _ in range(stop) for k in next(it)["key"]]
        later = json.loads(json.dumps(moved.state_dict()))
        del it
        last = make(1)
        last.load_state_dict(later)
        assert middle + [k for b in last for k in b["key"]] == tail, stop
        assert last.dataset.dataset.skipped == bad, stop


def test_a_stream_given_one_ranks_state_at_another_world_size_asks_for_every_ranks(shards):
    loader = _stream_loader(shards, 0, 2, 1, 3, "pad")
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    with pytest.raises(ValueError, match=r"world: saved \[0, 2\], now \[0, 3\].*every rank"):
        _stream_loader(shards, 0, 3, 1, 3, "pad").load_state_dict(state)
    with pytest.raises(ValueError, match=r"every rank of the saved job, once each"):
        _stream_loader(shards, 0, 3, 1, 3, "pad").load_state_dict([state, state])


@pytest.mark.slow
@pytest.mark.parametrize("equal", ["pad", "drop"])
def test_any_chain_of_stream_shapes_against_the_set_model(shards, equal):
    """Random chains of (world, workers, batch size, stop) over one epoch, against the set
    model: pad, every sample at least once and none handed out read again while some were left
    unread; drop, each at most once; every piece's ranks the same number of batches."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=12, deadline=None, database=None)
    @hypothesis.given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 2),
                                         st.integers(1, 5), st.integers(1, 3)),
                               min_size=2, max_size=3))
    def check(chain):
        shapes = [(world, workers, size) for world, workers, size, _ in chain]
        stops = [stop for *_, stop in chain[:-1]]
        jobs = _pieces(shards, shapes, stops, equal)
        everything = set(_dataset(shards).source.keys())
        seen: list[str] = []
        for ranks in jobs:
            assert len({len(batches) for batches in ranks}) == 1
            keys = [k for batches in ranks for batch in batches for k in batch]
            if equal == "drop":
                assert not set(keys) & set(seen) and len(keys) == len(set(keys))
            else:
                assert not set(keys) & set(seen) or set(keys) | set(seen) == everything
            seen += keys
        if equal == "pad":
            assert set(seen) == everything

    check()


def test_a_damaged_or_hostile_rest_is_refused_by_name(shards):
    """A saved rest whose runs leave the dataset, or whose slots are not this job's, would list
    billions of indices or slots: refused before it is used, as a damaged position is."""
    stream = fastmm.ShardStream(_dataset(shards), rank=0, world_size=2)
    state = stream.state_dict()
    good = {"epoch": 0, "ranges": [[0, 5]], "samples": 5, "ranks": 2, "counted": None}
    stream.load_state_dict(state | {"rest": good})
    stream.load_state_dict(state | {"rest": good | {"ranks": 4}})  # (dealt anew by a loader)
    with pytest.raises(ValueError, match="is for 4 ranks, not 2: load every rank's"):
        iter(stream)
    for bad in ({"ranges": [[0, 10**12]]}, {"ranks": 10**9}, {"samples": -1},
                {"ranges": [[5, 5]]}, {"counted": ["x"]}, {"epoch": "0"}):
        with pytest.raises(ValueError, match="a damaged ShardStream state"):
            stream.load_state_dict(state | {"rest": good | bad})
    with pytest.raises(ValueError, match="a damaged ShardStream position"):
        stream.rest_of_epoch([{"rank": 0, "world": 2, "num_workers": 1, "stream": state,
                               "slots": [{"tried": -3, "yielded": 0}]}])
