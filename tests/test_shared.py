"""A dataset's large Python containers, shared read-only with the workers (fastmm/shared.py):
what a worker reads equals the original, under fork, spawn and forkserver, the main process's
objects stay as they were, a dataset that changes its list still works, and it can be off."""

from __future__ import annotations

import gc
import json
import math
import os
import pickle
import sys

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fastmm  # noqa: E402
from fastmm.shared import MIN_ITEMS, DatasetShare, SharedDict, SharedList, SharedTuple  # noqa: E402

N = 3 * MIN_ITEMS


def _same(a, b) -> None:
    """``a`` is ``b``'s value with its type, all the way down (NaN equal to NaN)."""
    assert type(a) is type(b), (a, b)
    if type(a) in (list, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif type(a) is dict:
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif type(a) is float and math.isnan(b):
        assert math.isnan(a)
    else:
        assert a == b and (type(a) is not float or math.copysign(1, a) == math.copysign(1, b))


class Holder:
    """A dataset-like object whose attribute ``value`` is the container under test."""

    def __init__(self, value):
        self.value = value


def _shared(value, min_items: int = 1):
    """``value`` through a share built from it: its proxy, and the share (to close)."""
    share = DatasetShare.build(Holder(value), min_items=min_items)
    assert share.shared, "not shared"
    proxy = share.proxies(share._buf)[id(value)]
    assert type(proxy) is {list: SharedList, tuple: SharedTuple, dict: SharedDict}[type(value)]
    return proxy, share


_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=20)
_scalar = st.one_of(_text, st.binary(max_size=20), st.integers(), st.integers(-2**63, 2**63 - 1),
                    st.floats(allow_nan=True), st.booleans(), st.none())
_hashable = st.recursive(st.one_of(_text, st.binary(max_size=8), st.integers(), st.booleans(),
                                   st.none(), st.floats(allow_nan=False)),
                         lambda inner: st.tuples(inner, inner), max_leaves=4)
_value = st.recursive(_scalar, lambda inner: st.one_of(
    st.tuples(inner, inner), st.lists(inner, max_size=3),
    st.dictionaries(_hashable, inner, max_size=3)), max_leaves=8)


@settings(max_examples=100, deadline=None)
@given(items=st.lists(_value, min_size=1, max_size=30))
def test_what_a_worker_reads_equals_the_original(items):
    """Every supported type, alone or mixed, nested, empty strings, huge ints, NaN and -0.0:
    indexing, iteration and slices give the original's items with their types."""
    for container in (items, tuple(items)):
        proxy, share = _shared(container)
        _same(list(proxy), list(container))
        _same(proxy[0], container[0])
        _same(proxy[-1], container[-1])
        _same(list(proxy[1::2]), list(container[1::2]))
        assert len(proxy) == len(container)
        del proxy
        share.close()


@settings(max_examples=60, deadline=None)
@given(table=st.dictionaries(_hashable, _value, min_size=1, max_size=30))
def test_a_shared_dict_looks_up_every_key_as_the_original(table):
    proxy, share = _shared(table)
    _same(dict(proxy.items()), table)
    assert list(proxy) == list(table)  # its order
    for key, value in table.items():
        _same(proxy[key], value)
        assert key in proxy
    del proxy
    share.close()


@settings(max_examples=100, deadline=None)
@given(column=st.one_of(st.lists(_text, min_size=1), st.lists(st.integers(), min_size=1),
                        st.lists(st.tuples(_text, st.integers()), min_size=1),
                        st.lists(st.floats(), min_size=1), st.lists(st.booleans(), min_size=1)))
def test_homogeneous_columns_round_trip(column):
    """The column kinds a dataset's index uses most (paths, labels, (path, class) pairs)."""
    proxy, share = _shared(column)
    _same(list(proxy), column)
    del proxy
    share.close()


_surrogate = st.tuples(_text, st.integers(0xD800, 0xDFFF), _text).map(
    lambda t: t[0] + chr(t[1]) + t[2])


