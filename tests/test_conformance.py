"""Conformance: the same dataset and arguments through ``torch.utils.data.DataLoader`` and
``fastmm.DataLoader`` give equal batches (structure, types, dtypes, shapes, strides, values,
order, worker assignment), on both slab transports (C++ and pure Python).

torch's results do not depend on the transport, so each configuration's torch run is done
once and cached for the module.
"""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
import torch.utils.data
from torch.utils.data import (
    BatchSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import fastmm
from _datasets import (
    BatchedGetItemsDataset,
    DelayedDataset,
    EveryOtherSampler,
    GetItemsDataset,
    ParamDataset,
    RandomDataset,
    RandomIterable,
    RangeIterable,
    ReverseSampler,
    SampleDataset,
    TvTensorDataset,
    VariableBatchSampler,
    assert_same,
    canonical,
    collate_holder,
    collate_identity,
    collate_nested,
    collate_noncontig,
    collate_numpy,
    collate_numpy_kinds,
    collate_stack_sum,
    record_init_state,
    set_offset,
)


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def gen(seed: int = 1234) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@dataclass
class Case:
    id: str
    dataset: Callable[[], object]
    kwargs: Callable[[], dict] = dict  # called afresh for each loader (generators are consumed)
    epochs: tuple = (None,)  # per epoch: max batches to take (None = the whole epoch)
    ordered: bool = True  # False: compare the batches of an epoch as a sorted multiset
    seed: int = 0  # global torch/random/numpy seed set before building and iterating
    requires: tuple = ()  # optional modules the case needs (skipped without them)


CASES = [
    # --- map-style, default collation, batch sizes and worker counts ----------------------
    Case("map_tensor_bs3_w2", lambda: SampleDataset(20), lambda: dict(batch_size=3, num_workers=2)),
    Case("map_tensor_bs1_w2", lambda: SampleDataset(9), lambda: dict(batch_size=1, num_workers=2)),
    Case("map_wid_bs7_w3", lambda: SampleDataset(40, "tensor_wid"), lambda: dict(batch_size=7, num_workers=3)),
    Case("map_wid_bs_large_w2", lambda: SampleDataset(37, "tensor_wid"), lambda: dict(batch_size=64, num_workers=2)),
    Case(
        "map_wid_bs_large_drop_last_empty",
        lambda: SampleDataset(37, "tensor_wid"),
        lambda: dict(batch_size=64, num_workers=2, drop_last=True),
    ),
    Case("map_wid_bs4_w1", lambda: SampleDataset(18, "tensor_wid"), lambda: dict(batch_size=4, num_workers=1)),
    Case(
        "map_wid_drop_last_bs7_w3",
        lambda: SampleDataset(23, "tensor_wid"),
        lambda: dict(batch_size=7, num_workers=3, drop_last=True),
    ),
    Case(
        "map_wid_drop_last_false_bs7_w2",
        lambda: SampleDataset(23, "tensor_wid"),
        lambda: dict(batch_size=7, num_workers=2, drop_last=False),
    ),
    Case("map_more_workers_than_batches", lambda: SampleDataset(4, "tensor_wid"), lambda: dict(batch_size=3, num_workers=3)),
    # --- every sample type through default_collate ------------------------------------------
    Case("collate_dtypes_bs7_w3", lambda: SampleDataset(15, "dtypes"), lambda: dict(batch_size=7, num_workers=3)),
    Case("collate_dtypes_bs1_w2", lambda: SampleDataset(4, "dtypes"), lambda: dict(batch_size=1, num_workers=2)),
    Case("collate_numpy_bs3_w2", lambda: SampleDataset(10, "numpy"), lambda: dict(batch_size=3, num_workers=2)),
    Case("collate_python_bs3_w2", lambda: SampleDataset(10, "python"), lambda: dict(batch_size=3, num_workers=2)),
    Case("collate_containers_bs3_w2", lambda: SampleDataset(10, "containers"), lambda: dict(batch_size=3, num_workers=2)),
    Case(
        "collate_mixed_big_small_bs5_w2",
        lambda: SampleDataset(17, "mixed_big_small"),
        lambda: dict(batch_size=5, num_workers=2),
    ),
    Case("collate_noncontig_bs3_w2", lambda: SampleDataset(8, "noncontig"), lambda: dict(batch_size=3, num_workers=2)),
    Case("collate_channels_last_bs3_w2", lambda: SampleDataset(8, "channels_last"), lambda: dict(batch_size=3, num_workers=2)),
    Case("collate_big_bs16_w2", lambda: SampleDataset(64, "big"), lambda: dict(batch_size=16, num_workers=2)),
    # 512 samples of 48 bytes: a batch over 16 KiB, so in a slab, made of many small samples
    Case("collate_many_small_bs512_w2", lambda: SampleDataset(1100), lambda: dict(batch_size=512, num_workers=2)),
    Case("collate_dtype_cycle_bs3_w2", lambda: SampleDataset(9, "dtype_cycle"), lambda: dict(batch_size=3, num_workers=2)),
    # --- batch_size=None (no auto-collation: default_convert per sample) -------------------
    Case("nobatch_dtypes_w2", lambda: SampleDataset(6, "dtypes"), lambda: dict(batch_size=None, num_workers=2)),
    Case("nobatch_numpy_w2", lambda: SampleDataset(6, "numpy"), lambda: dict(batch_size=None, num_workers=2)),
    Case("nobatch_containers_w3", lambda: SampleDataset(7, "containers"), lambda: dict(batch_size=None, num_workers=3)),
    Case("nobatch_python_w2", lambda: SampleDataset(5, "python"), lambda: dict(batch_size=None, num_workers=2)),
    Case("nobatch_params_and_grads_w2", lambda: ParamDataset(5), lambda: dict(batch_size=None, num_workers=2)),
    Case("nobatch_tv_tensors_w2", lambda: TvTensorDataset(5), lambda: dict(batch_size=None, num_workers=2), requires=("torchvision",)),
    Case("collate_tv_tensors_bs2_w2", lambda: TvTensorDataset(6), lambda: dict(batch_size=2, num_workers=2), requires=("torchvision",)),
    Case("nobatch_channels_last_w2", lambda: SampleDataset(4, "channels_last"), lambda: dict(batch_size=None, num_workers=2)),
    Case("nobatch_noncontig_w2", lambda: SampleDataset(4, "noncontig"), lambda: dict(batch_size=None, num_workers=2)),
    # --- shuffling, samplers, batch samplers --------------------------------------------------
    Case(
        "shuffle_generator_bs3_w2",
        lambda: SampleDataset(25, "tensor_wid"),
        lambda: dict(batch_size=3, shuffle=True, generator=gen(7), num_workers=2),
    ),
    Case(
        "shuffle_global_seed_bs4_w3",
        lambda: SampleDataset(25, "tensor_wid"),
        lambda: dict(batch_size=4, shuffle=True, num_workers=3),
        seed=99,
    ),
    Case("sampler_reverse_bs3_w2", lambda: SampleDataset(14, "tensor_wid"), lambda: dict(batch_size=3, sampler=ReverseSampler(14), num_workers=2)),
    Case(
        "sampler_numpy_ints_bs2_w2",
        lambda: SampleDataset(14, "tensor_wid"),
        lambda: dict(batch_size=2, sampler=EveryOtherSampler(14), num_workers=2),
    ),
    Case("sampler_plain_list_w2", lambda: SampleDataset(10, "tensor_wid"), lambda: dict(batch_size=2, sampler=[9, 0, 3, 3, 7, 1], num_workers=2)),
    Case(
        "sampler_weighted_random_w2",
        lambda: SampleDataset(12, "tensor_wid"),
        lambda: dict(
            batch_size=3,
            sampler=WeightedRandomSampler([1.0] * 6 + [5.0] * 6, num_samples=15, generator=gen(3)),
            num_workers=2,
        ),
    ),
    Case(
        "sampler_subset_random_w3",
        lambda: SampleDataset(30, "tensor_wid"),
        lambda: dict(batch_size=4, sampler=SubsetRandomSampler(list(range(0, 30, 2)), generator=gen(5)), num_workers=3),
    ),
    Case(
        "sampler_random_replacement_w2",
        lambda: SampleDataset(10, "tensor_wid"),
        lambda: dict(batch_size=3, sampler=RandomSampler(range(10), replacement=True, num_samples=13, generator=gen(11)), num_workers=2),
    ),
    Case(
        "batch_sampler_variable_w2",
        lambda: SampleDataset(20, "tensor_wid"),
        lambda: dict(batch_sampler=VariableBatchSampler(20, seed=4), num_workers=2),
    ),
    Case(
        "batch_sampler_list_of_lists_w3",
        lambda: SampleDataset(10, "mixed_big_small"),
        lambda: dict(batch_sampler=[[0, 1], [5, 2, 7], [3], [4, 6, 8, 9]], num_workers=3),
    ),
    Case(
        "batch_sampler_random_drop_last_w2",
        lambda: SampleDataset(20, "tensor_wid"),
        lambda: dict(batch_sampler=BatchSampler(RandomSampler(range(20), generator=gen(2)), 3, drop_last=True), num_workers=2),
    ),
    Case(
        "sampler_yields_batches_bs_none",
        lambda: BatchedGetItemsDataset(12, "tensor"),
        lambda: dict(
            batch_size=None,
            sampler=BatchSampler(SequentialSampler(range(12)), 5, drop_last=False),
            collate_fn=collate_identity,
            num_workers=2,
        ),
    ),
    # --- collate_fn -------------------------------------------------------------------------
    Case("collate_fn_stack_sum_w2", lambda: SampleDataset(11), lambda: dict(batch_size=4, collate_fn=collate_stack_sum, num_workers=2)),
    Case("collate_fn_nested_w2", lambda: SampleDataset(9, "dtypes"), lambda: dict(batch_size=3, collate_fn=collate_nested, num_workers=2)),
    Case(
        "collate_fn_custom_class_w2",
        lambda: SampleDataset(10, "mixed_big_small"),
        lambda: dict(batch_size=4, collate_fn=collate_holder, num_workers=2),
    ),
    Case("collate_fn_noncontig_views_w2", lambda: SampleDataset(9), lambda: dict(batch_size=3, collate_fn=collate_noncontig, num_workers=2)),
    Case("collate_fn_numpy_w2", lambda: SampleDataset(9), lambda: dict(batch_size=3, collate_fn=collate_numpy, num_workers=2)),
    Case("collate_fn_numpy_kinds_w2", lambda: SampleDataset(9),
         lambda: dict(batch_size=3, collate_fn=collate_numpy_kinds, num_workers=2)),
    Case("collate_fn_identity_w2", lambda: SampleDataset(7, "containers"), lambda: dict(batch_size=3, collate_fn=collate_identity, num_workers=2)),
    # --- worker_init_fn -----------------------------------------------------------------------
    Case(
        "worker_init_fn_offset_w3",
        lambda: SampleDataset(20, "tensor_wid"),
        lambda: dict(batch_size=3, worker_init_fn=set_offset, num_workers=3),
    ),
    # --- prefetch_factor ------------------------------------------------------------------------
    Case("prefetch_1_w2", lambda: SampleDataset(20, "mixed_big_small"), lambda: dict(batch_size=3, prefetch_factor=1, num_workers=2)),
    Case("prefetch_4_w3", lambda: SampleDataset(40, "tensor_wid"), lambda: dict(batch_size=2, prefetch_factor=4, num_workers=3)),
    # --- persistent workers over several epochs -------------------------------------------------
    Case(
        "persistent_shuffle_3_epochs_w2",
        lambda: SampleDataset(17, "tensor_wid"),
        lambda: dict(batch_size=3, shuffle=True, generator=gen(21), num_workers=2, persistent_workers=True),
        epochs=(None, None, None),
    ),
    Case(
        "persistent_early_break_then_full_w3",
        lambda: SampleDataset(30, "mixed_big_small"),
        lambda: dict(batch_size=2, num_workers=3, persistent_workers=True, prefetch_factor=3),
        epochs=(2, None, 4),
    ),
    Case(
        "persistent_rng_3_epochs_w2",
        lambda: RandomDataset(12),
        lambda: dict(batch_size=3, generator=gen(5), num_workers=2, persistent_workers=True),
        epochs=(None, None, None),
    ),
    Case(
        "persistent_iterable_uneven_2_epochs_w3",
        lambda: RangeIterable(23, "tensor", shard="uneven"),
        lambda: dict(batch_size=2, num_workers=3, persistent_workers=True),
        epochs=(None, None),
    ),
    Case(
        "non_persistent_shuffle_2_epochs_w2",
        lambda: SampleDataset(13, "tensor_wid"),
        lambda: dict(batch_size=2, shuffle=True, generator=gen(8), num_workers=2),
        epochs=(None, None),
    ),
    Case("map_empty_dataset_w2", lambda: SampleDataset(0), lambda: dict(batch_size=3, num_workers=2)),
    Case("iterable_empty_w2", lambda: RangeIterable(0, "tensor", "stride"), lambda: dict(batch_size=3, num_workers=2)),
    # --- IterableDataset ---------------------------------------------------------------------------
    Case("iterable_sharded_bs3_w2", lambda: RangeIterable(20, "tensor_wid", "stride"), lambda: dict(batch_size=3, num_workers=2)),
    Case("iterable_unsharded_duplicates_w2", lambda: RangeIterable(7, "tensor_wid", "none"), lambda: dict(batch_size=2, num_workers=2)),
    Case("iterable_uneven_w3", lambda: RangeIterable(31, "tensor_wid", "uneven"), lambda: dict(batch_size=2, num_workers=3)),
    Case("iterable_bs_none_w2", lambda: RangeIterable(9, "dtypes", "stride"), lambda: dict(batch_size=None, num_workers=2)),
    Case("iterable_drop_last_w2", lambda: RangeIterable(21, "mixed_big_small", "stride"), lambda: dict(batch_size=4, drop_last=True, num_workers=2)),
    Case("iterable_containers_prefetch1_w3", lambda: RangeIterable(14, "containers", "stride"), lambda: dict(batch_size=3, num_workers=3, prefetch_factor=1)),
    Case("iterable_rng_w2", lambda: RandomIterable(10), lambda: dict(batch_size=2, num_workers=2, generator=gen(17))),
    # --- worker RNG seeding --------------------------------------------------------------------------
    Case("rng_generator_bs2_w3", lambda: RandomDataset(15), lambda: dict(batch_size=2, generator=gen(42), num_workers=3)),
    Case("rng_global_seed_bs_none_w2", lambda: RandomDataset(6), lambda: dict(batch_size=None, num_workers=2), seed=5),
    Case(
        "rng_shuffle_generator_init_fn_w2",
        lambda: RandomDataset(10),
        lambda: dict(batch_size=3, shuffle=True, generator=gen(9), num_workers=2, worker_init_fn=record_init_state),
    ),
    # --- __getitems__ -----------------------------------------------------------------------------------
    Case("getitems_default_collate_w2", lambda: GetItemsDataset(13, "tensor"), lambda: dict(batch_size=5, num_workers=2)),
    Case(
        "getitems_batched_identity_w2",
        lambda: BatchedGetItemsDataset(13, "tensor"),
        lambda: dict(batch_size=4, num_workers=2, collate_fn=collate_identity),
    ),
    # --- in_order=False (order may legitimately differ: compared as multisets) ---------------------------
    Case(
        "unordered_map_w3",
        lambda: DelayedDataset(30, "tensor"),
        lambda: dict(batch_size=2, num_workers=3, in_order=False),
        ordered=False,
    ),
    Case(
        "unordered_iterable_w2",
        lambda: RangeIterable(15, "mixed_big_small", "uneven"),
        lambda: dict(batch_size=2, num_workers=2, in_order=False),
        ordered=False,
    ),
    Case(
        "unordered_persistent_2_epochs_w2",
        lambda: DelayedDataset(16, "python"),
        lambda: dict(batch_size=3, num_workers=2, in_order=False, persistent_workers=True),
        epochs=(None, None),
        ordered=False,
    ),
    # --- multiprocessing contexts --------------------------------------------------------------------
    Case(
        "context_fork_string_w2",
        lambda: SampleDataset(8, "tensor_wid"),
        lambda: dict(batch_size=3, num_workers=2, multiprocessing_context="fork"),
    ),
    Case(
        "context_spawn_map_rng_w2",
        lambda: RandomDataset(8),
        lambda: dict(batch_size=3, num_workers=2, multiprocessing_context="spawn", generator=gen(3)),
    ),
    Case(
        "context_forkserver_iterable_w2",
        lambda: RangeIterable(10, "mixed_big_small", "stride"),
        lambda: dict(batch_size=3, num_workers=2, multiprocessing_context="forkserver", worker_init_fn=record_init_state),
    ),
]

assert len({c.id for c in CASES}) == len(CASES), "duplicate case id"


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def run_loader(loader_cls, case: Case) -> list[list]:
    """Batches of every epoch of ``case`` through ``loader_cls``."""
    _seed_everything(case.seed)
    loader = loader_cls(case.dataset(), **case.kwargs())
    assert type(loader) is loader_cls
    epochs = []
    try:
        for max_batches in case.epochs:
            batches = []
            it = iter(loader)
            for batch in it:
                batches.append(batch)
                if max_batches is not None and len(batches) >= max_batches:
                    break
            del it
            epochs.append(batches)
    finally:
        it = getattr(loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        del loader
        gc.collect()
    return epochs


_TORCH_RESULTS: dict[str, list[list]] = {}


def torch_result(case: Case) -> list[list]:
    if case.id not in _TORCH_RESULTS:
        _TORCH_RESULTS[case.id] = run_loader(torch.utils.data.DataLoader, case)
    return _TORCH_RESULTS[case.id]


def assert_epochs_equal(expected: list[list], actual: list[list], ordered: bool) -> None:
    assert len(actual) == len(expected)
    for e, (exp, act) in enumerate(zip(expected, actual)):
        assert len(act) == len(exp), f"epoch {e}: {len(act)} batches, torch gave {len(exp)}"
        if not ordered:
            exp = sorted(exp, key=canonical)
            act = sorted(act, key=canonical)
        for b, (x, y) in enumerate(zip(exp, act)):
            assert_same(x, y, f"epoch {e} batch {b}", strides=True)


def test_enough_configurations():
    assert len(CASES) >= 40


PURE_TWIN_IS_SLOW = True  # (conftest.py: the full suite runs every case on both transports)


@pytest.mark.parametrize("case", [  # workers started by spawn or forkserver import torch anew
    pytest.param(c, id=c.id, marks=[pytest.mark.slow] * ("spawn" in c.id or "forkserver" in c.id))
    for c in CASES])
def test_same_batches_as_torch(case: Case, transport):
    for module in case.requires:
        pytest.importorskip(module)
    expected = torch_result(case)
    actual = run_loader(fastmm.DataLoader, case)
    assert_epochs_equal(expected, actual, case.ordered)


def test_torch_itself_is_deterministic_for_a_seeded_rng_case():
    """Guard for the method: a case compared exactly must give torch the same result twice."""
    case = next(c for c in CASES if c.id == "rng_generator_bs2_w3")
    assert_epochs_equal(run_loader(torch.utils.data.DataLoader, case), torch_result(case), ordered=True)
