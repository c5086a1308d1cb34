"""Mid-epoch resume side by side with torchdata's StatefulDataLoader: the same scenarios (the
ones its test_state_dict.py runs, in our own words) through both loaders must give the same
batches, and the batches of a run never interrupted. A resumed epoch that differs from
torchdata's is a bug in one of them; these found one in ours (a persistent worker's state saved
as its epoch ran out gave an empty restored epoch)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, RandomSampler, Sampler, get_worker_info

import fastmm

torchdata = pytest.importorskip("torchdata.stateful_dataloader")


def identity(batch):
    return batch


class Counter:
    """An iterator over ``samples`` that keeps its place (and torch's RNG, when it draws from
    it) in its own state, as torchdata's test iterators do."""

    def __init__(self, samples, shuffle):
        self.samples, self.shuffle, self.i = samples, shuffle, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= len(self.samples):
            raise StopIteration
        k = torch.randint(len(self.samples), ()).item() if self.shuffle else self.i
        self.i += 1
        return self.samples[k]

    def state_dict(self):
        return {"i": self.i, "rng": torch.get_rng_state()} if self.shuffle else {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]
        if self.shuffle:
            torch.set_rng_state(state["rng"])


class Split(IterableDataset):
    """Worker w streams its own run of ids (``sizes[w]`` of them) through a Counter."""

    def __init__(self, sizes, shuffle=False):
        self.sizes, self.shuffle = sizes, shuffle

    def __iter__(self):
        info = get_worker_info()
        sizes, w = (self.sizes, info.id) if info else ([sum(self.sizes)], 0)
        start = sum(sizes[:w])
        return Counter(list(range(start, start + sizes[w])), self.shuffle)