@settings(max_examples=30, deadline=None)
@given(text=_surrogate, where=st.sampled_from(["item", "pair", "mixed", "key"]))
def test_a_lone_surrogate_leaves_the_container_unshared_and_says_why(text, where):
    """A str with a lone surrogate has no UTF-8 form: its container stays as it is, said why,
    whether it is an item, in a (path, class) pair, among other types or a dict's key."""
    value = {"item": ["plain"] * 5 + [text], "pair": [("p", 1)] * 5 + [(text, 2)],
             "mixed": [1, None, (text,)], "key": {"k": 1, text: 2}}[where]
    holder = Holder(value)
    assert DatasetShare.build(holder, min_items=1).shared == []
    holder.other = list(range(10))
    share = DatasetShare.build(holder, min_items=1)
    assert [s.where for s in share.shared] == ["dataset.other"]
    assert [(n.where, n.why) for n in share.not_shared] == [
        ("dataset.value", "it holds a str with a lone surrogate")]
    assert "it holds a str with a lone surrogate" in share.describe()
    share.close()


def test_lists_behave_as_lists():
    original = [f"p{i}" for i in range(10)]
    proxy, share = _shared(original)
    assert "p3" in proxy and "q" not in proxy and proxy.index("p4") == 4
    assert proxy.count("p1") == 1 and list(reversed(proxy)) == original[::-1]
    assert proxy == original and proxy[2:5] == original[2:5] and proxy[True] == "p1"
    assert proxy[torch.tensor(3)] == "p3"  # an index with __index__, as a list takes
    for bad, error, words in ((10, IndexError, "list index out of range"),
                              (-11, IndexError, "list index out of range"),
                              ("1", TypeError, "list indices must be integers or slices, not str"),
                              (1.0, TypeError, "not float")):
        with pytest.raises(error, match=words):
            proxy[bad]
        with pytest.raises(error, match=words):
            original[bad]
    assert pickle.loads(pickle.dumps(proxy)) == original
    assert type(pickle.loads(pickle.dumps(proxy))) is list
    del proxy
    share.close()


@pytest.mark.parametrize("plain", [list, tuple])
def test_concatenation_repetition_and_ordering_as_on_the_plain_container(plain):
    original = plain(f"p{i}" for i in range(10))
    proxy, share = _shared(original)
    other = plain(["p0", "z"])
    assert proxy + other == original + other and other + proxy == other + original
    assert proxy + proxy == original + original and type(proxy + other) is plain
    assert proxy * 2 == original * 2 and 2 * proxy == 2 * original and proxy * 0 == plain()
    assert (proxy < other, proxy <= other, proxy > other, proxy >= other) == (
        original < other, original <= other, original > other, original >= other)
    assert proxy <= original and proxy >= original and not proxy < original
    assert sorted([other, proxy]) == sorted([other, original])
    assert f"{proxy!r}" == repr(original) and json.dumps(list(proxy)) == json.dumps(list(original))
    for wrong in ({"a"}, "p", 1, ([], ())[plain is list]):
        with pytest.raises(TypeError):
            proxy + wrong
        with pytest.raises(TypeError):
            original + wrong
        with pytest.raises(TypeError):
            proxy < wrong
    if plain is list:
        proxy *= 2  # the worker's own list from then on, the original untouched
        proxy += ["end"]
        assert proxy == original * 2 + ["end"] and len(original) == 10
    del proxy
    share.close()


def test_a_worker_that_changes_a_shared_list_or_dict_gets_its_own_copy():
    items = list(range(20))
    proxy, share = _shared(items)
    proxy.append(20)
    proxy[0] = -1
    proxy.sort(reverse=True)
    assert proxy == sorted([-1, *range(1, 21)], reverse=True)
    assert items == list(range(20))  # the original is untouched
    table = {f"k{i}": i for i in range(20)}
    shared_table, share2 = _shared(table)
    shared_table["new"] = 1
    del shared_table["k0"]
    assert "k0" not in shared_table and shared_table["new"] == 1 and len(shared_table) == 20
    assert "k0" in table and "new" not in table
    del proxy, shared_table
    share.close()
    share2.close()


def test_dict_keys_equal_across_numeric_types_find_each_other():
    """As in a dict: 1, 1.0 and True are one key; a missing key is a KeyError, an unhashable
    one a TypeError."""
    table = {1: "one", 2.5: "two and a half", "1": "text", b"1": "bytes", ("a", 1): "pair",
             None: "none"}
    proxy, share = _shared(table)
    for key in (1, 1.0, True, 2.5, "1", b"1", ("a", 1), ("a", True), None):
        assert proxy[key] == table[key]
    with pytest.raises(KeyError):
        proxy[3]
    with pytest.raises(TypeError, match="unhashable"):
        proxy[[1]]
    assert proxy.get("missing", 7) == 7
    del proxy
    share.close()


