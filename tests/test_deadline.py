"""The decode deadline: a sample stuck in native code (here a decoder blocked in C with the GIL
held, which nothing inside its process can interrupt) past ``decode_deadline`` gets its worker
replaced, and the sample is counted with its key by the bad-input policy -- the run yields
exactly what it yields when that sample is plainly corrupt."""

from __future__ import annotations

import ctypes
import pickle
import time
import warnings

import pytest
import torch

import fastmm
from fastmm.bench.mmcorpus import CorpusSpec
from fastmm.config import ConfigError, decode_deadline
from fastmm.dataset import MultimodalDataset
from fastmm.decode import DecodeError
from fastmm.decode.pil import Decoder as PilDecoder
from fastmm import FastmmWarning
from fastmm.sources import SourceError
from fastmm.stream import ShardStream

from _datasets import CorruptOn  # the same keys as plain damage: what a stuck run must match

CORPUS_SPEC = CorpusSpec(num_images=24, num_videos=0, seed=5, image_short_side=(64, 96),
                  large_fraction=0.0, shard_bytes=60_000)
DEADLINE = 1.0


class StuckOn(PilDecoder):
    """The real Pillow decoder, except that the given keys block in C holding the GIL, as a
    decoder looping on hostile bytes would."""

    def __init__(self, keys):
        super().__init__()
        self.keys = set(keys)

    def decode_resized_crop(self, data, plan, *, key="", reduce=False):
        if key in self.keys:
            ctypes.PyDLL(None).sleep(3600)  # PyDLL: the GIL stays held; signals do not help
        return super().decode_resized_crop(data, plan, key=key, reduce=reduce)


def _dataset(corpus, decoder, on_error, source="posix", deadline=DEADLINE):
    root = f"{corpus}/{'shards' if source == 'shards' else 'posix'}"
    return MultimodalDataset(root, source=source, decoder=decoder, size=32, crop="center",
                             on_error=on_error, decode_deadline=deadline)


def _item_keys(data):
    keys = data.source.keys()
    return [keys[i] for i in data._index()]


def _stuck_keys(corpus, n=2):
    keys = _item_keys(_dataset(corpus, PilDecoder(), "raise", deadline=None))
    return [keys[5], keys[17]][:n]


def _keys(loader, epochs=1):
    out = []
    for epoch in range(epochs):
        out.append([k for batch in loader for k in batch["key"]])
        assert all(len(b) == 4 for b in [out[-1][i:i + 4] for i in range(0, len(out[-1]), 4)])
    return out


@pytest.mark.timeout(120)
def test_stuck_sample_is_replaced_like_a_corrupt_one(corpus, transport):
    stuck = _stuck_keys(corpus)
    clean = _dataset(corpus, CorruptOn(stuck), "replace", deadline=None)
    want = _keys(fastmm.DataLoader(clean, batch_size=4, num_workers=2))[0]
    data = _dataset(corpus, StuckOn(stuck), "replace")
    started = time.monotonic()
    got = _keys(fastmm.DataLoader(data, batch_size=4, num_workers=2))[0]
    took = time.monotonic() - started
    assert got == want and not set(stuck) & set(got) and len(got) == CORPUS_SPEC.num_images
    assert data.skipped == {"deadline": 2} and data.replaced == 2
    assert took < 2 * (DEADLINE + 5), took  # one deadline per stuck sample, plus restarts


@pytest.mark.timeout(120)
def test_skip_remembers_expired_samples_across_epochs(corpus):
    """Persistent workers: the second epoch skips the stuck samples at once, no worker killed
    (the expired set is shared memory every worker reads)."""
    stuck = _stuck_keys(corpus)
    data = _dataset(corpus, StuckOn(stuck), "skip")
    loader = fastmm.DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True)
    first = [k for batch in loader for k in batch["key"]]
    pids = [w.pid for w in loader._iterator._workers]
    second = [k for batch in loader for k in batch["key"]]
    assert [w.pid for w in loader._iterator._workers] == pids  # nothing waited on a deadline
    keys = _item_keys(data)
    assert first == second == [k for k in keys if k not in stuck]
    assert data.skipped == {"deadline": 4}  # counted each time met
    assert data.state_dict()["expired"] == sorted(keys.index(k) for k in stuck)


