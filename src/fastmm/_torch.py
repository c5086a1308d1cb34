"""Every private name of torch's that fastmm uses, and nothing else: a torch release that moves
one is a diff of this file alone. ``tests/test_torch_names.py`` fails naming the symbol that
moved (``PRIVATE`` lists them all); importing fastmm on such a torch says the same.

Why each is needed: fastmm's DataLoader subclasses torch's and replaces only its multi-process
iterator, so it builds on torch's iterator bases, fetchers, worker info, signal handling and
collation, exactly as torch's own iterator does.
"""

from __future__ import annotations

import importlib

import torch

PRIVATE: list[str] = []  # "module:name" of each private name below, as ``private`` found it


def private(name: str):
    """The object ``"module:name"`` names, or an ImportError naming it and this torch."""
    module, _, attr = name.partition(":")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"fastmm needs torch's private {module}.{attr}, which torch "
                          f"{torch.__version__} does not have; fastmm/_torch.py names what "
                          "it uses of torch's internals") from e
    if name not in PRIVATE:
        PRIVATE.append(name)
    return found


ExceptionWrapper = private("torch._utils:ExceptionWrapper")
DatasetKind = private("torch.utils.data:_DatasetKind")
MP_STATUS_CHECK_INTERVAL = private("torch.utils.data._utils:MP_STATUS_CHECK_INTERVAL")
collate = private("torch.utils.data._utils.collate:collate")
collate_tensor_fn = private("torch.utils.data._utils.collate:collate_tensor_fn")
default_collate_fn_map = private("torch.utils.data._utils.collate:default_collate_fn_map")
IterableDatasetFetcher = private("torch.utils.data._utils.fetch:_IterableDatasetFetcher")
MapDatasetFetcher = private("torch.utils.data._utils.fetch:_MapDatasetFetcher")
pin_memory = private("torch.utils.data._utils.pin_memory:pin_memory")
remove_worker_pids = private("torch.utils.data._utils.signal_handling:_remove_worker_pids")
set_sigchld_handler = private("torch.utils.data._utils.signal_handling:_set_SIGCHLD_handler")
set_worker_pids = private("torch.utils.data._utils.signal_handling:_set_worker_pids")
set_worker_signal_handlers = private(
    "torch.utils.data._utils.signal_handling:_set_worker_signal_handlers")
WorkerInfo = private("torch.utils.data._utils.worker:WorkerInfo")
IterableDatasetStopIteration = private(
    "torch.utils.data._utils.worker:_IterableDatasetStopIteration")
BaseDataLoaderIter = private("torch.utils.data.dataloader:_BaseDataLoaderIter")
MultiProcessingDataLoaderIter = private(
    "torch.utils.data.dataloader:_MultiProcessingDataLoaderIter")
SingleProcessDataLoaderIter = private("torch.utils.data.dataloader:_SingleProcessDataLoaderIter")
sharding_worker_init_fn = private("torch.utils.data.dataloader:_sharding_worker_init_fn")
T_co = private("torch.utils.data.dataloader:_T_co")  # the loader's signature's types
collate_fn_t = private("torch.utils.data.dataloader:_collate_fn_t")
worker_init_fn_t = private("torch.utils.data.dataloader:_worker_init_fn_t")
apply_random_seed = private("torch.utils.data.graph_settings:apply_random_seed")
private("torch.cuda:_is_in_bad_fork")  # called by is_in_bad_fork
private("torch.utils.data._utils.worker:_worker_info")  # set by set_worker_info
private("torch.utils.data._utils:python_exit_status")  # read by python_exiting
_worker_module = importlib.import_module("torch.utils.data._utils.worker")
_data_utils = importlib.import_module("torch.utils.data._utils")


def is_in_bad_fork() -> bool:
    """Whether CUDA was initialised before this process was forked (it cannot be used here);
    asked of torch at each call."""
    return torch.cuda._is_in_bad_fork()


def set_worker_info(info) -> None:
    """What ``torch.utils.data.get_worker_info()`` returns in this process from now on."""
    _worker_module._worker_info = info


def python_exiting() -> bool:
    """torch's flag that the interpreter is shutting down (then workers are not waited for);
    a module already torn down says so too."""
    return _data_utils is None or _data_utils.python_exit_status in (True, None)
