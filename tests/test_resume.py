"""Mid-epoch resume: a loader restored from state_dict() yields exactly the batches the
uninterrupted run yields next (same ids, order and augmentation draws), at many stop points,
with and without workers, persistent workers, prefetching, several ranks, an IterableDataset,
and after kill -9 of a whole two-rank job."""

from __future__ import annotations

import base64
import json
import os
import random
import signal
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
import torch

import fastmm
from fastmm import resume

from _resume_job import (Augmented, AugmentedStream, EpochStream, GaussianEvery, PositionedStream,
                         StaysAtItsEnd)

HERE = os.path.dirname(os.path.abspath(__file__))
EPOCHS = 2


def _seed_main(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _batches(loader, stop: int | None = None):
    """Batches over EPOCHS epochs; with ``stop``, the ones before it plus the state (loader and
    main-process RNGs, through JSON) taken with ``stop`` batches handed out."""
    out = []
    for _ in range(EPOCHS):
        it = iter(loader)
        while True:
            if len(out) == stop:
                state = json.loads(json.dumps(loader.state_dict()))
                return out, state, resume.capture_rng()
            try:
                out.append(next(it).tolist())
            except StopIteration:
                break
    if stop is not None:
        assert len(out) == stop, "stop point past the end"
        return out, json.loads(json.dumps(loader.state_dict())), resume.capture_rng()
    return out


def _resumed(make, state, rng, count: int):
    _seed_main(1234)  # the new process starts elsewhere; the checkpoint restores it
    loader = make()
    loader.load_state_dict(state)
    resume.apply_rng(rng)
    out = []
    while len(out) < count:
        for batch in loader:
            out.append(batch.tolist())
            if len(out) == count:
                break
    return out


def _check_resume_everywhere(make, stops):
    _seed_main(0)
    full = _batches(make())
    per_epoch = len(full) // EPOCHS
    for stop in stops(per_epoch):
        _seed_main(0)
        head, state, rng = _batches(make(), stop)
        assert len(json.dumps(state)) < 16_000 + 14_000 * make().num_workers  # small
        tail = _resumed(make, state, rng, len(full) - stop)
        assert head + tail == full, f"resumed at batch {stop}: batches differ"


def _shuffled(**changes):
    """The loader most tests here restore: shuffled, 2 workers, batches of 4."""
    return fastmm.DataLoader(Augmented(), **(dict(batch_size=4, shuffle=True, num_workers=2)
                                            | changes))


def _stops(per_epoch):
    # 0, 1, inside the prefetch window, the last batch, the epoch boundary, into epoch 2
    return [0, 1, 4, per_epoch - 1, per_epoch, per_epoch + 2]


CONFIGS = {
    "no workers": dict(num_workers=0),
    "2 workers, prefetch 3": dict(num_workers=2, prefetch_factor=3),
    "3 persistent workers": dict(num_workers=3, persistent_workers=True),
    "generator, pinned": dict(num_workers=2, generator="g", pin_memory=True),
}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*worker processes in total")
@pytest.mark.filterwarnings("ignore:.*pin_memory.*")
@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_resume_yields_the_uninterrupted_batches(config, transport):
    kwargs = dict(CONFIGS[config])

    def make():
        kw = dict(kwargs)
        if kw.get("generator"):
            kw["generator"] = torch.Generator().manual_seed(7)
        return fastmm.DataLoader(Augmented(), batch_size=4, shuffle=True, **kw)

    _check_resume_everywhere(make, _stops)


def test_a_cheap_rng_capture_equals_a_full_one():
    """Workers read NumPy's and random's states in full only when they may have changed; after
    every kind of draw, seeding and state setting, that gives what a full read gives."""
    start = random.getstate()
    steps = [lambda: None, lambda: np.random.rand(), lambda: np.random.standard_normal(),
             lambda: None, lambda: np.random.standard_normal(), lambda: np.random.seed(5),
             lambda: np.random.randint(10, size=700), lambda: np.random.standard_normal(),
             lambda: np.random.set_state(np.random.get_state()), lambda: random.random(),
             lambda: torch.rand(()), lambda: np.random.standard_normal(3),
             lambda: random.gauss(0, 1), lambda: random.gauss(0, 1), lambda: random.gauss(0, 1),
             lambda: random.seed(5), lambda: random.getrandbits(20000),
             lambda: random.setstate(start), lambda: random.shuffle(list(range(1000)))]
    assert resume._RANDOM_RAW_READABLE  # CPython 3.10-3.13 lay it out as read
    np.random.seed(0)
    last = resume.capture_rng()
    for step in steps:
        step()
        cheap = resume.capture_rng(last)
        _, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        assert cheap[1:] == (random.getstate(), (key.tobytes(), pos, has_gauss, gauss))
        last = cheap


@pytest.mark.slow
def test_resume_where_a_batch_uses_up_a_cached_gaussian():
    """A batch that only takes NumPy's cached Gaussian changes its state all the same."""
    _check_resume_everywhere(
        lambda: fastmm.DataLoader(GaussianEvery(), batch_size=1, num_workers=2),
        lambda per_epoch: [1, 2, 3, 4, 5, per_epoch + 1])


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_with_the_samplers_own_generator(num_workers):
    """RandomSampler(generator=g), g not the loader's: its state at the epoch's first draw (and,
    between epochs, its state then) travels too; before, a resumed epoch 2 (a new process seeds
    g as at the start) repeated epoch 1's order."""
    def make():
        ds = Augmented()
        sampler = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(13))
        return fastmm.DataLoader(ds, batch_size=4, sampler=sampler, num_workers=num_workers)

    _check_resume_everywhere(make, _stops)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_where_the_sampler_draws_from_the_loaders_generator_as_it_goes(num_workers):
    """RandomSampler(replacement=True) draws from its generator every 32 samples; given the
    loader's own generator, a resumed epoch went on from the generator's state at the save,
    past the draws for batches made ahead, and its batches differed from there on."""
    def make():
        ds = Augmented(96)  # batches of 8: a draw every 4 batches, the prefetch window 4
        g = torch.Generator().manual_seed(3)
        sampler = torch.utils.data.RandomSampler(ds, replacement=True, num_samples=len(ds),
                                                 generator=g)
        return fastmm.DataLoader(ds, batch_size=8, sampler=sampler, generator=g,
                                 num_workers=num_workers)

    _check_resume_everywhere(make, _stops)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*worker processes in total")
