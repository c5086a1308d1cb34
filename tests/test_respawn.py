"""on_worker_failure="respawn": workers killed at random over a long epoch are replaced and
their unfinished batches made again -- the run yields exactly the fault-free run's batches
(ids, order and augmentation draws); a batch that keeps killing its worker is an error."""

from __future__ import annotations

import os
import random
import signal
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import fastmm
from fastmm.bench.mmcorpus import CorpusSpec

from _datasets import CorruptOn
from _resume_job import Augmented, AugmentedStream, EpochStream, PositionedStream


class SlowAugmented(Augmented):
    def __getitem__(self, i):
        time.sleep(0.002)
        return super().__getitem__(i)


class KillsOn(Dataset):
    """Index ``bad`` kills its worker (every time)."""

    def __init__(self, bad: int):
        self.bad = bad

    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i == self.bad:
            os.kill(os.getpid(), signal.SIGKILL)
        return i


def _seed(seed=0):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _run(make, kills: set[int], sig=signal.SIGKILL):
    """All batches of one epoch; after each batch number in ``kills``, a worker is killed."""
    _seed()
    loader = make()
    it = iter(loader)
    picker = random.Random(1)
    out, pids, killed = [], set(), set()
    for n, batch in enumerate(it):
        out.append(batch.tolist())
        pids.update(w.pid for w in it._workers)
        if n in kills:
            victim = it._workers[picker.randrange(len(it._workers))].pid
            os.kill(victim, sig)  # (a worker already dead and not yet replaced: no new death)
            killed.add(victim)
    return out, (len(pids), len(killed))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
def test_random_kills_lose_nothing_and_change_nothing(sig, transport):
    def make():
        return fastmm.DataLoader(SlowAugmented(400), batch_size=4, shuffle=True, num_workers=2,
                                 prefetch_factor=3, on_worker_failure="respawn")

    clean, _ = _run(make, set())
    kills = set(random.Random(7).sample(range(2, 95), 12))
    faulty, (processes, killed) = _run(make, kills, sig)
    assert killed >= len(kills) // 2 and processes >= 2 + killed  # each death was replaced
    assert faulty == clean  # every id once, same order, same augmentation draws
    assert sorted(row[0] for b in faulty for row in b) == list(range(400))


@pytest.mark.slow
def test_spawned_replacements_lose_nothing_with_one_core(monkeypatch):
    """Under spawn a replacement starts as the first workers do, no more starting at once than
    there are cores; what its predecessor said on starting does not count for it."""
    monkeypatch.setattr("fastmm.doctor.usable_cores", lambda: 1)

    def make():
        return fastmm.DataLoader(Augmented(40), batch_size=2, shuffle=True, num_workers=2,
                                 multiprocessing_context="spawn", on_worker_failure="respawn")

    clean, _ = _run(make, set())
    faulty, (processes, killed) = _run(make, {2, 9})
    assert killed == 2 and processes == 4
    assert faulty == clean


def test_respawn_with_persistent_workers_over_two_epochs():
    def make():
        return fastmm.DataLoader(SlowAugmented(60), batch_size=3, shuffle=True, num_workers=2,
                                 persistent_workers=True, on_worker_failure="respawn")

    def two_epochs(kill: bool):
        _seed()
        loader = make()
        out = []
        for epoch in range(2):
            it = iter(loader)
            for n, batch in enumerate(it):
                out.append(batch.tolist())
                if kill and n in (3, 11):
                    os.kill(it._workers[n % 2].pid, signal.SIGKILL)
        return out

    assert two_epochs(True) == two_epochs(False)


@pytest.mark.parametrize("stream", [AugmentedStream, PositionedStream],
                         ids=["pulled again", "from its own state"])
def test_respawn_an_iterable_dataset_worker(stream):
    def make():
        return fastmm.DataLoader(stream(), batch_size=2, num_workers=2,
                                 on_worker_failure="respawn")

    clean, _ = _run(make, set())
    faulty, _ = _run(make, {1, 4, 6})
    assert faulty == clean


