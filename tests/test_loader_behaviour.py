"""Behaviours of fastmm.DataLoader with exact expectations, most of them taken from what
torch.utils.data.DataLoader does with the same arguments; each runs on both slab transports
(the ``transport`` fixture) where the transport can matter."""

from __future__ import annotations

import gc
import inspect
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import tempfile
import time
import typing
import warnings

import numpy as np
import psutil
import pytest
import torch
import torch.utils.data
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torch.utils.data._utils.worker import _generate_state

import fastmm
from _processes import live_children, wait_for_children_to_go
from _datasets import (
    BrokenIterable,
    CustomError,
    ExitingDataset,
    FailingDataset,
    FullDataset,
    MismatchDataset,
    PidDataset,
    RangeIterable,
    SampleDataset,
    SizedRangeIterable,
    SizesBatchSampler,
    SleepyDataset,
    StartingDataset,
    SuicideDataset,
    WorkerInfoDataset,
    assert_same,
    collate_alias,
    collate_raises,
    fail_init,
    record_init_state,
)

TorchDataLoader = torch.utils.data.DataLoader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def shutdown_iter(it) -> None:
    """Stop an iterator's workers now. Deleting the last reference does the same, but an
    iterator that raised sits in a reference cycle (exception -> traceback -> frame) until
    the cyclic GC runs, and torch's shutdown from there waits for its join timeouts."""
    if hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def shutdown(loader) -> None:
    """Stop a loader's persistent workers now (what deleting the last reference does)."""
    it = getattr(loader, "_iterator", None)
    if it is not None:
        shutdown_iter(it)


def outcome(fn):
    """('ok', result) or (exception type, message) of calling fn()."""
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - comparing whatever torch raises
        return (type(exc), str(exc))


# --------------------------------------------------------------------------------------------
# Class, signature, argument validation, len()
# --------------------------------------------------------------------------------------------


def test_is_a_torch_dataloader():
    loader = fastmm.DataLoader(SampleDataset(4), batch_size=2, num_workers=2)
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert issubclass(fastmm.DataLoader, torch.utils.data.DataLoader)
    assert fastmm.get_worker_info is torch.utils.data.get_worker_info


def test_subscripts_as_a_generic_like_torch():
    """``DataLoader[T]`` in an annotation evaluated at run time (torch's test_typing): torch's
    DataLoader is Generic[T_co], so a subclass that does not pass the parameter on raised
    TypeError "... is not a generic class"."""
    assert fastmm.DataLoader.__parameters__ == TorchDataLoader.__parameters__
    alias = fastmm.DataLoader[list[torch.Tensor]]
    assert typing.get_origin(alias) is fastmm.DataLoader
    assert typing.get_args(alias) == typing.get_args(TorchDataLoader[list[torch.Tensor]])


def test_signature_is_torch_plus_torchdatas_argument_on_worker_failure_and_transport():
    extras = {"snapshot_every_n_steps": 1, "on_worker_failure": "raise", "transport": None,
              "cpu_budget": None}
    for ours, theirs in ((fastmm.DataLoader, TorchDataLoader),
                         (fastmm.DataLoader.__init__, TorchDataLoader.__init__)):
        ours, theirs = inspect.signature(ours), inspect.signature(theirs)
        for name, default in extras.items():
            extra = ours.parameters[name]
            assert extra.kind == extra.KEYWORD_ONLY and extra.default == default
        params = [p for name, p in ours.parameters.items() if name not in extras]
        assert ours.replace(parameters=params) == theirs


def test_transport_given_to_the_loader_is_used_instead_of_the_environment(monkeypatch):
    """``transport=fastmm.TransportConfig(...)`` sets what only FASTMM_* could: with it the
    variables are not read (a bad one is no error), without it they are (a bad one is)."""
    monkeypatch.setenv("FASTMM_SLAB_MEMORY", "bogus")
    with pytest.raises(fastmm.ConfigError, match="FASTMM_SLAB_MEMORY"):
        next(iter(fastmm.DataLoader(SampleDataset(8), batch_size=2, num_workers=1)))
    transport = fastmm.TransportConfig(slab_memory="lean")
    loader = fastmm.DataLoader(SampleDataset(8), batch_size=2, num_workers=2,
                               transport=transport)
    expected = list(TorchDataLoader(SampleDataset(8), batch_size=2))
    assert_same(list(loader), expected)
    with pytest.raises(TypeError, match="transport should be a fastmm.TransportConfig"):
        fastmm.DataLoader(SampleDataset(8), transport={"slab_memory": "lean"})


@pytest.mark.parametrize("argument", ["num_workers", "prefetch_factor"])
@pytest.mark.parametrize("value", [2.5, 2.0, "2"])
def test_a_count_that_is_no_integer_is_a_type_error_naming_it(argument, value):
    """torch takes num_workers=2.5 and fails at iter() with "'float' object cannot be
    interpreted as an integer"; fastmm raises the same type at once, naming the argument."""
    arguments = {"num_workers": 2, argument: value}

    def first(cls):
        shutdown_iter(iter(cls(SampleDataset(4), **arguments)))

    assert outcome(lambda: first(TorchDataLoader))[0] is TypeError
    with pytest.raises(TypeError, match=f"{argument} should be an integer, but got "
                                        f"{argument}={value!r}"):
        fastmm.DataLoader(SampleDataset(4), **arguments)
    assert fastmm.DataLoader(SampleDataset(4), num_workers=np.int64(2)).num_workers == 2