def test_resume_with_a_distributed_sampler_per_rank():
    for rank in range(2):
        def make(rank=rank):
            ds = Augmented()
            sampler = fastmm.DistributedSampler(ds, num_replicas=2, rank=rank, seed=9)
            return fastmm.DataLoader(ds, batch_size=3, sampler=sampler, num_workers=2,
                                     persistent_workers=True)

        _check_resume_everywhere(make, _stops)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_with_a_distributed_sampler_inside_a_batch_sampler(num_workers):
    """The sampler that draws is the one inside the batch sampler (the loader's own .sampler is
    a default one then): its epoch travels, or a resumed epoch 2 replays epoch 1's order."""
    def make():
        ds = Augmented()
        sampler = fastmm.DistributedSampler(ds, num_replicas=2, rank=1, seed=9)
        return fastmm.DataLoader(ds, batch_sampler=torch.utils.data.BatchSampler(sampler, 3, False),
                                 num_workers=num_workers)

    _check_resume_everywhere(make, _stops)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_an_iterable_dataset(num_workers):
    def make():
        return fastmm.DataLoader(AugmentedStream(), batch_size=3, num_workers=num_workers)

    # with 2 workers, worker 1 runs out first: stops before and after it did
    _check_resume_everywhere(make, lambda n: [0, 1, 3, n - 3, n - 1, n, n + 1])


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_a_stream_that_keeps_its_own_position(num_workers):
    """Each worker's copy (or, without workers, the one) goes on from the state it had after
    its last batch handed out; nothing handed out is skipped twice (torchdata's test_state_dict
    GeneratorIterable, test_no_mp, once caught that)."""
    def make():
        return fastmm.DataLoader(PositionedStream(), batch_size=3, num_workers=num_workers)

    _check_resume_everywhere(make, lambda n: [0, 1, 3, n - 1, n, n + 1])


@pytest.mark.parametrize("config", [dict(num_workers=0), dict(num_workers=2),
                                    dict(num_workers=2, persistent_workers=True)],
                         ids=["no workers", "2 workers", "2 persistent workers"])