@pytest.mark.timeout(60)
def test_raise_names_the_stuck_key_within_the_deadline(corpus):
    stuck = _stuck_keys(corpus, n=1)
    data = _dataset(corpus, StuckOn(stuck), "raise")
    started = time.monotonic()
    with pytest.raises(DecodeError, match=f"deadline.*{stuck[0]}"):
        for _ in fastmm.DataLoader(data, batch_size=4, num_workers=2):
            pass
    assert time.monotonic() - started < DEADLINE + 10


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_shard_stream_with_a_stuck_sample(corpus):
    """An IterableDataset over the dataset: the replacement worker picks up where the stuck
    one was and the stream stays the one a corrupt sample gives."""
    stuck = _stuck_keys(corpus, n=1)

    def run(decoder, deadline):
        stream = ShardStream(_dataset(corpus, decoder, "skip", "shards", deadline), shuffle=False)
        return [k for b in fastmm.DataLoader(stream, batch_size=4, num_workers=2) for k in b["key"]]

    assert run(StuckOn(stuck), DEADLINE) == run(CorruptOn(stuck), None)


class CorruptThenStuck(PilDecoder):
    """Some keys plainly damaged, others stuck: a replaced worker had counted the damaged ones
    of the batch it was on, and its replacement meets them again."""

    def __init__(self, corrupt, stuck):
        super().__init__()
        self.corrupt, self.stuck = CorruptOn(corrupt), StuckOn(stuck)

    def decode_resized_crop(self, data, plan, *, key="", reduce=False):
        decoder = self.corrupt if key in self.corrupt.keys else self.stuck
        return decoder.decode_resized_crop(data, plan, key=key, reduce=reduce)


@pytest.mark.timeout(120)
def test_a_replaced_worker_counts_each_bad_sample_once(corpus, transport):
    """A damaged sample in the batch a worker was stuck on is counted once, not once by the
    worker and again by its replacement (the loader puts the worker's counts back to its last
    batch received)."""
    keys = _item_keys(_dataset(corpus, PilDecoder(), "raise", deadline=None))
    # batch 1 (items 4-7) goes to worker 1: a damaged item, then a stuck one
    data = _dataset(corpus, CorruptThenStuck([keys[1], keys[4]], [keys[5]]), "skip")
    got = [k for b in fastmm.DataLoader(data, batch_size=4, num_workers=2) for k in b["key"]]
    assert got == [k for k in keys if k not in (keys[1], keys[4], keys[5])]
    assert data.skipped == {"corrupt": 2, "deadline": 1}


@pytest.mark.timeout(120)
def test_a_replaced_stream_worker_counts_each_bad_sample_once(corpus):
    """The same for a ShardStream worker, whose iterator also keeps what it counted (for a
    resumed loader): one damaged sample in a batch it handed out, one in the batch it was stuck
    on."""
    stream = ShardStream(_dataset(corpus, PilDecoder(), "skip", "shards", None), shuffle=False)
    slots, _ = stream.plan(2)
    slot = [i for shard in slots[0] for i in stream.shards[shard]]  # worker 0's, in order
    keys = _item_keys(stream.dataset)
    corrupt, stuck = [keys[slot[1]], keys[slot[5]]], [keys[slot[6]]]

    def run(decoder, deadline):
        data = _dataset(corpus, decoder, "skip", "shards", deadline)
        loader = fastmm.DataLoader(ShardStream(data, shuffle=False), batch_size=4, num_workers=2)
        return [k for b in loader for k in b["key"]], data.skipped

    got, skipped = run(CorruptThenStuck(corrupt, stuck), DEADLINE)
    want, want_skipped = run(CorruptOn(corrupt + stuck), None)
    # counted per read: a slot going round its shards again ("pad") meets them again
    assert got == want and skipped["deadline"] >= 1
    assert sum(skipped.values()) == want_skipped["corrupt"] >= 3