def test_torchs_multi_process_iterator_code_is_not_reachable_on_ours(transport):
    """fastmm's iterator is a _MultiProcessingDataLoaderIter for isinstance() only: each
    method of torch's class is fastmm's own or refused (torch may add some); from
    _BaseDataLoaderIter it takes the iterator protocol and nothing it did not decide on."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter, _MultiProcessingDataLoaderIter

    from fastmm.loader import _SlabDataLoaderIter

    own = {name for part in _SlabDataLoaderIter.__mro__ if part.__module__ == "fastmm.loader"
           for name in vars(part)}
    assert all(name in own for name, value in vars(_MultiProcessingDataLoaderIter).items()
               if callable(value))
    inherited = {name for name, value in vars(_BaseDataLoaderIter).items()
                 if callable(value) and name not in own}
    assert inherited == {"__iter__", "__next__", "__len__", "_next_index", "__getstate__"}
    it = iter(fastmm.DataLoader(SampleDataset(8), batch_size=2, num_workers=2,
                                persistent_workers=True))
    assert isinstance(it, _MultiProcessingDataLoaderIter) and len(list(it)) == 4
    fenced = [name for name in vars(_MultiProcessingDataLoaderIter)
              if getattr(vars(_SlabDataLoaderIter).get(name), "__qualname__", "")
              .startswith("_not_ours")]  # e.g. _register_persistent_workers_atexit
    for name in fenced:
        with pytest.raises(NotImplementedError, match="torch's multi-process iterator's"):
            getattr(it, name)()
    shutdown_iter(it)


def test_positional_arguments_bind_like_torch():
    args = (SampleDataset(10), 3, False, None, None, 2, None, False, True, 4.0)
    ours, theirs = fastmm.DataLoader(*args), TorchDataLoader(*args)
    for name in (
        "batch_size",
        "num_workers",
        "collate_fn",
        "pin_memory",
        "drop_last",
        "timeout",
        "worker_init_fn",
        "multiprocessing_context",
        "generator",
        "prefetch_factor",
        "persistent_workers",
        "pin_memory_device",
        "in_order",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert type(ours.sampler) is type(theirs.sampler)
    assert type(ours.batch_sampler) is type(theirs.batch_sampler)


class _Iterable(IterableDataset):
    def __iter__(self):
        return iter(range(4))


BAD_ARGUMENTS = {
    "num_workers_negative": lambda: dict(dataset=SampleDataset(4), num_workers=-1),
    "timeout_negative": lambda: dict(dataset=SampleDataset(4), timeout=-1),
    "prefetch_without_workers": lambda: dict(dataset=SampleDataset(4), prefetch_factor=2),
    "prefetch_negative": lambda: dict(dataset=SampleDataset(4), num_workers=2, prefetch_factor=-1),
    "persistent_without_workers": lambda: dict(dataset=SampleDataset(4), persistent_workers=True),
    "batch_sampler_and_batch_size": lambda: dict(dataset=SampleDataset(4), batch_sampler=[[0, 1]], batch_size=2),
    "batch_sampler_and_shuffle": lambda: dict(dataset=SampleDataset(4), batch_sampler=[[0, 1]], shuffle=True),
    "batch_sampler_and_sampler": lambda: dict(dataset=SampleDataset(4), batch_sampler=[[0, 1]], sampler=[0, 1]),
    "batch_sampler_and_drop_last": lambda: dict(dataset=SampleDataset(4), batch_sampler=[[0, 1]], drop_last=True),
    "sampler_and_shuffle": lambda: dict(dataset=SampleDataset(4), sampler=[0, 1], shuffle=True),
    "no_batch_and_drop_last": lambda: dict(dataset=SampleDataset(4), batch_size=None, drop_last=True),
    "batch_size_zero": lambda: dict(dataset=SampleDataset(4), batch_size=0),
    "batch_size_float": lambda: dict(dataset=SampleDataset(4), batch_size=1.5),
    "drop_last_not_bool": lambda: dict(dataset=SampleDataset(4), batch_size=2, drop_last="yes"),
    "iterable_and_shuffle": lambda: dict(dataset=_Iterable(), shuffle=True),
    "iterable_and_sampler": lambda: dict(dataset=_Iterable(), sampler=[0, 1]),
    "iterable_and_batch_sampler": lambda: dict(dataset=_Iterable(), batch_sampler=[[0, 1]]),
    "context_unknown_name": lambda: dict(dataset=SampleDataset(4), num_workers=2, multiprocessing_context="bogus"),
    "context_wrong_type": lambda: dict(dataset=SampleDataset(4), num_workers=2, multiprocessing_context=5),
    "context_without_workers": lambda: dict(dataset=SampleDataset(4), multiprocessing_context="spawn"),
}


@pytest.mark.parametrize("name", list(BAD_ARGUMENTS))
def test_argument_errors_equal_torch(name):
    expected = outcome(lambda: TorchDataLoader(**BAD_ARGUMENTS[name]()))
    actual = outcome(lambda: fastmm.DataLoader(**BAD_ARGUMENTS[name]()))
    assert expected[0] is not "ok", f"torch accepted {name}; the case is wrong"  # noqa: F632
    assert actual == expected


@pytest.mark.parametrize("attribute", ["batch_size", "sampler", "batch_sampler", "drop_last", "dataset"])
def test_setting_attributes_after_init_errors_like_torch(attribute):
    def set_it(cls):
        loader = cls(SampleDataset(4), batch_size=2, num_workers=2)
        setattr(loader, attribute, None)

    assert outcome(lambda: set_it(fastmm.DataLoader)) == outcome(lambda: set_it(TorchDataLoader))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # torch's own __del__
def test_prefetch_factor_zero_fails_at_iter_like_torch(transport):
    """torch accepts prefetch_factor=0 in the constructor and fails when iterating."""

    def first(cls):
        it = iter(cls(SampleDataset(4), num_workers=2, prefetch_factor=0))
        shutdown_iter(it)

    expected = outcome(lambda: first(TorchDataLoader))
    assert expected[0] is AssertionError
    assert outcome(lambda: first(fastmm.DataLoader)) == expected


LEN_CASES = {
    "bs3": lambda: dict(dataset=SampleDataset(10), batch_size=3),
    "bs3_drop_last": lambda: dict(dataset=SampleDataset(10), batch_size=3, drop_last=True),
    "bs_none": lambda: dict(dataset=SampleDataset(10), batch_size=None),
    "sampler_list": lambda: dict(dataset=SampleDataset(10), batch_size=4, sampler=[1, 2, 3, 4, 5]),
    "batch_sampler": lambda: dict(dataset=SampleDataset(10), batch_sampler=[[0], [1, 2], [3]]),
    "iterable_sized_bs4": lambda: dict(dataset=SizedRangeIterable(10), batch_size=4),
    "iterable_sized_bs4_drop_last": lambda: dict(dataset=SizedRangeIterable(10), batch_size=4, drop_last=True),
}


@pytest.mark.parametrize("name", list(LEN_CASES))
def test_len_equals_torch(name, transport):
    kwargs = LEN_CASES[name]()
    ours = fastmm.DataLoader(num_workers=2, **kwargs)
    theirs = TorchDataLoader(num_workers=2, **LEN_CASES[name]())
    assert len(ours) == len(theirs)
    ours_it, theirs_it = iter(ours), iter(theirs)
    assert outcome(lambda: len(ours_it)) == outcome(lambda: len(theirs_it))
    shutdown_iter(ours_it)
    shutdown_iter(theirs_it)


def test_len_of_unsized_iterable_raises_like_torch():
    assert outcome(lambda: len(fastmm.DataLoader(_Iterable(), num_workers=2))) == outcome(
        lambda: len(TorchDataLoader(_Iterable(), num_workers=2))
    )


def test_iterable_length_warning_like_torch(transport):
    """An IterableDataset reports len 6 but (unsharded, 2 workers) yields 12 samples: torch warns."""

    def run(cls):
        loader = cls(SizedRangeIterable(6, shard="none"), batch_size=None, num_workers=2)
        assert len(loader) == 6
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = list(loader)
        messages = [str(w.message) for w in caught if "Length of IterableDataset" in str(w.message)]
        return len(out), len(messages), [m.split(" was reported")[1] for m in messages]

    assert run(fastmm.DataLoader) == run(TorchDataLoader)


# --------------------------------------------------------------------------------------------
# Worker info and seeding
# --------------------------------------------------------------------------------------------


def _worker_reports(cls, **kwargs):
    loader = cls(
        WorkerInfoDataset(9),
        batch_size=None,
        num_workers=3,
        worker_init_fn=record_init_state,
        generator=gen(123),
        **kwargs,
    )
    out = list(loader)
    for r in out:
        r.pop("pid")
    return out


def test_get_worker_info_equals_torch(transport):
    expected = _worker_reports(TorchDataLoader)
    actual = _worker_reports(fastmm.DataLoader)
    assert_same(actual, expected)
    assert get_worker_info() is None  # never set in the main process


def test_worker_info_and_seeds_follow_torch_rules(transport):
    base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=gen(123)).item())
    reports = _worker_reports(fastmm.DataLoader)
    assert [r["id"] for r in reports] == [0, 1, 2] * 3
    for r in reports:
        wid = r["id"]
        seed = base_seed + wid
        assert r["num_workers"] == 3
        assert r["seed"] == seed
        assert r["torch_initial_seed"] == seed
        assert r["dataset_is_self"] is True
        assert r["dataset_tag"] == "worker-info-dataset"
        assert r["info_type"] == "torch.utils.data._utils.worker.WorkerInfo"
        assert r["frozen"] is True
        expected_np = np.random.RandomState(_generate_state(base_seed, wid)).get_state()[1][:8]
        init = r["init_state"]
        assert init["np_state_head"] == [int(x) for x in expected_np]
        assert init["worker_id_arg"] == wid and init["info_id"] == wid and init["seed"] == seed
        assert init["torch_initial_seed"] == seed
        assert init["random_first"] == random.Random(seed).random()
        assert init["np_first"] == np.random.RandomState(_generate_state(base_seed, wid)).rand()


def test_base_seed_comes_from_global_rng_without_generator(transport):
    def seeds(cls):
        torch.manual_seed(77)
        loader = cls(WorkerInfoDataset(4), batch_size=None, num_workers=2)
        return [r["seed"] for r in loader]

    theirs = seeds(TorchDataLoader)
    assert seeds(fastmm.DataLoader) == theirs
    torch.manual_seed(77)
    base_seed = int(torch.empty((), dtype=torch.int64).random_().item())
    assert theirs == [base_seed, base_seed + 1] * 2


# --------------------------------------------------------------------------------------------
# Errors in workers
# --------------------------------------------------------------------------------------------


class _Raised:
    """What an exception looked like (type and message), without keeping its traceback."""

    def __init__(self, exc: BaseException):
        self.type = type(exc)
        self.message = str(exc)

    def __str__(self):
        return self.message


def _first_error(cls, dataset, **kwargs) -> _Raised:
    it = iter(cls(dataset, num_workers=2, **kwargs))
    try:
        for _ in it:
            pass
    except Exception as exc:  # noqa: BLE001
        return _Raised(exc)
    finally:
        shutdown_iter(it)
    raise AssertionError("no exception reached the loop")


@pytest.mark.parametrize("exc_type", [ValueError, KeyError, CustomError], ids=lambda t: t.__name__)
def test_worker_exception_reaches_the_loop_like_torch(exc_type, transport):
    expected = _first_error(TorchDataLoader, FailingDataset(10, bad={5}, exc_type=exc_type), batch_size=2)
    actual = _first_error(fastmm.DataLoader, FailingDataset(10, bad={5}, exc_type=exc_type), batch_size=2)
    assert actual.type is expected.type is exc_type
    ours, theirs = str(actual), str(expected)
    # Batch 2 (indices 4, 5) goes to worker 0 (round robin), as in torch.
    assert f"Caught {exc_type.__name__} in DataLoader worker process 0" in ours
    assert "Original Traceback (most recent call last):" in ours
    assert ours.splitlines()[:2] == theirs.splitlines()[:2]
    # the worker's traceback text: the dataset's own frame and the final exception line
    assert 'raise self.exc_type(f"bad index {i}")' in ours
    assert "_datasets.py" in ours and "__getitem__" in ours
    assert ours.rstrip().splitlines()[-1] == theirs.rstrip().splitlines()[-1]


def test_exception_in_iterable_dataset_like_torch(transport):
    expected = _first_error(TorchDataLoader, BrokenIterable(12, after=2), batch_size=None)
    actual = _first_error(fastmm.DataLoader, BrokenIterable(12, after=2), batch_size=None)
    assert actual.type is expected.type is CustomError
    assert str(actual).splitlines()[:2] == str(expected).splitlines()[:2]
    assert str(actual).rstrip().splitlines()[-1] == str(expected).rstrip().splitlines()[-1]


def test_exception_in_collate_fn_like_torch(transport):
    expected = _first_error(TorchDataLoader, FailingDataset(10, bad=()), batch_size=3, collate_fn=collate_raises)
    actual = _first_error(fastmm.DataLoader, FailingDataset(10, bad=()), batch_size=3, collate_fn=collate_raises)
    assert actual.type is expected.type is CustomError
    assert str(actual).splitlines()[:2] == str(expected).splitlines()[:2]
    assert "collate refused a batch containing 6" in str(actual)


@pytest.mark.parametrize("size", [8, 5000], ids=["small", "big"])
def test_default_collate_error_like_torch(size, transport):
    """Samples of different shapes: the worker's stack fails the same way as torch's."""
    expected = _first_error(TorchDataLoader, MismatchDataset(8, size, odd=3), batch_size=4)
    actual = _first_error(fastmm.DataLoader, MismatchDataset(8, size, odd=3), batch_size=4)
    assert actual.type is expected.type is RuntimeError
    assert str(actual).splitlines()[:2] == str(expected).splitlines()[:2]
    assert str(actual).rstrip().splitlines()[-1] == str(expected).rstrip().splitlines()[-1]


def _events(cls, dataset, steps: int, **kwargs):
    """What each next() gives: a batch's values, an error (type, worker line), or the end."""
    it = iter(cls(dataset, **kwargs))
    events = []
    for _ in range(steps):
        try:
            batch = next(it)
            events.append(("batch", batch.flatten().tolist() if isinstance(batch, torch.Tensor) else batch))
        except StopIteration:
            events.append(("end",))
            break
        except Exception as exc:  # noqa: BLE001
            events.append(("error", type(exc).__name__, str(exc).splitlines()[0]))
    shutdown_iter(it)
    return events