@pytest.mark.slow
def test_resume_a_stream_whose_copies_count_their_epochs(config):
    """Persistent workers' copies carry their state into the next epoch: a state saved between
    epochs, or early in the next, keeps each worker's count (torchdata's TestMultiEpochState)."""
    def make():
        return fastmm.DataLoader(EpochStream(), batch_size=3, **config)

    _seed_main(0)
    ids = {row[0] // 1000 for batch in _batches(make()) for row in batch}
    assert ids == ({0, 1} if config.get("persistent_workers") or not config["num_workers"]
                   else {0})
    _check_resume_everywhere(make, lambda n: [1, n - 1, n, n + 1, n + 2, 2 * n - 1])


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "not persistent"])
@pytest.mark.parametrize("saved", ["as the epoch ran out", "as the next began"])
def test_a_stream_that_stays_at_its_end_gets_its_next_epoch(persistent, saved):
    """A state saved between epochs restores the next epoch whole, also for a stream whose
    state at its end says "nothing left" (torchdata's test_state_dict TestSnapshotEnd, with
    persistent workers, found the restored epoch empty): the state goes, as in torchdata, to
    an iterator that runs out, and the epoch gets one of its own."""
    def make():
        return fastmm.DataLoader(StaysAtItsEnd(), batch_size=3, num_workers=2,
                                 persistent_workers=persistent)

    _seed_main(0)
    loader = make()
    first = [b.tolist() for b in loader]
    if saved == "as the next began":
        it = iter(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    rng = resume.capture_rng()
    second = [b.tolist() for b in (it if saved == "as the next began" else loader)]
    assert len(second) == len(first) > 0
    _seed_main(1234)
    loader = make()
    loader.load_state_dict(state)
    resume.apply_rng(rng)
    assert [b.tolist() for b in loader] == second  # this epoch, not the one after


class DrawingIterator:
    """Draws from torch's global RNG and keeps that RNG's state in its own state, as
    torchdata's DummyIterator with a generator does."""

    def __init__(self):
        self.k = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.k == 12:
            raise StopIteration
        self.k += 1
        return torch.randint(0, 10**6, ()).item()

    def state_dict(self):
        return {"k": self.k, "rng": torch.get_rng_state()}

    def load_state_dict(self, state):
        self.k = state["k"]
        torch.set_rng_state(state["rng"])


class DrawingStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return DrawingIterator()


@pytest.mark.parametrize("stop", [0, 2])
def test_a_stream_keeping_the_rng_state_resumes_even_before_its_first_batch(stop):
    """Without workers the stream's state is taken as its iterator is made, too: saved
    before any batch, the restored stream still puts back the RNG state its draws start from
    (torchdata's test_random_state)."""
    torch.manual_seed(0)
    loader = fastmm.DataLoader(DrawingStream(), batch_size=3)
    it = iter(loader)
    for _ in range(stop):
        next(it)
    state = loader.state_dict()
    rest = [b.tolist() for b in it]
    torch.manual_seed(99)  # the caller's RNG is elsewhere now; the stream's state puts it back
    again = fastmm.DataLoader(DrawingStream(), batch_size=3)
    again.load_state_dict(state)
    assert [b.tolist() for b in again] == rest and len(rest) == 4 - stop


class UnpicklableStateStream(PositionedStream):
    def state_dict(self):
        return {"pos": self.pos, "hook": lambda: None}


class FailingStateStream(PositionedStream):
    def state_dict(self):
        raise NotImplementedError("no state here")


class FailingStateSampler(torch.utils.data.SequentialSampler):
    def state_dict(self):
        raise NotImplementedError("no sampler state")

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("case", ["unpicklable", "raises", "sampler"])
def test_a_state_dict_that_fails_leaves_the_epoch_to_run_as_torchs_does(num_workers, case):
    """torch's loader never calls a dataset's or sampler's state_dict(): one that raises or
    gives what cannot be pickled costs no batch; the loader's state_dict() says why it cannot
    save, with the owner's own message."""
    dataset = {"unpicklable": UnpicklableStateStream, "raises": FailingStateStream}.get(
        case, lambda: list(range(12)))()
    sampler = FailingStateSampler(dataset) if case == "sampler" else None
    kwargs = dict(batch_size=3, num_workers=num_workers, sampler=sampler)
    seed = lambda: (torch.manual_seed(0), random.seed(0), np.random.seed(0))  # noqa: E731
    seed()
    expected = [b.tolist() if torch.is_tensor(b) else b
                for b in torch.utils.data.DataLoader(dataset, **kwargs)]
    loader = fastmm.DataLoader(dataset, **kwargs)
    seed()
    it = iter(loader)
    got = [next(it)]
    message = {"unpicklable": "pickle", "raises": "no state here", "sampler": "no sampler state"}
    with pytest.raises(RuntimeError, match=message[case]):
        loader.state_dict()
    got += list(it)
    assert [b.tolist() if torch.is_tensor(b) else b for b in got] == expected


class ModuleStream(torch.utils.data.IterableDataset, torch.nn.Module):
    """A stream that is also an nn.Module with weights: its state_dict() is the weights."""

    def __init__(self):
        torch.utils.data.IterableDataset.__init__(self)
        torch.nn.Module.__init__(self)
        self.weight = torch.nn.Parameter(torch.zeros(4))

    def __iter__(self):
        return iter(range(10))


def test_a_modules_weights_are_not_taken_for_a_stream_state():
    """An nn.Module's state_dict() is its weights: never asked per batch or saved as the
    stream's place, which is found again by pulling the samples handed out."""
    data = ModuleStream()
    assert not resume._stateful(data)
    loader = fastmm.DataLoader(data, batch_size=3)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert "weight" not in json.dumps(state, default=str)
    restored = fastmm.DataLoader(ModuleStream(), batch_size=3)
    restored.load_state_dict(state)
    assert [b.tolist() for b in restored] == [[3, 4, 5], [6, 7, 8], [9]]


class LoggedIterator:
    """An iterator with its own state_dict(), as torchdata's resumable iterators have, that
    notes every id it makes in a file of its process."""

    def __init__(self, ids, log_dir):
        self.ids, self.log_dir, self.k = ids, log_dir, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.k == len(self.ids):
            raise StopIteration
        i, self.k = self.ids[self.k], self.k + 1
        with open(os.path.join(self.log_dir, str(os.getpid())), "a") as f:
            f.write(f"{i}\n")
        return AugmentedStream.augment(i)

    def state_dict(self):
        return {"k": self.k}

    def load_state_dict(self, state):
        self.k = state["k"]


class LoggedStream(AugmentedStream):
    def __init__(self, log_dir):
        super().__init__()
        self.log_dir = log_dir

    def __iter__(self):
        return LoggedIterator(self.ids(), self.log_dir)


def _made(log_dir) -> list[int]:
    ids = []
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name)) as f:
            ids += [int(line) for line in f]
        os.remove(os.path.join(log_dir, name))
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stream_with_its_own_state_is_not_read_again(tmp_path, num_workers):
    """A resumed loader does not pull and drop what was handed out when the stream's iterator
    keeps its own place: it makes only the samples not handed out before the save."""
    def make():
        return fastmm.DataLoader(LoggedStream(str(tmp_path)), batch_size=3,
                                 num_workers=num_workers)

    _check_resume_everywhere(make, lambda n: [0, 1, 3, n - 1, n, n + 1])
    _made(tmp_path)
    _seed_main(0)
    head, state, rng = _batches(make(), 4)
    assert all(s is not None and s[0] == "iterator" for s in state["worker_streams"])
    _made(tmp_path)
    tail = _resumed(make, state, rng, 2)
    made = _made(tmp_path)
    handed_out = {row[0] for batch in head for row in batch}
    assert not handed_out & set(made) and {row[0] for batch in tail for row in batch} <= set(made)