@pytest.mark.timeout(120)
def test_a_concat_dataset_is_held_to_its_datasets_deadlines(corpus):
    """torch's ConcatDataset keeps its datasets as .datasets: the loader finds each one's
    decode deadline and skip counts through it."""
    keys = _item_keys(_dataset(corpus, PilDecoder(), "raise", deadline=None))

    def run(decoder, deadline):
        # "replace": a ConcatDataset has no __getitems__ to skip with
        clean = _dataset(corpus, PilDecoder(), "replace", deadline=deadline)
        bad = _dataset(corpus, decoder, "replace", deadline=deadline)
        loader = fastmm.DataLoader(torch.utils.data.ConcatDataset([clean, bad]), batch_size=4,
                                   num_workers=2)
        return [k for b in loader for k in b["key"]], clean.skipped, bad.skipped, bad.replaced

    got, clean, bad, replaced = run(CorruptThenStuck([keys[4]], [keys[5]]), DEADLINE)
    want, _, want_bad, want_replaced = run(CorruptOn([keys[4], keys[5]]), None)
    assert got == want and got[:24] == keys and not {keys[4], keys[5]} & set(got[24:])
    assert clean == {} and bad["deadline"] >= 1 and replaced == want_replaced
    assert sum(bad.values()) == want_bad["corrupt"] == 2  # each bad sample once


class PlainStream(torch.utils.data.IterableDataset):
    """A user's stream over the dataset that keeps no state: a replaced worker pulls and drops
    what its predecessor had sent, meeting the bad samples among them again."""

    def __init__(self, dataset):
        self.dataset = dataset  # the name a loader looks for the decode deadline's watch under

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(info.id, len(self.dataset), info.num_workers):
            item = self.dataset[i]
            if item is not None:
                yield item


@pytest.mark.timeout(120)
def test_a_replaced_worker_that_pulls_and_drops_counts_each_bad_sample_once(corpus):
    keys = _item_keys(_dataset(corpus, PilDecoder(), "raise", deadline=None))
    # worker 0 takes items 0, 2, 4, ...: a damaged one in its first batch, a stuck one in its second
    corrupt, stuck = [keys[2]], [keys[12]]

    def run(decoder, deadline):
        data = _dataset(corpus, decoder, "skip", deadline=deadline)
        loader = fastmm.DataLoader(PlainStream(data), batch_size=4, num_workers=2)
        return [k for b in loader for k in b["key"]], data.skipped

    got, skipped = run(CorruptThenStuck(corrupt, stuck), DEADLINE)
    assert skipped == {"corrupt": 1, "deadline": 1}
    assert got == run(CorruptOn(corrupt + stuck), None)[0]


