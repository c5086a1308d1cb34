"""Worker processes: the same duties and seeding as torch's workers, slab transport instead of
a result queue of shared-memory segments.

Messages from the main process (on the worker's index queue):
  ("task", send_idx, index, spare)  fetch and collate one batch (or one sample); spare: seconds
                                   the loop spent outside next() last step (see slabs.py)
  ("resume", shared_seed, epoch)   a new epoch on persistent workers; epoch: the main process's
                                   hooks.epoch, passed on to this copy (else None)
  None                             exit
Messages to the main process (on the worker's result connection): a Result for each task;
  ("resumed",) acknowledges a resume. New slabs' descriptors are sent on the fd socket first;
  the pool's news comes on that socket too (slabs.SlabWriter._sync).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import pickle
import queue
import random
import select
import signal
import sys
import threading
import time
from typing import NamedTuple

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import IterDataPipe, _DatasetKind
from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL, signal_handling
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data._utils.fetch import _IterableDatasetFetcher, _MapDatasetFetcher
from torch.utils.data.graph_settings import apply_random_seed

from . import _streaming, collate, hooks, resume
from .slabs import IDLE_WORKER_S, SlabWriter

PARENT_CHECK_INTERVAL_S = 0.25
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
# Blocks up to this size come from the heap, where a freed one serves the next sample: past
# any decoded image under 4K x 4K (glibc's default starts at 128 KiB and only rises as mapped
# blocks are freed).
REUSE_MMAP_THRESHOLD = 32 << 20
REUSE_TRIM_THRESHOLD = 256 << 20  # free memory kept at the heap's top before it is returned


def reuse_freed_memory() -> bool:
    """Have glibc keep the memory this worker frees for its next samples: with its defaults a
    worker often gives a collated batch's samples back to the system (the heap's top is trimmed
    past a few MB, larger blocks are mappings of their own) and faults every page of the next
    batch's in again (docs/loader.md). True if glibc took the settings (False elsewhere:
    another libc, or none found)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return (mallopt(_M_MMAP_THRESHOLD, REUSE_MMAP_THRESHOLD) == 1
            and mallopt(_M_TRIM_THRESHOLD, REUSE_TRIM_THRESHOLD) == 1)


def numpy_seed(base_seed: int, worker_id: int) -> list[int]:
    """The NumPy seed torch gives worker ``worker_id``: a SeedSequence-style hash of both."""
    mask = 0xFFFFFFFF
    shift = 16
    mult_a, mult_b = 0x931E8875, 0x58F38DED
    mix_l, mix_r = 0xCA01F9DD, 0x4973F715
    const_a = 0x43B0D7E5

    def hash_a(value: int) -> int:
        nonlocal const_a
        value = (value ^ const_a) & mask
        const_a = (const_a * mult_a) & mask
        value = (value * const_a) & mask
        return (value ^ (value >> shift)) & mask

    def mix(x: int, y: int) -> int:
        result = ((mix_l * x) & mask) - ((mix_r * y) & mask)
        result &= mask
        return (result ^ (result >> shift)) & mask

    entropy = [worker_id, base_seed & mask, base_seed >> 32, 0]
    pool = [hash_a(e) for e in entropy]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hash_a(pool[src]))
    const_b = 0x8B51F9DD
    state = []
    for value in pool:
        value = (value ^ const_b) & mask
        const_b = (const_b * mult_b) & mask
        value = (value * const_b) & mask
        state.append((value ^ (value >> shift)) & mask)
    return state


class Result(NamedTuple):
    """A worker's answer to a task."""

    send_idx: int
    status: str  # "data", "error" (payload: an ExceptionWrapper) or "end" (an iterable ran out)
    payload: object  # collate.pack's
    used: list  # the slots of the slabs the payload lies in
    new: list  # (slot, generation, capacity) of slabs created for it (fds: on the fd socket)
    rng: object  # the worker's RNG states after the task if it changed them, else None
    stream: object  # an IterableDataset's resume.stream_state() after the task (resume.py)
    counts: object  # its row of the dataset's skip counts (hooks.py) if the task changed it


class StopFlag:
    """The loader's "workers, stop" signal: one shared byte, read and written without a lock.
    A multiprocessing.Event takes a lock inside is_set(); a worker killed while holding it
    (respawn, the decode deadline) left every other worker blocked on it forever."""

    def __init__(self, context):
        self._value = context.RawValue("b", 0)

    def set(self) -> None:
        self._value.value = 1

    def is_set(self) -> bool:
        return bool(self._value.value)