def test_a_resumed_loader_can_be_saved_and_resumed_again():
    _seed_main(0)
    full = _batches(_shuffled())
    _seed_main(0)
    head, state, rng = _batches(_shuffled(), 2)
    _seed_main(5)
    loader = _shuffled()
    loader.load_state_dict(state)
    resume.apply_rng(rng)
    it = iter(loader)
    middle = [next(it).tolist() for _ in range(3)]
    state2, rng2 = json.loads(json.dumps(loader.state_dict())), resume.capture_rng()
    del it
    tail = _resumed(_shuffled, state2, rng2, len(full) - 5)
    assert head + middle + tail == full


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_right_after_load_is_the_loaded_state(num_workers):
    """Also once the iterator exists, before its first batch (without workers its sampler is
    not replayed until then: hypothesis found that state resuming a fresh order)."""
    _seed_main(0)
    _, state, _ = _batches(_shuffled(num_workers=num_workers), 3)
    loader = _shuffled(num_workers=num_workers)
    loader.load_state_dict(state)
    assert json.loads(json.dumps(loader.state_dict())) == state
    it = iter(loader)
    assert json.loads(json.dumps(loader.state_dict())) == state
    del it


def test_resuming_mid_epoch_with_other_settings_raises():
    _seed_main(0)
    _, state, _ = _batches(_shuffled(), 3)
    for changed in (dict(drop_last=True),):  # (num_workers, batch_size: test_resume_elastic)
        loader = _shuffled(**changed)
        with pytest.raises(ValueError, match="cannot resume mid-epoch") as e:
            loader.load_state_dict(state)
        assert next(iter(changed)) in str(e.value)
    shorter = fastmm.DataLoader(Augmented(30), batch_size=4, shuffle=True, num_workers=2)
    with pytest.raises(ValueError, match="samples: saved 37, now 30"):
        shorter.load_state_dict(state)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sampler_that_keeps_its_place_instead_of_its_epoch_is_refused_not_replayed_short(
        num_workers):
    """torchdata's StatefulDistributedSampler keeps its place in the epoch (reset at the first
    draw), so its state as an epoch begins is the last epoch's end: replayed, the epoch would be
    empty. That is an error naming the sampler, not an epoch silently lost."""
    sampler_module = pytest.importorskip("torchdata.stateful_dataloader.sampler")

    def make():
        ds = Augmented()
        sampler = sampler_module.StatefulDistributedSampler(ds, num_replicas=2, rank=0, seed=1)
        return fastmm.DataLoader(ds, sampler=sampler, batch_size=2, num_workers=num_workers)

    first = make()
    list(first)  # epoch 0 ran out: the sampler's place is at its end
    first.sampler.set_epoch(1)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    resumed = make()
    resumed.sampler.set_epoch(1)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match="restored epoch has 0 batches, but 2 were handed out"):
        list(resumed)