class Paths(torch.utils.data.Dataset):
    """A dataset whose index is plain Python lists (paths, labels, (path, class) pairs)."""

    def __init__(self, n: int = N):
        self.paths = [f"/data/train/{i % 1000:04d}/{i:08d}.jpg" for i in range(n)]
        self.labels = [i % 1000 for i in range(n)]
        self.samples = list(zip(self.paths, self.labels))
        self.by_path = dict(zip(self.paths, range(n)))

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        path, label = self.samples[i]
        assert self.paths[i] == path and self.labels[i] == label and self.by_path[path] == i
        kinds = "".join(type(getattr(self, name)).__name__[0] for name in
                        ("paths", "labels", "samples", "by_path"))
        return {"path": path, "label": label, "kinds": kinds}


class Changes(Paths):
    """A dataset that changes its own list as it reads (a cache of what it has seen)."""

    def __getitem__(self, i):
        self.labels[i] = -self.labels[i] - 1
        self.paths.append("seen")
        return {"label": self.labels[i], "seen": self.paths.count("seen")}


def _epoch(loader) -> list:
    return [sample for batch in loader for sample in zip(*batch.values())]


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow),
                                    pytest.param("forkserver", marks=pytest.mark.slow)])
def test_workers_read_the_shared_copy_and_give_torchs_samples(method):
    dataset = Paths()
    before = {name: (id(getattr(dataset, name)), sys.getrefcount(getattr(dataset, name)))
              for name in ("paths", "labels", "samples", "by_path")}
    expected = _epoch(torch.utils.data.DataLoader(dataset, batch_size=256, shuffle=True,
                                                  generator=torch.Generator().manual_seed(1)))
    got = _epoch(fastmm.DataLoader(dataset, batch_size=256, shuffle=True, num_workers=2,
                                   multiprocessing_context=method,
                                   generator=torch.Generator().manual_seed(1)))
    assert [(p, label) for p, label, _ in got] == [(p, label) for p, label, _ in expected]
    assert {kinds for _, _, kinds in got} == {"SSSS"}  # SharedList x3, SharedDict
    assert {kinds for _, _, kinds in expected} == {"llld"}
    gc.collect()  # the iterator, and the share that named the originals, are gone
    after = {name: (id(getattr(dataset, name)), sys.getrefcount(getattr(dataset, name)))
             for name in ("paths", "labels", "samples", "by_path")}
    assert after == before  # the main process's objects, as they were


def test_a_dataset_that_changes_its_list_in_a_worker_still_works():
    dataset = Changes(MIN_ITEMS * 2)
    expected = _epoch(torch.utils.data.DataLoader(dataset, batch_size=64, num_workers=2))
    got = _epoch(fastmm.DataLoader(dataset, batch_size=64, num_workers=2))
    assert got == expected
    assert dataset.labels[:3] == [0, 1, 2] and "seen" not in dataset.paths[-3:]


@pytest.mark.parametrize("off", ["env", "argument"])
def test_sharing_can_be_turned_off(off, monkeypatch):
    transport = None
    if off == "env":
        monkeypatch.setenv("FASTMM_SHARE_DATASET", "0")
    else:
        transport = fastmm.TransportConfig(share_dataset=False)
    got = _epoch(fastmm.DataLoader(Paths(), batch_size=512, num_workers=2, transport=transport))
    assert {kinds for _, _, kinds in got} == {"llld"}


def test_small_containers_and_other_types_are_left_alone():
    class Labels(int):
        pass

    holder = Holder([Labels(1)] * N)
    holder.small = list(range(MIN_ITEMS - 1))
    holder.array = torch.arange(N)
    share = DatasetShare.build(holder)
    assert share.shared == [] and [n.where for n in share.not_shared] == ["dataset.value"]
    assert "it holds a test_shared.test_small_containers_and_other_types_are_left_alone" \
           ".<locals>.Labels" in share.describe()
    share = DatasetShare.build(Holder([1] * N))
    assert share.not_shared == [] and share.shared[0].items == N
    share.close()