def _exit_when_orphaned(start_method: str, main_pid: int | None) -> None:
    """End this worker when the loader's process dies, even while user code is stuck in C with
    the GIL held: no worker outlives a ``kill -9`` of that process by more than a moment.

    Linux sends SIGKILL the moment the worker's parent thread ends (PR_SET_PDEATHSIG), with no
    help from this process. The loader starts its workers from a thread that lives as long as
    its process (``_pool.start_on_a_lasting_thread``), so under fork and spawn that parent
    is the loader's process. Under forkserver the parent is the forkserver, which ends once no
    process holds its "alive" pipe, and each of its children inherits one: this worker closes
    its own, so the forkserver ends with the loader's process, and this worker with it. A
    daemon thread also watches the loader's process wherever the parent is another (it needs
    the GIL), or where the signal cannot be set (no prctl)."""
    parent = os.getppid()
    if start_method == "forkserver":
        _let_the_forkserver_end()
    if sys.platform.startswith("linux"):
        try:
            signalled = ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):  # no prctl in this libc: the thread below watches
            signalled = False
        if signalled:
            if os.getppid() != parent:  # it died before the signal was set
                os._exit(1)
            if main_pid in (None, parent):
                return
    watched = parent if main_pid is None else main_pid

    def watch():
        try:
            pidfd = os.pidfd_open(watched)  # readable the moment that process ends
        except (AttributeError, OSError):
            while _alive(watched) and (main_pid is not None or os.getppid() == parent):
                time.sleep(PARENT_CHECK_INTERVAL_S)
        else:
            select.select([pidfd], [], [])
        os._exit(1)

    threading.Thread(target=watch, name="fastmm-orphan-watch", daemon=True).start()