@pytest.mark.parametrize("inside", [False, True], ids=["sampler", "in a batch sampler"])
def test_resuming_mid_epoch_on_another_world_size_raises(inside):
    def make(world, rank):
        ds = Augmented()
        sampler = fastmm.DistributedSampler(ds, num_replicas=world, rank=rank)
        if inside:
            return fastmm.DataLoader(ds, num_workers=0, batch_sampler=torch.utils.data.BatchSampler(sampler, 3, False))
        return fastmm.DataLoader(ds, batch_size=3, num_workers=0, sampler=sampler)

    _, state, _ = _batches(make(4, 1), 2)
    with pytest.raises(ValueError, match=r"world: saved \[1, 4\], now \[1, 2\]"):
        make(2, 1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"world: saved \[1, 4\], now \[0, 4\]"):
        make(4, 0).load_state_dict(state)


def test_a_state_at_an_epoch_boundary_moves_to_another_worker_count():
    """Between epochs the worker count may change: the next epoch has the same samples in the
    same order (augmentation follows the new workers' seeds, as in any new run)."""
    def make(workers):
        ds = Augmented()
        return fastmm.DataLoader(ds, batch_size=4, num_workers=workers,
                                 sampler=fastmm.DistributedSampler(ds, num_replicas=1, rank=0))

    _seed_main(0)
    full = _batches(make(2))
    _seed_main(0)
    first = make(2)
    head = [b.tolist() for b in first]  # the epoch ran out: the state is between epochs
    state, rng = json.loads(json.dumps(first.state_dict())), resume.capture_rng()
    assert state["epoch_done"]
    tail = _resumed(lambda: make(3), state, rng, len(full) - len(head))
    assert [[row[0] for row in b] for b in head + tail] == [[row[0] for row in b] for b in full]
    assert tail != full[len(head):]  # other workers, other draws: it really changed layout