def test_iteration_continues_after_worker_exception_like_torch(transport):
    kwargs = dict(batch_size=2, num_workers=2)
    expected = _events(TorchDataLoader, FailingDataset(12, bad={3, 8}), 10, **kwargs)
    actual = _events(fastmm.DataLoader, FailingDataset(12, bad={3, 8}), 10, **kwargs)
    assert actual == expected
    assert [e[0] for e in actual] == ["batch", "error", "batch", "batch", "error", "batch", "end"]


def test_worker_init_fn_exception_like_torch(transport):
    def first(cls):
        it = iter(cls(SampleDataset(6), batch_size=2, num_workers=2, worker_init_fn=fail_init))
        try:
            return outcome(lambda: next(it))
        finally:
            shutdown_iter(it)

    expected, actual = first(TorchDataLoader), first(fastmm.DataLoader)
    assert actual[0] is expected[0] is ZeroDivisionError
    assert actual[1].splitlines()[:2] == expected[1].splitlines()[:2]
    assert actual[1].rstrip().splitlines()[-1] == "ZeroDivisionError: init failed in worker 0"


def _run_to_error(cls, dataset, timeout):
    """Iterate until an error; (outcome, seconds)."""
    it = iter(cls(dataset, batch_size=1, num_workers=2, timeout=timeout))
    start = time.monotonic()
    try:
        list(it)
        result = ("ok", None)
    except Exception as exc:  # noqa: BLE001
        result = (type(exc), str(exc))
    elapsed = time.monotonic() - start
    try:
        shutdown_iter(it)
    except RuntimeError:
        # torch's SIGCHLD handler (fastmm installs it too) raises in the main thread when a
        # registered worker has died -- also during the clean-up of an iterator that has
        # not yet reported that death itself; the shutdown's own finally clause completes it.
        pass
    return result, elapsed