def _let_the_forkserver_end() -> None:
    """Close this worker's copy of the forkserver's "alive" pipe (multiprocessing hands one to
    every process the forkserver starts, for processes of their own): while any copy is open,
    the forkserver outlives the loader's process. A worker that starts processes through
    forkserver afterwards starts a forkserver of its own."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # there, another user's (it cannot be ours then, but be safe)
        pass
    return True


def worker_loop(
    dataset_kind,
    dataset,
    index_queue,
    result_conn,
    fd_sock,
    done_event,
    auto_collation,
    collate_fn,
    drop_last,
    base_seed,
    init_fn,
    worker_id,
    num_workers,
    shared_seed,
    transport,
    restore=(None, 0, None),
    start_method="fork",
    main_pid=None,
):
    try:
        # Objects inherited from the main process (the dataset's lists, torch's modules) are
        # left out of this worker's garbage collections: a full collection writes into every
        # object it visits, which would copy each page holding one into this process.
        gc.freeze()
        _exit_when_orphaned(start_method, main_pid)
        signal_handling._set_worker_signal_handlers()
        if transport.worker_malloc == "reuse":
            reuse_freed_memory()
        torch.set_num_threads(1)
        seed = base_seed + worker_id
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy as np

            np.random.seed(numpy_seed(base_seed, worker_id))
        except ImportError:
            pass

        shared_rng = torch.Generator()
        if isinstance(dataset, IterDataPipe):
            shared_rng.manual_seed(shared_seed)
            dataset = apply_random_seed(dataset, shared_rng)

        # User code calls torch.utils.data.get_worker_info(): it must see this worker.
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset
        )
        writer = SlabWriter(fd_sock, transport)
        collate.set_writer(writer)
        slab_collate = collate.worker_collate_fn(collate_fn)

        def make_fetcher():
            fetcher = _MapFetcher if dataset_kind == _DatasetKind.Map else _IterableFetcher
            return fetcher(dataset, auto_collation, slab_collate, drop_last)

        # default-collated batches stream their samples into the slab as they are made
        streams = auto_collation and collate.is_default(collate_fn)

        init_exception = None
        fetcher = None
        try:
            if init_fn is not None:
                init_fn(worker_id)
            fetcher = _restore(make_fetcher, dataset, *restore)
        except Exception:
            init_exception = ExceptionWrapper(where=f"in DataLoader worker process {worker_id}")
        rng_watch = resume.Watch(resume.capture_rng)
        counters = hooks.skip_counts(dataset)
        counts_watch = resume.Watch(lambda _: None if counters is None else counters.row(worker_id))

        iteration_end = False
        idle_timeout = IDLE_WORKER_S
        while True:
            try:
                message = index_queue.get(timeout=idle_timeout)
            except queue.Empty:
                if done_event.is_set():  # told to stop, but the exit message is not coming
                    break
                if idle_timeout == IDLE_WORKER_S:  # no work for a while: unmap the slabs here
                    writer.trim()
                idle_timeout = MP_STATUS_CHECK_INTERVAL
                continue
            idle_timeout = IDLE_WORKER_S
            if message is None:
                break
            if message[0] == "resume":
                result_conn.send(("resumed",))
                iteration_end = False
                if isinstance(dataset, IterDataPipe):
                    shared_rng.manual_seed(message[1])
                    dataset = apply_random_seed(dataset, shared_rng)
                if message[2] is not None:
                    dataset.set_epoch(message[2])
                fetcher = make_fetcher()
                continue
            if done_event.is_set() or iteration_end:
                continue
            _, send_idx, index, writer.loop_spare_s = message
            writer.begin()
            if init_exception is not None:
                result, init_exception = ("error", init_exception), None
            else:
                size = len(index) if streams and hasattr(index, "__len__") else None
                with collate.streaming(size):
                    result = _fetch(fetcher, index, dataset_kind, worker_id)
                if result[0] == "end":
                    iteration_end = True
            stream = None
            if dataset_kind == _DatasetKind.Iterable and result[0] in ("data", "end"):
                # what a resumed or replacement worker goes on from (resume.py)
                stream = resume.stream_state(dataset, fetcher, ran_out=result[0] == "end",
                                             sent=True)
            try:
                payload = collate.pack(result[1], writer) if result[0] != "end" else None
                status = result[0]
            except Exception:
                payload = collate.pack(
                    ExceptionWrapper(where=f"in DataLoader worker process {worker_id}"), writer
                )
                status = "error"
            del result
            used, new = writer.finish()
            # plain pickle (ForkingPickler.dumps, as Connection.send, without its reducers: 4 us)
            result_conn.send_bytes(pickle.dumps(
                Result(send_idx, status, payload, used, new, rng_watch.changed(),
                       stream, counts_watch.changed()), pickle.DEFAULT_PROTOCOL))
            del payload, message, index
    except KeyboardInterrupt:
        pass
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass  # the main process went away; nothing is waiting for this worker's results
    finally:
        torch_worker._worker_info = None
        collate.set_writer(None)


class _MapFetcher(_MapDatasetFetcher):
    """torch's fetcher for map-style datasets, handing each sample to the batch as it is made
    (_streaming.py) where the dataset has no ``__getitems__``."""

    def fetch(self, possibly_batched_index):
        if not self.auto_collation or getattr(self.dataset, "__getitems__", None):
            return super().fetch(possibly_batched_index)
        with _streaming.sample_by_sample() as put:
            data = [put(self.dataset[idx], i) for i, idx in enumerate(possibly_batched_index)]
        return self.collate_fn(data)


class _IterableFetcher(_IterableDatasetFetcher):
    """torch's fetcher for iterable datasets, handing each sample to the batch as it is made."""

    def fetch(self, possibly_batched_index):
        if self.ended or not self.auto_collation:
            return super().fetch(possibly_batched_index)
        data = []
        with _streaming.sample_by_sample() as put:
            for position, _ in enumerate(possibly_batched_index):
                try:
                    data.append(put(next(self.dataset_iter), position))
                except StopIteration:
                    self.ended = True
                    break
        if not data or (self.drop_last and len(data) < len(possibly_batched_index)):
            raise StopIteration
        return self.collate_fn(data)


def _restore(make_fetcher, dataset, rng_state, skip_items: int, stream: tuple | None):
    """A restored worker's fetcher: its IterableDataset goes on from the stream state it had
    after its last batch handed out, or pulls and drops the samples it had handed out (which
    brings a deterministic iterator to the same place); then the RNG states it had then."""
    fetcher = resume.resumed_fetcher(make_fetcher, dataset, stream)
    for _ in range(skip_items):
        try:
            next(fetcher.dataset_iter)
        except StopIteration:
            fetcher.ended = True
            break
    if rng_state is not None:
        resume.apply_rng(rng_state)
    return fetcher


def _fetch(fetcher, index, dataset_kind, worker_id):
    try:
        return ("data", fetcher.fetch(index))
    except StopIteration:
        if dataset_kind == _DatasetKind.Iterable:
            return ("end", None)
        return ("error", ExceptionWrapper(where=f"in DataLoader worker process {worker_id}"))
    except Exception:
        return ("error", ExceptionWrapper(where=f"in DataLoader worker process {worker_id}"))