class SlowAt(Augmented):
    """Item ``slow`` takes a while, so batches after it come back before it (in_order=False)."""

    def __init__(self, slow: int, n: int = 37):
        super().__init__(n)
        self.slow = slow

    def __getitem__(self, i):
        if i == self.slow:
            time.sleep(0.4)
        return super().__getitem__(i)


def _ids(batches) -> list[int]:
    return [row[0] for batch in batches for row in batch]


@pytest.mark.parametrize("stop", [1, 3, 6])
def test_out_of_order_batches_resume_each_sample_once(stop):
    """in_order=False: the batches handed out ahead of a slow one are remembered, so the
    resumed loader yields the rest, each sample once; saved and resumed again, the same
    (torchdata's TestOutOfOrderWithCheckpointing)."""
    def make():
        return fastmm.DataLoader(SlowAt(0), batch_size=2, num_workers=2, in_order=False)

    loader = make()
    it = iter(loader)
    head = [next(it).tolist() for _ in range(stop)]
    state = json.loads(json.dumps(loader.state_dict()))
    assert 0 not in _ids(head) and state["ahead"]  # batch 0 is still on its way
    del it
    again = make()
    again.load_state_dict(state)
    it = iter(again)
    middle = [next(it).tolist()]
    state = json.loads(json.dumps(again.state_dict()))
    del it
    third = make()
    third.load_state_dict(state)
    tail = [b.tolist() for b in third]
    assert sorted(_ids(head + middle + tail)) == list(range(37))