class Resumes(IterableDataset):
    """Keeps how far it got in the dataset's own state and starts its next iterator there
    (its end included, unless ``rewinds``), and counts its epochs if ``counts_epochs``."""

    def __init__(self, sizes, rewinds=False, counts_epochs=False):
        self.sizes, self.rewinds, self.counts_epochs = sizes, rewinds, counts_epochs
        self.i, self.resume, self.epoch = 0, None, 0

    def __iter__(self):
        info = get_worker_info()
        sizes, w = (self.sizes, info.id) if info else ([sum(self.sizes)], 0)
        self.i, self.resume = self.resume or 0, None
        start = sum(sizes[:w])
        for k in range(start + self.i, start + sizes[w]):
            self.i += 1
            yield k, self.epoch
        if self.rewinds:
            self.i = 0
        if self.counts_epochs:
            self.epoch += 1

    def state_dict(self):
        return {"i": self.i, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.resume, self.epoch = state["i"], state["epoch"]


class Rows(Dataset):
    """Map-style rows; with ``shuffle``, each item draws which row from torch's RNG, whose
    state it keeps in its own (torchdata restores a worker's RNG only that way; fastmm restores
    each worker's RNG states whatever the dataset keeps)."""

    def __init__(self, n=100, shuffle=False):
        self.n, self.shuffle = n, shuffle

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.shuffle:
            i = torch.randint(self.n, ()).item()
        return {"id": i, "text": f"row {i}", "ids": [i, i + 1]}

    def state_dict(self):
        return {"rng": torch.get_rng_state()} if self.shuffle else {}

    def load_state_dict(self, state):
        if self.shuffle:
            torch.set_rng_state(state["rng"])


class Counting(Sampler):
    """A sampler whose iterator keeps its own place."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return Counter(list(range(self.n)), shuffle=False)


def _interrupted(make, interrupt):
    """The batches after ``interrupt``, from the loader itself and from a new one restored
    from its state."""
    loader = make()
    it = iter(loader)
    for _ in range(interrupt):
        next(it)
    state = loader.state_dict()
    expected = list(it)
    restored = make()
    restored.load_state_dict(state)
    return expected, list(restored)


STREAMS = list(itertools.product([0, 3], [False, True], [1, 10], [False, True]))


@pytest.mark.parametrize("num_workers,persistent,interrupt,shuffle", [
    case for case in STREAMS if not (case[0] == 0 and case[1])])
def test_a_stream_resumes_mid_epoch_as_with_torchdata(num_workers, persistent, interrupt, shuffle):
    def run(loader_class):
        torch.manual_seed(0)
        return _interrupted(lambda: loader_class(
            Split([0, 100, 37] if num_workers else [137], shuffle), num_workers=num_workers,
            persistent_workers=persistent, collate_fn=identity), interrupt)

    expected, restored = run(fastmm.DataLoader)
    assert restored == expected
    assert run(torchdata.StatefulDataLoader) == (expected, restored)


@pytest.mark.parametrize("sampler", ["random", "counting"])
@pytest.mark.parametrize("num_workers,persistent", [(3, False), (3, True)])
def test_a_map_dataset_resumes_mid_epoch_as_with_torchdata(sampler, num_workers, persistent):
    def run(loader_class):
        def make():
            rows = Rows(shuffle=True)
            order = (RandomSampler(rows, generator=torch.Generator().manual_seed(13))
                     if sampler == "random" else Counting(len(rows)))
            return loader_class(rows, batch_size=7, sampler=order, num_workers=num_workers,
                                persistent_workers=persistent, collate_fn=identity)

        torch.manual_seed(0)
        return _interrupted(make, 4)

    expected, restored = run(fastmm.DataLoader)
    assert restored == expected
    assert run(torchdata.StatefulDataLoader) == (expected, restored)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("batch_size", [None, 4])
def test_a_state_saved_as_the_epoch_ran_out_restores_the_next_epoch(persistent, batch_size):
    """A stream that starts its next iterator where its state says, its end included."""
    def run(loader_class):
        def make():
            return loader_class(Resumes([0, 100, 37]), num_workers=3, batch_size=batch_size,
                                persistent_workers=persistent, collate_fn=identity)

        loader = make()
        first = list(loader)
        state = loader.state_dict()
        again = make()
        next(iter(again))  # a loader already running when it loads the state
        again.load_state_dict(state)
        return first, list(again)

    first, restored = run(fastmm.DataLoader)
    assert restored == first and len(first) > 0
    assert run(torchdata.StatefulDataLoader) == (first, restored)


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (4, True)])
def test_copies_that_count_their_epochs_carry_them_through_a_restore(num_workers, persistent):
    def run(loader_class):
        def make():
            sizes = [25, 50, 100, 75] if num_workers else [250]
            return loader_class(Resumes(sizes, rewinds=True, counts_epochs=True),
                                num_workers=num_workers, persistent_workers=persistent,
                                collate_fn=identity)

        loader = make()
        first = list(loader)
        state = loader.state_dict()
        second, third = list(loader), list(loader)
        again = make()
        it = iter(again)
        next(it), next(it)
        again.load_state_dict(state)
        return first, second, third, list(again), list(again)

    first, second, third, restored_second, restored_third = run(fastmm.DataLoader)
    assert [[(i, e - 1)] for [(i, e)] in second] == first
    assert (restored_second, restored_third) == (second, third)
    assert run(torchdata.StatefulDataLoader) == (first, second, third, restored_second,
                                                 restored_third)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_state_before_and_after_the_epoch_end_as_with_torchdata(num_workers, shuffle):
    """Saved after the last batch, inside the loop: nothing left of that epoch; saved after the
    loop: the next epoch, whole. Then two more epochs match a run never interrupted."""
    def run(loader_class):
        def make():
            return loader_class(Rows(40), batch_size=1, shuffle=shuffle, num_workers=num_workers)

        torch.manual_seed(0)
        loader = make()
        for _ in loader:
            inside = loader.state_dict()
        after = loader.state_dict()
        counts = []
        for state in (inside, after):
            restored = make()
            restored.load_state_dict(state)
            counts.append(len(list(restored)))
        torch.manual_seed(0)
        loader = make()
        epochs = [list(loader) for _ in range(2)]
        state = loader.state_dict()
        restored = make()
        restored.load_state_dict(state)
        epochs += [list(restored) for _ in range(2)]
        torch.manual_seed(0)
        loader = make()
        return counts, epochs == [list(loader) for _ in range(4)]

    assert run(fastmm.DataLoader) == ([0, 40], True)
    assert run(torchdata.StatefulDataLoader) == ([0, 40], True)


@pytest.mark.parametrize("num_workers", [0, 3])
def test_a_state_goes_through_json(num_workers):
    def run(loader_class):
        loader = loader_class(Split([0, 100, 37] if num_workers else [137]),
                              num_workers=num_workers, collate_fn=identity)
        list(loader)
        it = iter(loader)
        for _ in range(4):
            next(it)
        text = json.dumps(loader.state_dict())
        return text, list(it)

    text, expected = run(fastmm.DataLoader)
    restored = fastmm.DataLoader(Split([0, 100, 37] if num_workers else [137]),
                                 num_workers=num_workers, collate_fn=identity)
    restored.load_state_dict(json.loads(text))
    assert list(restored) == expected


@pytest.mark.parametrize("snapshot_every_n_steps", [0, 1, 5, None])
def test_snapshot_every_n_steps_is_accepted_and_every_step_stays_exact(snapshot_every_n_steps):
    """torchdata's argument (how often its workers send their state) is taken as it is, so
    its users change only the import; fastmm's state is exact at any step whatever its value,
    here interrupted at a step that is no multiple of it."""
    def run(loader_class):
        def make():
            rows = Rows(shuffle=True)
            return loader_class(rows, batch_size=7, num_workers=2, collate_fn=identity,
                                sampler=RandomSampler(rows, generator=torch.Generator()
                                                      .manual_seed(13)),
                                snapshot_every_n_steps=snapshot_every_n_steps)

        torch.manual_seed(0)
        return _interrupted(make, 7)

    expected, restored = run(fastmm.DataLoader)
    assert restored == expected
    assert run(torchdata.StatefulDataLoader) == (expected, restored)


def test_snapshot_every_n_steps_is_checked():
    assert fastmm.DataLoader(range(4), snapshot_every_n_steps=3).snapshot_every_n_steps == 3
    with pytest.raises(ValueError, match="snapshot_every_n_steps should be a non-negative"):
        fastmm.DataLoader(range(4), snapshot_every_n_steps=-1)
    with pytest.raises(TypeError, match="snapshot_every_n_steps should be an integer"):
        fastmm.DataLoader(range(4), snapshot_every_n_steps=2.5)