# What torch's own loader may raise when a worker dies (its result queue races the exit).
TORCH_RACY_WORKER_ERRORS = (RuntimeError, EOFError, ConnectionResetError)


class _Segfaults(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        import ctypes

        ctypes.string_at(0)  # SIGSEGV, as torch's test_segfault does


@pytest.mark.parametrize("sigchld", ["torch's handler", "fastmm's watch alone"])
def test_a_worker_segfault_is_reported_in_torchs_words(sigchld, transport, monkeypatch):
    """torch's test_segfault: "DataLoader worker (pid N) is killed by signal: ...", whether
    torch's SIGCHLD handler or fastmm's own watch of its workers sees the death first (before,
    fastmm's said "exited unexpectedly", in about half the runs of torch's suite)."""
    if sigchld != "torch's handler":
        # torch's handler (installed once per process) watches only the pids it is given
        for name in ("_set_worker_pids", "_remove_worker_pids"):
            monkeypatch.setattr(torch.utils.data._utils.signal_handling, name, lambda *a: None)
    for _ in range(3):
        with pytest.raises(RuntimeError,
                           match=r"DataLoader worker \(pid \d+\) is killed by signal: "):
            list(fastmm.DataLoader(_Segfaults(), batch_size=2, num_workers=1))


@pytest.mark.parametrize("timeout", [0, 20], ids=["no_timeout", "timeout"])
def test_killed_worker_raises_runtime_error_like_torch(timeout, transport):
    """A worker killed by SIGKILL (the OOM killer): RuntimeError "DataLoader worker (pid ...",
    at once, with or without a timeout (5 times: whether the pipe's EOF or the process's
    exit is seen first is a race)."""
    expected, _ = _run_to_error(TorchDataLoader, SuicideDataset(8, victim=2), timeout)
    # torch is racy here: usually its RuntimeError, sometimes an EOFError or a
    # ConnectionResetError from its shared result queue (both seen in CI). fastmm must always
    # give the RuntimeError.
    assert expected[0] in TORCH_RACY_WORKER_ERRORS, expected
    for _ in range(5):
        actual, elapsed = _run_to_error(fastmm.DataLoader, SuicideDataset(8, victim=2), timeout)
        assert actual[0] is RuntimeError
        assert actual[1].startswith("DataLoader worker (pid"), actual[1]
        assert elapsed < 10


@pytest.mark.slow
@pytest.mark.parametrize("timeout", [0, 20], ids=["no_timeout", "timeout"])
def test_worker_exit_after_its_pipe_closes_raises_exited_unexpectedly_like_torch(timeout, transport):
    """A worker whose pipes close a second before it exits (code 3): the loop gets torch's
    RuntimeError "DataLoader worker (pid N) exited unexpectedly ..." -- never "DataLoader timed
    out after 20 seconds" when no timeout has passed."""
    dataset = ExitingDataset(8, victim=2, close_pipes_first=True)
    expected, _ = _run_to_error(TorchDataLoader, dataset, timeout)
    # torch itself is racy here: usually "exited unexpectedly", under load an EOFError from
    # its shared result queue. fastmm must always give the RuntimeError.
    assert expected[0] in TORCH_RACY_WORKER_ERRORS, expected
    actual, elapsed = _run_to_error(fastmm.DataLoader, dataset, timeout)
    assert actual[0] is RuntimeError, actual
    assert actual[1].startswith("DataLoader worker (pid"), actual[1]
    assert "exited unexpectedly" in actual[1], actual[1]
    assert elapsed < 10


# --------------------------------------------------------------------------------------------
# timeout, shutdown, epochs
# --------------------------------------------------------------------------------------------

_TIMEOUT = 1.5
_SLEEP = 3.0


def _time_out(cls):
    loader = cls(SleepyDataset(4, slow=0, seconds=_SLEEP), batch_size=1, num_workers=1, timeout=_TIMEOUT)
    it = iter(loader)
    start = time.monotonic()
    result = outcome(lambda: next(it))
    elapsed = time.monotonic() - start
    shutdown_iter(it)
    assert result[0] is RuntimeError, result
    return result[1], elapsed


@pytest.mark.slow
def test_timeout_raises_like_torch(transport):
    message, elapsed = _time_out(fastmm.DataLoader)
    assert message == f"DataLoader timed out after {_TIMEOUT} seconds"
    assert _TIMEOUT - 0.1 <= elapsed <= _TIMEOUT + 2
    expected_message, _ = _time_out(TorchDataLoader)
    assert message == expected_message


@pytest.mark.parametrize("persistent", [False, True], ids=["transient", "persistent"])
def test_break_early_then_delete_leaves_no_children(persistent, transport):
    before = live_children()
    loader = fastmm.DataLoader(
        FullDataset(60, (64, 64)), batch_size=2, num_workers=3, persistent_workers=persistent
    )
    it = iter(loader)
    for k, _ in enumerate(it):
        if k == 2:
            break
    assert len(live_children() - before) == 3
    del it, _
    if persistent:
        del loader
    gc.collect()
    assert wait_for_children_to_go(before) == set()


_MAIN_PID = os.getpid()


def _rebuild_outside_the_main_process(value):
    if os.getpid() == _MAIN_PID:
        raise ValueError("this sample cannot be rebuilt in the main process")
    return value


class _Fragile:
    """Pickles in a worker; fails to unpickle in the main process (a class whose __reduce__
    needs something only workers have)."""

    def __reduce__(self):
        return _rebuild_outside_the_main_process, (0,)


class _OneFragile(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return _Fragile() if i == 5 else i


def test_a_batch_that_fails_to_unpickle_is_its_error_and_the_epoch_goes_on(transport):
    """Its error is raised in its turn, as itself with a note naming the worker, and the other
    batches all come: before, the batch was lost and the next next() waited for it until the
    timeout. (An error raised then by torch's SIGCHLD handler, for another worker's death,
    keeps torch's words: test_killed_worker_raises_runtime_error_like_torch.)"""
    it = iter(fastmm.DataLoader(_OneFragile(), batch_size=2, num_workers=2, timeout=20,
                                collate_fn=list))
    got, errors = [], []
    while True:
        try:
            got.append(next(it))
        except StopIteration:
            break
        except ValueError as e:
            errors.append(" ".join([str(e), *e.__notes__]))
    assert got == [[0, 1], [2, 3], [6, 7], [8, 9], [10, 11]]
    assert len(errors) == 1 and "cannot be rebuilt" in errors[0] and "worker 0" in errors[0]


@pytest.mark.slow
def test_a_stopped_worker_is_killed_when_the_loader_goes(transport):
    """A worker that cannot take SIGTERM (stopped by SIGSTOP or a debugger, or ignoring it)
    is killed, not left behind, as torch's loader leaves it."""
    before = live_children()
    it = iter(fastmm.DataLoader(FullDataset(60, (64, 64)), batch_size=2, num_workers=2,
                                timeout=2))
    next(it)
    stopped = it._workers[0].pid
    os.kill(stopped, signal.SIGSTOP)
    # stopped between batches, the loader's timeout says so; stopped while it held the slab
    # pool's table (a lock of microseconds), the wait for the table does (docs/faults.md)
    with pytest.raises(RuntimeError, match="timed out|held fastmm's slab table"):
        for _ in it:
            pass
    del it
    gc.collect()
    assert wait_for_children_to_go(before) == set()
    assert not psutil.pid_exists(stopped) or psutil.Process(stopped).status() == "zombie"


_ORPHAN_SCRIPT = r"""
import os, sys
sys.path.insert(0, {tests_dir!r})
import fastmm
from _datasets import SampleDataset
import threading
loader = fastmm.DataLoader(SampleDataset(100), batch_size=2, num_workers=2, persistent_workers=True,
                           multiprocessing_context={context!r})
made = []
if {from_thread}:  # the kernel's parent-death signal follows the starting thread: not used then
    starter = threading.Thread(target=lambda: made.append(iter(loader)))
    starter.start()
    starter.join()
it = made[0] if made else iter(loader)
next(it)
print(" ".join(str(w.pid) for w in it._workers), flush=True)
os.kill(os.getpid(), 9)
"""


_UNPICKLABLE_SCRIPT = """
import gc, sys, warnings
sys.path.insert(0, {tests_dir!r})
import fastmm
from _datasets import SampleDataset
warnings.simplefilter("always")
loader = fastmm.DataLoader(SampleDataset(8), batch_size=2, num_workers=2,
                           multiprocessing_context="spawn", collate_fn=lambda batch: batch)
try:
    next(iter(loader))
except Exception as e:
    print(type(e).__name__, flush=True)
gc.collect()
print(len(list(fastmm.DataLoader(SampleDataset(8), batch_size=2, num_workers=2,
                                 multiprocessing_context="spawn"))), flush=True)
"""


@pytest.mark.slow
def test_a_worker_that_cannot_start_is_torchs_error_and_nothing_else(transport):
    """spawn pickles the worker's arguments: a lambda collate_fn fails to start it. torch's
    PicklingError and warning, then no noise from the half-made iterator as it goes (before: an
    AttributeError from __del__ and unclosed sockets), and the next loader works."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-W", "always", "-c",
                           _UNPICKLABLE_SCRIPT.format(tests_dir=tests_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["PicklingError", "4"], proc.stderr
    assert "Got pickle error when attempting to start a worker Process" in proc.stderr
    assert "Exception ignored" not in proc.stderr and "ResourceWarning" not in proc.stderr


def _worker_starts(dataset, num_workers: int, method: str = "spawn"):
    """Each worker's (pid, when its process was made, when it had started), in worker order,
    in seconds since boot."""
    it = iter(fastmm.DataLoader(dataset, batch_size=None, num_workers=num_workers,
                                multiprocessing_context=method))
    made = {w.pid: psutil.Process(w.pid).create_time() - psutil.boot_time()  # (/proc's ticks)
            for w in it._workers}
    samples = list(it)
    assert [s["pid"] for s in samples[:num_workers]] == [w.pid for w in it._workers]
    return [(s["pid"], made[s["pid"]], s["imported_at"]) for s in samples[:num_workers]]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawn_and_forkserver_workers_start_no_more_at_once_than_there_are_cores(method, monkeypatch):
    """Each spawned worker imports torch anew (a second of CPU or more), each forkserver one the
    dataset's modules: with one core, each starts once the one before has started, so the
    first is ready in the time of one."""
    monkeypatch.setattr("fastmm.doctor.usable_cores", lambda: 1)
    starts = _worker_starts(StartingDataset(3), 3, method)
    for (_, _, started), (_, made, _) in zip(starts, starts[1:]):
        assert made >= started - 0.02  # (create_time counts in clock ticks)


@pytest.mark.slow
def test_a_spawned_worker_slow_to_start_holds_the_next_back_only_so_long(monkeypatch):
    """One waiting on something other than a core (here: asleep) holds the next back for
    START_WAIT_S at most."""
    monkeypatch.setattr("fastmm.doctor.usable_cores", lambda: 1)
    monkeypatch.setattr("fastmm._processes.START_WAIT_S", 0.5)
    starts = _worker_starts(StartingDataset(3, start_s=4.0), 3)
    assert starts[-1][1] - starts[0][1] < 3.0  # one after another: 8 s and more


@pytest.mark.slow
def test_a_spawned_worker_that_dies_starting_holds_none_back(monkeypatch):
    """The next starts the moment it dies; then torch's error, not a hang."""
    monkeypatch.setattr("fastmm.doctor.usable_cores", lambda: 1)
    monkeypatch.setattr("fastmm._processes.START_WAIT_S", 60.0)
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        list(fastmm.DataLoader(StartingDataset(4, exit_code=3), num_workers=3,
                               multiprocessing_context="spawn"))
    assert time.monotonic() - began < 30


_PERSISTENT_AT_EXIT_SCRIPT = """
import sys
sys.path.insert(0, {tests_dir!r})
import fastmm
from _datasets import SampleDataset
loader = fastmm.DataLoader(SampleDataset(8), batch_size=2, num_workers=2, persistent_workers=True)
for _ in loader:
    pass
print(" ".join(str(w.pid) for w in loader._iterator._workers), flush=True)
if {stop}:
    import os, signal
    os.kill(loader._iterator._workers[0].pid, signal.SIGSTOP)
"""


@pytest.mark.slow
@pytest.mark.parametrize("stop", [False, True], ids=["running", "one stopped"])
def test_persistent_workers_alive_at_exit_leave_quietly(transport, stop):
    """The interpreter exits with persistent workers still up: no unclosed-socket warnings,
    no worker left behind (as with torch's loader). One stopped (SIGSTOP, a debugger) is
    killed: multiprocessing's exit handler waited for it without end (as with torch's)."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-W", "always", "-c",
                           _PERSISTENT_AT_EXIT_SCRIPT.format(tests_dir=tests_dir, stop=stop)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2 and not any(psutil.pid_exists(p) and psutil.Process(p).status()
                                      != psutil.STATUS_ZOMBIE for p in pids)


@pytest.mark.parametrize("from_thread, context", [(False, None), (True, None),
                                                  (False, "forkserver")],
                         ids=["main-thread", "other-thread", "forkserver"])
@pytest.mark.slow
def test_workers_exit_when_the_main_process_is_killed(transport, from_thread, context):
    """kill -9 of the main process: its (persistent, idle) workers do not outlive it, whether
    the main thread started them (the kernel's signal) or another thread (a polling thread), or
    a forkserver, which outlives the main process (a thread polls for the main process)."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryFile("w+") as out:  # not a pipe: a forkserver would hold it open
        proc = subprocess.run(
            [sys.executable, "-c", _ORPHAN_SCRIPT.format(tests_dir=tests_dir,
                                                         from_thread=from_thread, context=context)],
            stdout=out, stderr=subprocess.DEVNULL, timeout=120)
        out.seek(0)
        pids = [int(p) for p in out.read().split()]
    assert proc.returncode == -9
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            break
        time.sleep(0.1)
    assert alive == []


def test_workers_exit_when_an_epoch_ends(transport):
    before = live_children()
    loader = fastmm.DataLoader(SampleDataset(10), batch_size=2, num_workers=2)
    it = iter(loader)
    batches = list(it)  # the iterator object stays referenced
    assert len(batches) == 5
    assert wait_for_children_to_go(before) == set()
    del it


def _pids_per_epoch(cls, persistent: bool, epochs: int = 3):
    loader = cls(PidDataset(8), batch_size=2, num_workers=2, persistent_workers=persistent)
    out = []
    for _ in range(epochs):
        batches = list(loader)
        out.append(([b["i"].tolist() for b in batches], sorted({int(p) for b in batches for p in b["pid"]})))
    shutdown(loader)
    return out


@pytest.mark.parametrize("persistent", [False, True], ids=["transient", "persistent"])
def test_several_epochs(persistent, transport):
    ours = _pids_per_epoch(fastmm.DataLoader, persistent)
    theirs = _pids_per_epoch(TorchDataLoader, persistent)
    assert [indices for indices, _ in ours] == [indices for indices, _ in theirs] == [[[0, 1], [2, 3], [4, 5], [6, 7]]] * 3
    pid_sets = [pids for _, pids in ours]
    assert all(len(p) == 2 for p in pid_sets)
    if persistent:
        assert pid_sets[0] == pid_sets[1] == pid_sets[2]
    else:
        assert not set(pid_sets[0]) & set(pid_sets[1]) and not set(pid_sets[1]) & set(pid_sets[2])


class EpochAware(Dataset):
    """A user's dataset with its own set_epoch (another signature than ShardStream's): its
    items carry the epoch their copy holds."""

    epoch = 0

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([i, self.epoch])

    def set_epoch(self, epoch, rank):
        self.epoch = epoch


def test_persistent_workers_keep_a_users_set_epoch_to_themselves(transport):
    """torch passes nothing to persistent workers' dataset copies between epochs; neither does
    fastmm, but for its own ShardStream (before, any set_epoch was called there, and one with
    another signature killed the worker)."""
    def run(cls):
        data = EpochAware()
        loader = cls(data, batch_size=2, num_workers=2, persistent_workers=True)
        out = []
        for epoch in range(3):
            data.set_epoch(epoch, rank=0)
            out.append([b.tolist() for b in loader])
        shutdown(loader)
        return out

    assert run(fastmm.DataLoader) == run(TorchDataLoader) == [[[[0, 0], [1, 0]], [[2, 0], [3, 0]]]] * 3


class LongerThanItSays(IterableDataset):
    def __len__(self):
        return 2

    def __iter__(self):
        return iter(range(5))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_torchs_warnings_in_next_name_the_users_line(num_workers, transport):
    """torch warns from __next__ with stacklevel=2, naming the loop's line; fastmm's iterators
    add no frame there, so warnings filters by module and line work the same."""
    def where(cls):
        loader = cls(LongerThanItSays(), batch_size=None, num_workers=num_workers)
        len(loader)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in loader:  # the line both must name
                pass
        return {(w.filename, w.lineno) for w in caught if "Length of IterableDataset" in str(w.message)}

    assert where(fastmm.DataLoader) == where(TorchDataLoader) != set()
    assert {f for f, _ in where(fastmm.DataLoader)} == {__file__}


def test_two_iterators_at_once_like_torch(transport):
    def run(cls):
        loader = cls(SampleDataset(12, "tensor_wid"), batch_size=3, num_workers=2)
        a, b = iter(loader), iter(loader)
        out = []
        for x, y in zip(a, b):
            out.append((x, y))
        return out

    assert_same(run(fastmm.DataLoader), run(TorchDataLoader))


# --------------------------------------------------------------------------------------------
# Keeping, dropping and mutating batches (slab reuse must never show through)
# --------------------------------------------------------------------------------------------


def _check_full(x: torch.Tensor, first_index: int) -> None:
    expected = torch.arange(first_index, first_index + x.shape[0], dtype=torch.float32)
    expected = expected.view(-1, *([1] * (x.dim() - 1)))
    assert torch.equal(x, expected.expand_as(x)), f"batch starting at {first_index} corrupted"


def test_kept_batches_stay_intact(transport):
    n, bs = 200, 4  # 50 batches of 4 x 256 x 256 float32 = 1 MiB each
    loader = fastmm.DataLoader(FullDataset(n, (256, 256)), batch_size=bs, num_workers=2)
    kept = list(loader)
    assert len(kept) == 50
    for k, b in enumerate(kept):
        assert b["i"].tolist() == list(range(k * bs, k * bs + bs))
        _check_full(b["x"], k * bs)
    # later epochs, whose batches arrive while the first epoch's are still held
    for _ in range(2):
        for k, b in enumerate(loader):
            _check_full(b["x"], k * bs)
    for k, b in enumerate(kept):
        _check_full(b["x"], k * bs)
    # ... and after the loader, its iterator and its workers are gone
    del loader
    gc.collect()
    for k, b in enumerate(kept):
        _check_full(b["x"], k * bs)
        assert b["i"].tolist() == list(range(k * bs, k * bs + bs))


def test_batches_survive_persistent_workers_shutdown(transport):
    before = live_children()
    loader = fastmm.DataLoader(FullDataset(24, (128, 128)), batch_size=4, num_workers=2, persistent_workers=True)
    epochs = [list(loader) for _ in range(2)]
    del loader
    gc.collect()
    assert wait_for_children_to_go(before) == set()
    for batches in epochs:
        for k, b in enumerate(batches):
            _check_full(b["x"], k * 4)


def test_growing_and_shrinking_batches_like_torch(transport):
    """Batches of very different sizes, some kept and some dropped: slabs are created, grown,
    reused for smaller batches and retired; every kept batch stays exact."""
    sizes = [1, 8, 2, 16, 1, 4, 12, 1, 1, 16, 3, 9]

    def run(cls):
        loader = cls(
            FullDataset(sum(sizes), (3, 64, 64)),
            batch_sampler=SizesBatchSampler(sizes),
            num_workers=2,
            prefetch_factor=2,
        )
        kept = []
        for epoch in range(2):
            for k, b in enumerate(loader):
                assert b["x"].shape[0] == sizes[k]
                _check_full(b["x"], sum(sizes[:k]))
                if (k + epoch) % 3 == 0:
                    kept.append(b)
        return kept

    theirs, ours = run(TorchDataLoader), run(fastmm.DataLoader)
    gc.collect()
    assert_same(ours, theirs)


def test_very_large_batches_intact(transport):
    """16 MiB batches (4 samples of 4 MiB)."""
    loader = fastmm.DataLoader(FullDataset(12, (1024, 1024)), batch_size=4, num_workers=2)
    kept = list(loader)
    assert len(kept) == 3
    for _ in loader:
        pass
    for k, b in enumerate(kept):
        _check_full(b["x"], k * 4)


def test_batches_kept_in_part_survive_slab_reuse(transport):
    """Most batches are dropped at once (their slabs go back to the workers and are rewritten);
    what is kept of the others (a whole batch, one field, a view, a NumPy array) never changes."""
    bs = 4
    loader = fastmm.DataLoader(FullDataset(240, (128, 128)), batch_size=bs, num_workers=2, prefetch_factor=2)
    kept = []
    for epoch in range(2):
        for k, b in enumerate(loader):
            _check_full(b["x"], k * bs)
            if epoch == 0:
                if k % 7 == 0:
                    kept.append(("batch", k, b))
                elif k % 7 == 3:
                    kept.append(("field", k, b["x"]))
                elif k % 7 == 5:
                    kept.append(("view", k, b["x"][2]))
                elif k % 7 == 6:
                    kept.append(("numpy", k, b["x"].numpy()))
            del b
        gc.collect()
        for kind, k, obj in kept:
            if kind == "batch":
                _check_full(obj["x"], k * bs)
                assert obj["i"].tolist() == list(range(k * bs, k * bs + bs))
            elif kind == "field":
                _check_full(obj, k * bs)
            elif kind == "view":
                assert torch.equal(obj, torch.full((128, 128), float(k * bs + 2)))
            else:
                _check_full(torch.from_numpy(obj), k * bs)


def test_mutating_a_batch_does_not_corrupt_later_ones(transport):
    bs = 4
    loader = fastmm.DataLoader(FullDataset(120, (128, 128)), batch_size=bs, num_workers=2, persistent_workers=True)
    mutated = []
    for epoch in range(2):
        for k, b in enumerate(loader):
            _check_full(b["x"], k * bs)
            assert b["i"].tolist() == list(range(k * bs, k * bs + bs))
            b["x"].fill_(-7.0)  # received tensors are writable, as torch's are
            b["i"].add_(1000)
            if k % 6 == 0 and epoch == 0:
                mutated.append(b)
    for b in mutated:  # a kept batch is never handed back to a worker and rewritten
        assert torch.equal(b["x"], torch.full_like(b["x"], -7.0))
        assert bool((b["i"] >= 1000).all())
    shutdown(loader)


def test_pin_memory_like_torch(transport):
    def run(cls):
        loader = cls(SampleDataset(9, "mixed_big_small"), batch_size=3, num_workers=2, pin_memory=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = list(loader)
        pin_warnings = sorted({str(w.message) for w in caught if "pin" in str(w.message)})
        return batches, pin_warnings

    theirs, their_warnings = run(TorchDataLoader)
    ours, our_warnings = run(fastmm.DataLoader)
    assert_same(ours, theirs)
    assert our_warnings == their_warnings
    if torch.accelerator.is_available():
        assert all(b["image"].is_pinned() for b in ours)
    else:
        assert our_warnings == [
            "'pin_memory' argument is set as true but no accelerator is found, "
            "then device pinned memory won't be used."
        ]


_TORCH_WARNINGS = {  # what makes torch's loader warn, and the warning's start
    "too many workers": (dict(num_workers=2), "This DataLoader will create"),  # for 1 core
    "pin_memory without an accelerator": (dict(num_workers=2, pin_memory=True),
                                          "'pin_memory' argument is set as true"),
    "a worker that cannot start": (dict(num_workers=1, multiprocessing_context="spawn",
                                        collate_fn=lambda batch: batch), "Got pickle error"),
}


@pytest.mark.parametrize("case", list(_TORCH_WARNINGS))
def test_torchs_warnings_belong_to_torchs_module(case, monkeypatch):
    """Training scripts silence the loader's warnings with filterwarnings(..., module=
    "torch.utils.data.dataloader"): fastmm raises torch's warnings from that module too, so the
    filter silences them as it does torch's."""
    monkeypatch.setattr(torch._utils, "cpu_count", lambda: 1)  # what both loaders' check reads
    kwargs, start = _TORCH_WARNINGS[case]
    if case.startswith("pin_memory") and torch.accelerator.is_available():
        pytest.skip("pin_memory warns only where there is no accelerator")

    def warned(cls, module_filter: bool) -> bool:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if module_filter:
                warnings.filterwarnings("ignore", module="torch.utils.data.dataloader")
            try:
                list(cls(SampleDataset(4), batch_size=2, **kwargs))
            except pickle.PicklingError:
                pass
        return any(str(w.message).startswith(start) for w in caught)

    for cls in (TorchDataLoader, fastmm.DataLoader):
        assert warned(cls, module_filter=False), cls
        assert not warned(cls, module_filter=True), cls


# --------------------------------------------------------------------------------------------
# What torch's shared-memory transport preserves about the tensors it moves
# --------------------------------------------------------------------------------------------


def _alias_batch(cls):
    loader = cls(SampleDataset(4, "big"), batch_size=2, num_workers=1, collate_fn=collate_alias)
    return next(iter(loader))


def test_same_tensor_twice_in_a_batch_stays_one_object_like_torch(transport):
    theirs = _alias_batch(TorchDataLoader)
    assert theirs["a"] is theirs["b"]
    ours = _alias_batch(fastmm.DataLoader)
    assert ours["a"] is ours["b"]


def test_views_in_a_batch_share_memory_like_torch(transport):
    """A collate_fn returning a tensor and views of it: torch keeps them on one storage, so a
    write through one is seen through the others."""
    results = []
    for cls in (TorchDataLoader, fastmm.DataLoader):
        b = _alias_batch(cls)
        b["a"][1].fill_(123.0)
        b["a"][0, 0, 0, :2].fill_(-5.0)
        results.append((bool((b["view"][0] == 123.0).all()), b["small_view"].tolist()))
    theirs, ours = results
    assert theirs == (True, [-5.0, -5.0])
    assert ours == theirs


def test_non_contiguous_tensors_keep_their_strides_like_torch(transport):
    def first(cls):
        return next(iter(cls(SampleDataset(2, "noncontig"), batch_size=None, num_workers=1)))

    theirs, ours = first(TorchDataLoader), first(fastmm.DataLoader)
    assert_same(ours, theirs, strides=True)


@pytest.mark.xfail(
    strict=True,
    reason="known difference (README): slab tensors wrap a Python mapping, so is_shared() is "
    "False; sending them on to another process copies them once into shared memory",
)
def test_received_tensors_report_shared_memory_like_torch(transport):
    def first(cls):
        return next(iter(cls(FullDataset(4, (64, 64)), batch_size=2, num_workers=1)))

    theirs, ours = first(TorchDataLoader), first(fastmm.DataLoader)
    assert theirs["x"].is_shared() and theirs["i"].is_shared()
    assert ours["x"].is_shared() == theirs["x"].is_shared()
    assert ours["i"].is_shared() == theirs["i"].is_shared()


def test_batch_can_be_sent_on_to_another_process(transport):
    ctx = torch.multiprocessing.get_context("fork")
    batch = next(iter(fastmm.DataLoader(FullDataset(4, (64, 64)), batch_size=2, num_workers=1)))
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_sum_from_queue, args=(q_in, q_out))
    proc.start()
    try:
        q_in.put(batch)
        assert q_out.get(timeout=30) == float(batch["x"].sum())
    finally:
        proc.join(10)
    _check_full(batch["x"], 0)


def _sum_from_queue(q_in, q_out):
    q_out.put(float(q_in.get()["x"].sum()))


def test_worker_side_dataset_state_is_per_worker(transport):
    """Workers hold copies of the dataset: state a worker changes never reaches the main one."""
    ds = RangeIterable(6, "tensor_wid", "stride")
    loader = fastmm.DataLoader(ds, batch_size=None, num_workers=2, worker_init_fn=_mark_dataset)
    out = list(loader)
    assert sorted(int(b["i"]) for b in out) == list(range(6))
    assert not hasattr(ds, "marked")


def _mark_dataset(worker_id):
    get_worker_info().dataset.marked = worker_id


_GC_IN_A_WORKER = """
import gc, json, psutil, torch, fastmm

class ManifestDataset(torch.utils.data.Dataset):
    # a manifest held as Python objects, as many datasets do; each item runs a full garbage
    # collection in the worker and returns how much of its memory became its own (USS) meanwhile
    def __init__(self, rows):
        self.rows = [{"path": f"/data/{i:08d}.jpg", "label": i % 1000} for i in range(rows)]
    def __len__(self):
        return 2
    def __getitem__(self, i):
        me = psutil.Process()
        before = me.memory_full_info().uss
        gc.collect()
        return me.memory_full_info().uss - before

dataset = ManifestDataset(400_000)  # ~40 MB of dicts and strings in the main process
gc.collect()
gc.disable()  # a collection here would copy those pages too, into the worker's own memory
print(json.dumps({name: max(int(b) for b in cls(dataset, batch_size=None, num_workers=1))
                  for name, cls in (("torch", torch.utils.data.DataLoader),
                                    ("fastmm", fastmm.DataLoader))}))
"""


@pytest.mark.slow
def test_a_garbage_collection_in_a_worker_copies_no_inherited_pages():
    """torch's workers copy every page holding a Python object of the main process the first
    time a full collection runs there (it writes into each object it visits); fastmm's leave
    what they inherit out of their collections. In a fresh interpreter: a module that freezes
    every forked child (fastmm.decode.dali does) would hide the effect in torch's workers."""
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", _GC_IN_A_WORKER],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    grown = json.loads(run.stdout.strip().splitlines()[-1])
    assert grown["torch"] > 16 * 2**20, grown  # the effect is there to be avoided
    assert grown["fastmm"] < 4 * 2**20, grown


_FREED_IN_MAIN = """
import json, sys
sys.path.insert(0, {tests_dir!r})
import torch, fastmm
from _datasets import churn_heap, rss_anon

churn_heap(1025, keep_last=True)  # 64 MiB of the heap written and freed, still in place

class WorkerMemory(torch.utils.data.Dataset):
    def __len__(self):
        return 1
    def __getitem__(self, i):
        return rss_anon()

main = rss_anon()
print(json.dumps({{name: main - int(next(iter(cls(WorkerMemory(), batch_size=None, num_workers=1))))
                   for name, cls in (("torch", torch.utils.data.DataLoader),
                                     ("fastmm", fastmm.DataLoader))}}))
"""


@pytest.mark.slow
def test_a_forked_worker_keeps_none_of_the_memory_the_main_process_had_freed():
    """A forked worker inherits the main process's free heap memory: shared until the main
    process writes it again (its next step), then the worker's alone for as long as it lives.
    torch's workers keep it; fastmm's give it back as they start. In a fresh interpreter, whose
    heap this test lays out: the worker's anonymous memory against the main process's."""
    script = _FREED_IN_MAIN.format(tests_dir=os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", script],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    smaller = json.loads(run.stdout.strip().splitlines()[-1])
    assert smaller["torch"] < 16 * 2**20, smaller  # the freed 64 MiB inherited
    assert smaller["fastmm"] > 48 * 2**20, smaller


_FORKSERVER_SCRIPT = """
import sys
sys.path.insert(0, {tests_dir!r})
import psutil
import fastmm
from _datasets import SampleDataset
it = iter(fastmm.DataLoader(SampleDataset(8), batch_size=2, num_workers=1,
                            multiprocessing_context="forkserver"))
next(it)
(server,) = [p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]
print(any("libtorch" in m.path for m in server.memory_maps()), flush=True)
"""


@pytest.mark.slow
def test_the_forkserver_imports_torch_once_for_every_worker_it_forks():
    """Under forkserver, fastmm has the server preload its worker side (torch): each worker is
    forked with torch imported, instead of importing it anew (seconds per worker)."""
    script = _FORKSERVER_SCRIPT.format(tests_dir=os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["True"], done.stderr[-2000:]