def test_without_worker_processes_the_deadline_warns(corpus):
    data = _dataset(corpus, PilDecoder(), "raise")
    with pytest.warns(FastmmWarning, match="num_workers > 0"):
        batch = next(iter(fastmm.DataLoader(data, batch_size=4)))
    assert batch["image"].shape == (4, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        next(iter(fastmm.DataLoader(_dataset(corpus, PilDecoder(), "raise"), batch_size=4,
                                    num_workers=1)))


def test_deadline_from_argument_and_environment(monkeypatch):
    monkeypatch.delenv("FASTMM_DECODE_DEADLINE", raising=False)
    assert decode_deadline(None) is None and decode_deadline(0) is None
    assert decode_deadline(2.5) == 2.5
    monkeypatch.setenv("FASTMM_DECODE_DEADLINE", "30")
    assert decode_deadline(None) == 30.0 and decode_deadline(4) == 4.0
    for bad in ("soon", "-1", "inf", "nan"):
        monkeypatch.setenv("FASTMM_DECODE_DEADLINE", bad)
        with pytest.raises(ConfigError, match="FASTMM_DECODE_DEADLINE"):
            decode_deadline(None)
    with pytest.raises(ValueError, match="decode_deadline"):
        decode_deadline(-3)


@pytest.mark.filterwarnings("ignore::fastmm.FastmmWarning")  # used without a loader
def test_expired_samples_travel_in_the_state_dict(corpus):
    data = _dataset(corpus, PilDecoder(), "skip")
    data.fastmm_decode_deadline.expire(3, None)
    again = _dataset(corpus, PilDecoder(), "skip")
    again.load_state_dict(data.state_dict())
    assert again[3] is None and again.skipped == {"deadline": 1}
    assert isinstance(again[4]["image"], torch.Tensor)


@pytest.mark.parametrize("loader_class", [torch.utils.data.DataLoader, fastmm.DataLoader])
def test_worker_errors_keep_their_type_and_fields(corpus, loader_class):
    """torch's DataLoader re-raises a worker's error as type(traceback text): ours rebuild
    reason and key from it (before, DecodeError's signature made that a RuntimeError)."""
    stuck = _stuck_keys(corpus, n=1)
    data = _dataset(corpus, CorruptOn(stuck), "raise", deadline=None)
    it = iter(loader_class(data, batch_size=4, num_workers=1))
    try:
        with pytest.raises(DecodeError, match="Caught DecodeError in DataLoader worker") as caught:
            for _ in it:
                pass
    finally:  # not left to the collector: torch's would wait 5 s for its worker in a later test
        it._shutdown_workers()
    assert (caught.value.reason, caught.value.key) == ("corrupt", stuck[0])
    origins = {s.key: s.origin for s in map(data.source.read, data._index())}
    assert caught.value.origin == origins[stuck[0]] != ""


@pytest.mark.parametrize("key", ["a'b", "paren (key='x', origin='y')", 'q"(key=\'x\', origin=\'\')'])
def test_sample_error_fields_survive_text_and_pickle(key):
    """A worker's error comes back as its text (torch) or pickled: reason, key and origin are
    read back whole, even from a key that looks like the fields, and a message of many lines."""
    error = SourceError("truncated", key, "/s (key='z').tar:512", "cut\nhere")
    text = f"Caught SourceError ...\nfastmm.sources.base.SourceError: {error}\n"
    for back in (SourceError(text), pickle.loads(pickle.dumps(error))):
        assert (back.reason, back.key, back.origin) == ("truncated", key, "/s (key='z').tar:512")
    assert str(SourceError(text)) == text and "\n" not in str(error)
    decode = DecodeError("corrupt", key, "bad")
    decode.origin = "f.jpg"  # the dataset names where the bytes came from
    assert pickle.loads(pickle.dumps(decode)).origin == "f.jpg" and "'f.jpg'" in str(decode)


@pytest.mark.timeout(60)
def test_too_many_expired_samples_is_an_error_not_a_loop(corpus):
    """Past DecodeDeadline.CAP remembered samples, one more could not be remembered: tried again,
    it would stick again, forever; so the loop stops with an error."""
    data = _dataset(corpus, StuckOn(_stuck_keys(corpus)), "skip")
    data.fastmm_decode_deadline.CAP = 1
    with pytest.raises(RuntimeError, match="more than 1 samples took over decode_deadline"):
        for _ in fastmm.DataLoader(data, batch_size=4, num_workers=2):
            pass


def test_a_dataset_offering_the_deadline_under_its_older_name_gets_it_enforced():
    """``fastmm_sample_watch`` / ``SampleWatch`` (the names before 0.1's rename) still reach the
    loader, once each, beside the new ``fastmm_decode_deadline``."""
    from fastmm import offers
    from fastmm.dataset import DecodeDeadline, SampleWatch

    class Old(torch.utils.data.Dataset):
        def __init__(self):
            self.fastmm_sample_watch = SampleWatch(1.0)

        def __len__(self):
            return 1

    class Both(Old):
        def __init__(self):
            super().__init__()
            self.fastmm_decode_deadline = self.fastmm_sample_watch

    old, both = Old(), Both()
    assert SampleWatch is DecodeDeadline
    assert offers.decode_deadlines(old) == [old.fastmm_sample_watch]
    assert offers.decode_deadlines(both) == [both.fastmm_decode_deadline]
    other = Both()
    found = offers.decode_deadlines(torch.utils.data.ConcatDataset([old, other]))
    expected = [old.fastmm_sample_watch, other.fastmm_decode_deadline]
    assert sorted(map(id, found)) == sorted(map(id, expected))