@pytest.mark.parametrize("stream", [AugmentedStream, PositionedStream])
def test_out_of_order_streams_resume_each_sample_once(stream):
    def make():
        return fastmm.DataLoader(stream(), batch_size=3, num_workers=2, in_order=False)

    every = sorted(_ids(b.tolist() for b in make()))
    loader = make()
    it = iter(loader)
    head = [next(it).tolist() for _ in range(4)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    again = make()
    again.load_state_dict(state)
    assert sorted(_ids(head + [b.tolist() for b in again])) == every


def test_a_state_from_something_else_is_refused():
    loader = fastmm.DataLoader(Augmented(), batch_size=4)
    for bad in ({}, {"fastmm_loader_state": 99}, [1, 2]):
        with pytest.raises(ValueError, match="not a fastmm DataLoader state"):
            loader.load_state_dict(bad)


_DAMAGE = {
    "a field gone": lambda s: s.pop("workers"),
    "a negative count": lambda s: s.update(batches=-1),
    "counts of another type": lambda s: s.update(worker_batches="xx"),
    "a worker's state cut short": lambda s: s["workers"][0].update(
        torch=s["workers"][0]["torch"][:40]),
    "a generator state of the wrong size": lambda s: s.update(
        generator=base64.b64encode(zlib.compress(b"\0" * 100)).decode()),
    "a random state of the wrong size": lambda s: s["workers"][0]["random"].update(words=""),
    "a worker list of another length": lambda s: s["workers"].append(None),
}


@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_a_damaged_state_is_a_value_error(damage):
    """Found by fuzz/fuzz.py state: before, KeyError, TypeError, AttributeError, or a
    RuntimeError later when the states were applied."""
    loader = _shuffled(generator=torch.Generator())
    it = iter(loader)
    next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    _DAMAGE[damage](state)
    with pytest.raises(ValueError, match="damaged fastmm DataLoader state"):
        _shuffled(generator=torch.Generator()).load_state_dict(state)


class RefusesItsState(Augmented):
    def load_state_dict(self, state):
        raise KeyError("the dataset's own complaint")

    def state_dict(self):
        return {"mine": 1}


def test_a_datasets_own_load_error_is_not_called_damage():
    """Only the loader's part of the state is read as possibly damaged; the dataset's (and a
    sampler's) load_state_dict runs after it is all checked, and its errors stay its own."""
    state = fastmm.DataLoader(RefusesItsState(), batch_size=4).state_dict()
    with pytest.raises(KeyError, match="the dataset's own complaint"):
        fastmm.DataLoader(RefusesItsState(), batch_size=4).load_state_dict(state)


def test_a_fresh_loader_state_restores_to_a_fresh_start():
    _seed_main(0)
    full = _batches(_shuffled())
    _seed_main(0)
    loader = _shuffled()
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["epoch_done"] and state["batches"] == 0
    loader2 = _shuffled()
    loader2.load_state_dict(state)
    assert _batches(loader2) == full


def test_the_multimodal_dataset_keeps_its_skip_counts(tmp_path):
    from fastmm.bench.mmcorpus import CorpusSpec, write_corpus

    root = tmp_path / "corpus"
    write_corpus(CorpusSpec(num_images=6, num_videos=0, seed=1, png_fraction=0.0,
                            image_short_side=(40, 60), large_fraction=0.0), str(root))
    victim = sorted((root / "posix").rglob("*.jpg"))[0]
    victim.write_bytes(b"not a jpeg")
    ds = fastmm.MultimodalDataset(str(root / "posix"), size=16, on_error="skip", modality="image")
    loader = fastmm.DataLoader(ds, batch_size=2, num_workers=2)
    list(loader)
    assert ds.skipped == {"corrupt": 1}
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["dataset"]["skipped"] == {"corrupt": 1}
    ds2 = fastmm.MultimodalDataset(str(root / "posix"), size=16, on_error="skip", modality="image")
    fastmm.DataLoader(ds2, batch_size=2, num_workers=2).load_state_dict(state)
    assert ds2.skipped == {"corrupt": 1} and ds2.replaced == 0


@pytest.mark.parametrize("in_order, subset, workers",
                         [(True, False, 2), (False, False, 2), (True, True, 2), (True, False, 66)],
                         ids=["in order", "out of order", "through a Subset", "66 workers"])
@pytest.mark.slow
def test_mid_epoch_skip_counts_are_those_of_the_batches_handed_out(tmp_path, in_order, subset,
                                                                   workers):
    """Workers run ahead of the loop: the bad samples in batches made but not handed out are
    not in the saved counts (the restored loader makes those batches again and counts them
    then), so a resumed run counts each bad sample once. A Subset's dataset (random_split's)
    has its counts saved too. Past 64 workers too (their counts once shared rows)."""
    from fastmm.bench.mmcorpus import CorpusSpec, write_corpus

    from _datasets import CorruptOn

    root = str(tmp_path / "posix")
    write_corpus(CorpusSpec(num_images=16 if workers == 2 else 4 * workers, num_videos=0, seed=1,
                            image_short_side=(32, 40), large_fraction=0.0), str(tmp_path))
    bad = fastmm.MultimodalDataset(root).source.keys()[1::3]

    def loader():
        ds = fastmm.MultimodalDataset(root, size=16, crop="center", on_error="skip",
                                      decoder=CorruptOn(bad))
        if subset:
            ds = torch.utils.data.Subset(ds, range(len(ds)))
        return fastmm.DataLoader(ds, batch_size=2, num_workers=workers, in_order=in_order)

    whole = loader()
    want = sorted(k for b in whole for k in b["key"])
    counts = _skipped(whole)
    assert counts["corrupt"] >= 4
    for stop in (0, 2):
        first, got = loader(), []
        for n, batch in enumerate(first):
            got += batch["key"]
            if n == stop:
                time.sleep(0.5)  # the workers make the batches ahead
                state = json.loads(json.dumps(first.state_dict()))
                break
        # (out of order, the first batch handed out may be one without a bad sample)
        assert _skipped(first)["corrupt"] > state["dataset"]["skipped"].get("corrupt", 0)
        second = loader()
        second.load_state_dict(state)
        got += [k for b in second for k in b["key"]]
        assert sorted(got) == want
        assert _skipped(second) == counts


def test_a_concat_datasets_states_travel_with_the_loader(tmp_path):
    """A ConcatDataset of two MultimodalDatasets: each one's counts are saved mid-epoch (as of
    the batches handed out) and restored into its counterpart; a state for one dataset does
    not load into two."""
    from fastmm.bench.mmcorpus import CorpusSpec, write_corpus

    from _datasets import CorruptOn

    root = str(tmp_path / "posix")
    write_corpus(CorpusSpec(num_images=12, num_videos=0, seed=2, image_short_side=(32, 40),
                            large_fraction=0.0), str(tmp_path))
    keys = fastmm.MultimodalDataset(root).source.keys()

    def loader():
        parts = [fastmm.MultimodalDataset(root, size=16, crop="center", on_error="replace",
                                          decoder=CorruptOn(keys[first::5]))
                 for first in (1, 2)]
        return fastmm.DataLoader(torch.utils.data.ConcatDataset(parts), batch_size=3,
                                 num_workers=2)

    def counts(loader):
        return [(d.skipped, d.replaced) for d in loader.dataset.datasets]

    whole = loader()
    want = [k for b in whole for k in b["key"]]
    assert all(skipped for skipped, _ in counts(whole))
    first, got = loader(), []
    for n, batch in enumerate(first):
        got += batch["key"]
        if n == 2:
            time.sleep(0.5)  # the workers make the batches ahead
            state = json.loads(json.dumps(first.state_dict()))
            break
    assert len(state["dataset"]["fastmm_datasets"]) == 2
    second = loader()
    second.load_state_dict(state)
    assert got + [k for b in second for k in b["key"]] == want
    assert counts(second) == counts(whole)
    single = fastmm.DataLoader(fastmm.MultimodalDataset(root), batch_size=3)
    with pytest.raises(ValueError, match="not one for the 2 datasets"):
        second.load_state_dict(single.state_dict())


def _skipped(loader) -> dict:
    return getattr(loader.dataset, "dataset", loader.dataset).skipped


def _run_job(out, world: int, *args, env_extra=None):
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), **(env_extra or {}))
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "_resume_job.py"),
                                       str(out), *args], env=env, start_new_session=True))
    return procs