def test_respawn_a_persistent_stream_over_two_epochs():
    """A replacement in the second epoch starts from the dataset copy its predecessor had as
    the first ran out (here an epoch count), not from the main process's."""
    def two_epochs(kill: bool):
        _seed()
        loader = fastmm.DataLoader(EpochStream(), batch_size=2, num_workers=2,
                                   persistent_workers=True, on_worker_failure="respawn")
        out = []
        for epoch in range(2):
            it = iter(loader)
            if kill and epoch == 1:  # before the loop received anything of this epoch
                os.kill(it._workers[1].pid, signal.SIGKILL)
            for n, batch in enumerate(it):
                out.append(batch.tolist())
                if kill and n in (1, 6):
                    os.kill(it._workers[n % 2].pid, signal.SIGKILL)
        return out

    clean = two_epochs(False)
    assert {row[0] // 1000 for batch in clean for row in batch} == {0, 1}
    assert two_epochs(True) == clean


def test_a_batch_that_keeps_killing_its_worker_is_an_error():
    loader = fastmm.DataLoader(KillsOn(13), batch_size=2, num_workers=2,
                               on_worker_failure="respawn")
    with pytest.raises(RuntimeError, match=r"died 4 times on the same batch \(indices \[12, 13\]"):
        list(loader)


def test_without_respawn_a_killed_worker_is_still_an_error():
    loader = fastmm.DataLoader(KillsOn(5), batch_size=2, num_workers=2)
    with pytest.raises(RuntimeError, match="exited unexpectedly|killed by signal"):
        list(loader)


def test_on_worker_failure_is_checked():
    with pytest.raises(ValueError, match="on_worker_failure='sometimes'"):
        fastmm.DataLoader(Augmented(), on_worker_failure="sometimes")


def test_telemetry_counts_the_respawned_workers():
    from fastmm.telemetry import Telemetry

    loader = fastmm.DataLoader(SlowAugmented(80), batch_size=4, num_workers=2,
                               on_worker_failure="respawn")
    tm = Telemetry()
    ids = []
    for n, batch in enumerate(tm.watch(loader)):
        ids += [row[0] for row in batch.tolist()]
        if n in (2, 9):
            os.kill(tm._workers()[n % 2], signal.SIGKILL)
    assert sorted(ids) == list(range(80))
    assert tm.summary()["metrics"]["worker_restarts"] == 2


def test_a_persistent_worker_killed_between_epochs_is_replaced():
    loader = fastmm.DataLoader(Augmented(23), batch_size=3, shuffle=True, num_workers=2,
                               persistent_workers=True, on_worker_failure="respawn")
    assert sorted(r[0] for b in loader for r in b.tolist()) == list(range(23))
    os.kill(loader._iterator._workers[0].pid, signal.SIGKILL)  # idle, waiting for an epoch
    time.sleep(0.2)
    assert sorted(r[0] for b in loader for r in b.tolist()) == list(range(23))


CORPUS_SPEC = CorpusSpec(num_images=60, num_videos=0, seed=3, image_short_side=(32, 48),
                         large_fraction=0.0, shard_bytes=40_000)


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_random_kills_count_each_bad_sample_once(corpus, kind):
    """Workers killed at random while a MultimodalDataset skips damaged samples: the keys of
    the fault-free run, and its skip counts (a replacement meets again the bad samples of the
    batches that were lost; its predecessor's counts of them are taken back)."""
    source = "posix" if kind == "map" else "shards"
    keys = fastmm.MultimodalDataset(f"{corpus}/{source}", source=source).source.keys()
    bad = keys[1::5]

    def run(kills):
        data = fastmm.MultimodalDataset(f"{corpus}/{source}", source=source, size=16,
                                        crop="center", decoder=CorruptOn(bad), on_error="skip")
        dataset = data if kind == "map" else fastmm.ShardStream(data, shuffle=False)
        it = iter(fastmm.DataLoader(dataset, batch_size=4, num_workers=2, prefetch_factor=3,
                                    on_worker_failure="respawn"))
        picker, got = random.Random(2), []
        for n, batch in enumerate(it):
            got += batch["key"]
            if n in kills:
                os.kill(it._workers[picker.randrange(2)].pid, signal.SIGKILL)
        return got, data.skipped

    clean = run(set())
    assert clean[1]["corrupt"] >= len(bad)
    assert run({0, 2, 5, 7}) == clean