def test_wrapped_datasets_share_too_and_an_alias_is_shared_once():
    inner = Paths()
    inner.imgs = inner.samples  # torchvision's ImageFolder keeps one list under two names
    wrapped = torch.utils.data.ConcatDataset([torch.utils.data.Subset(inner, list(range(N))),
                                              Paths(MIN_ITEMS)])
    share = DatasetShare.build(wrapped)
    wheres = [s.where for s in share.shared]
    assert "dataset.datasets[0].indices" in wheres
    assert "dataset.datasets[0].dataset.samples" in wheres
    assert not any(w.endswith(".imgs") for w in wheres)  # one copy for both names
    placed = {(name, s.where) for _, name, _, s in share.placements}
    assert ("imgs", "dataset.datasets[0].dataset.samples") in placed
    assert share.python_bytes > share.size
    share.close()


def test_no_file_or_mapping_is_left_after_the_loader_ends():
    def maps() -> int:
        with open(f"/proc/{os.getpid()}/maps") as f:
            return sum("fastmm-dataset" in line for line in f)

    def fds() -> int:
        return sum("fastmm-dataset" in os.readlink(f"/proc/self/fd/{fd}")
                   for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))

    loader = fastmm.DataLoader(Paths(), batch_size=512, num_workers=2)
    it = iter(loader)
    next(it)
    assert maps() == 1 and fds() == 2  # the buffer's descriptor, and the mapping's own
    del it
    gc.collect()
    assert maps() == 1 and fds() == 2  # kept with the loader, for its next epoch
    del loader
    gc.collect()
    assert maps() == 0 and fds() == 0


class Rows(torch.utils.data.Dataset):
    """An index of [path, label] lists: a change inside one is out of sight of a copy of the
    outer list's references."""

    def __init__(self, n: int = N):
        self.rows = [[f"/data/{i:08d}.jpg", i] for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i][0]


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_an_epoch_starts_from_the_last_share_only_while_the_dataset_holds_the_same(method):
    """Without persistent workers each epoch starts workers anew: the share built for the last
    one serves again while the dataset's containers are the same objects holding the same
    items; a change in the main process between epochs is built again and read by the
    workers."""
    dataset = Paths()
    loader = fastmm.DataLoader(dataset, batch_size=512, num_workers=2,
                               multiprocessing_context=method)
    _epoch(loader)
    first = loader._dataset_share
    assert len(first.shared) == 4
    _epoch(loader)
    assert loader._dataset_share is first
    dataset.labels[3] = 7  # in place: the same list object
    dataset.samples[3] = (dataset.paths[3], 7)
    got = {path: label for path, label, _ in _epoch(loader)}
    assert loader._dataset_share is not first and got[dataset.paths[3]] == 7
    second = loader._dataset_share
    dataset.by_path = dict(dataset.by_path)  # a new object, equal to the old
    _epoch(loader)
    assert loader._dataset_share is not second
    rows = Rows()
    loader = fastmm.DataLoader(rows, batch_size=512, num_workers=2,
                               multiprocessing_context=method)
    list(loader)
    first = loader._dataset_share
    rows.rows[5][0] = "changed"  # inside an item: built again every epoch for this
    assert "changed" in [path for batch in loader for path in batch]
    assert loader._dataset_share is not first


def test_a_dataset_watched_by_telemetry_is_shared_too():
    """Telemetry wraps the dataset to time it; the containers of the one it wraps are shared."""
    from fastmm.telemetry import Telemetry

    tm = Telemetry()
    got = _epoch(tm.watch(fastmm.DataLoader(Paths(), batch_size=512, num_workers=2)))
    assert {kinds for _, _, kinds in got} == {"SSSS"}


def test_a_loader_still_pickles_after_an_epoch_as_torchs_does():
    """The buffer is this process's: a pickled loader leaves it out and builds its own."""
    loader = fastmm.DataLoader(Paths(), batch_size=512, num_workers=2)
    expected = _epoch(loader)
    assert loader._dataset_share is not None
    copy = pickle.loads(pickle.dumps(loader))
    assert copy._dataset_share is None and _epoch(copy) == expected