def _steps(path) -> list:
    """The batch of each step, the last one written for it winning (a killed run may have
    logged a step its checkpoint did not cover; the resumed run writes it again)."""
    by_step = {}
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):
                row = json.loads(line)
                by_step[row["step"]] = row["batch"]
    return [by_step[k] for k in sorted(by_step)]


@pytest.mark.slow
def test_resume_after_kill_9_of_the_whole_job(tmp_path):
    world = 2
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    clean.mkdir()
    killed.mkdir()
    for p in _run_job(clean, world):
        assert p.wait(timeout=120) == 0
    procs = _run_job(killed, world, env_extra={"JOB_STEP_SLEEP": "0.05"})
    deadline = time.monotonic() + 60
    while True:  # kill mid-run, once every rank has checkpointed a few steps into epoch 1
        done = []
        for rank in range(world):
            try:
                with open(killed / f"rank{rank}.ckpt.json") as f:
                    done.append(json.load(f)["done"])
            except (FileNotFoundError, json.JSONDecodeError):
                done.append(0)
        if min(done) >= 9:
            break
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.01)
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)  # the rank and its workers, at once
    for p in procs:
        p.wait(timeout=30)
    for p in _run_job(killed, world, "--resume"):
        assert p.wait(timeout=120) == 0
    seen = []
    for rank in range(world):
        want = _steps(clean / f"rank{rank}.jsonl")
        assert _steps(killed / f"rank{rank}.jsonl") == want
        seen.append(want)
    # and the job itself split the samples: each id once per epoch over the ranks (37 ids,
    # world 2: one padded), equal step counts
    assert len(seen[0]) == len(seen[1])
    half = len(seen[0]) // EPOCHS
    for epoch in range(EPOCHS):
        ids = [row[0] for r in seen for b in r[epoch * half:(epoch + 1) * half] for row in b]
        assert sorted(set(ids)) == list(range(37)) and len(ids) == 38


class StateAfterIter(AugmentedStream):
    """Its state_dict() works only once __iter__ ran in this process (as some streams do)."""

    def __iter__(self):
        self.it = super().__iter__()
        return self.it

    def state_dict(self):
        return {"started": self.it is not None}


def test_a_stream_whose_state_needs_iterating_still_loads_with_workers():
    """With workers, the main process's copy of a stream never iterates: iter() must not fail
    on asking it for its state as the epoch begins, nor state_dict() later (torchdata's
    TestStateInitializationDataset). Without workers, its error is its own."""
    loader = fastmm.DataLoader(StateAfterIter(), batch_size=3, num_workers=2)
    assert len([b for b in loader]) == 12
    assert loader.state_dict()["dataset"] is None
    loader = fastmm.DataLoader(StateAfterIter(), batch_size=3, num_workers=0)
    with pytest.raises(AttributeError):
        loader.state_dict()
