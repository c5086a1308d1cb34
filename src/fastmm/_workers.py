"""Worker processes: the same duties and seeding as torch's workers, slab transport instead of
a result queue of shared-memory segments. What they are told and answer: _messages.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
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
from torch.utils.data import IterDataPipe

from . import _batch_fill, _torch, collate, offers, resume
from ._messages import Restore, Result, Resume, Resumed, Stop, Task, WorkerSpec
from ._torch import DatasetKind, ExceptionWrapper
from .slabs import IDLE_TRIM_S, IDLE_WORKER_S, REFILL_S_PER_BYTE, SlabWriter

PARENT_CHECK_INTERVAL_S = 0.25
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
# Blocks up to this size come from the heap, where a freed one serves the next sample: past
# any decoded image under 4K x 4K (glibc's default starts at 128 KiB and only rises as mapped
# blocks are freed).
REUSE_MMAP_THRESHOLD = 32 << 20
# Free memory kept at the heap's top before it is returned: at least this much (a decoded photo
# or two, made and freed every sample), and twice the largest batch the worker has written (what
# a batch's samples free at once when they are held until it is collated). 256 MiB whatever the
# batch kept ~10 MiB a worker more than torch's on a PIL pipeline at batch 32 (issue 53).
REUSE_TRIM_FLOOR = 32 << 20


@functools.cache  # (a waiting worker trims after every batch: no dlopen each time)
def _libc(name: str):
    """The C library's function ``name`` (glibc's malloc calls), or None where it has none."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def give_back_free_heap() -> None:
    """Give the free memory on this process's heap back to the system (glibc's malloc_trim).

    A forked worker starts with the main process's heap as it was, its free memory included (a
    training step's freed activations, still in place for the next step). Those pages are
    shared until the main process writes them again; then every worker would keep the old
    copies for as long as it lives (about 35 MiB between two workers on a small CNN's loop,
    issue 53). A worker without work for IDLE_WORKER_S keeps no heap for samples that are not
    coming either. 19 ms for 250 MiB free in 64 KiB holes of an 800 MiB heap, on a 2-core VM."""
    trim = _libc("malloc_trim")
    if trim is not None:
        trim(0)


def reuse_freed_memory() -> bool:
    """Have glibc keep the memory this worker frees for its next samples: with its defaults a
    worker often gives a collated batch's samples back to the system (the heap's top is trimmed
    past a few MB, larger blocks are mappings of their own) and faults every page of the next
    batch's in again (docs/loader.md). True if glibc took the settings (False elsewhere:
    another libc, or none found)."""
    mallopt = _libc("mallopt")
    return (mallopt is not None and mallopt(_M_MMAP_THRESHOLD, REUSE_MMAP_THRESHOLD) == 1
            and mallopt(_M_TRIM_THRESHOLD, REUSE_TRIM_FLOOR) == 1)


def kept_heap_bytes(batch_bytes: int) -> int:
    """The free memory a worker keeps at its heap's top for batches of ``batch_bytes``: twice
    that (what a batch's samples free at once), at least REUSE_TRIM_FLOOR."""
    return max(REUSE_TRIM_FLOOR, 2 * batch_bytes)


def keep_free_heap_for(batch_bytes: int) -> None:
    """Keep ``kept_heap_bytes(batch_bytes)`` free at the heap's top, so that what a batch of
    that size frees serves the next (after ``reuse_freed_memory()``)."""
    mallopt = _libc("mallopt")
    if mallopt is not None:
        mallopt(_M_TRIM_THRESHOLD, kept_heap_bytes(batch_bytes))


def seed_all(seed: int) -> None:
    """Seed torch's CPU generator, random and NumPy (if it is there) from ``seed``: 15 us a
    batch (``torch.manual_seed`` also seeds every device's generators: 280 us)."""
    random.seed(seed)
    torch.default_generator.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed & 0xFFFFFFFF)


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
    its process (``_processes.start_on_a_lasting_thread``), so under fork and spawn that parent
    is the loader's process. Under forkserver the parent is the forkserver, which ends once no
    process holds its "alive" pipe, and each of its children inherits one: this worker closes
    its own, so the forkserver ends with the loader's process, and this worker with it. A
    daemon thread also waits for the end of the loader's process wherever the parent is another
    (it needs the GIL), or where the signal cannot be set (no prctl)."""
    parent = os.getppid()
    if start_method == "forkserver":
        _let_the_forkserver_end()
    if sys.platform.startswith("linux"):
        prctl = _libc("prctl")  # (None: no prctl in this libc; the thread below waits)
        if prctl is not None and prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent:  # it died before the signal was set
                os._exit(1)
            if main_pid in (None, parent):
                return
    loader_pid = parent if main_pid is None else main_pid

    def exit_with_it():
        try:
            pidfd = os.pidfd_open(loader_pid)  # readable the moment that process ends
        except (AttributeError, OSError):
            while _alive(loader_pid) and (main_pid is not None or os.getppid() == parent):
                time.sleep(PARENT_CHECK_INTERVAL_S)
        else:
            select.select([pidfd], [], [])
        os._exit(1)

    threading.Thread(target=exit_with_it, name="fastmm-orphan-check", daemon=True).start()


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


def worker_loop(spec: WorkerSpec) -> None:
    """A worker process's life: set up and seeded as torch sets up its workers, then one Result
    for each Task, until Stop or the loader's process is gone."""
    try:
        if spec.ready_conn is not None:  # (its imports are done)
            spec.ready_conn.send_bytes(os.getpid().to_bytes(8, "little"))
            spec.ready_conn.close()
        # Objects inherited from the main process (the dataset's lists, torch's modules) are
        # left out of this worker's garbage collections: a full collection writes into every
        # object it visits, which would copy each page holding one into this process.
        gc.freeze()
        give_back_free_heap()  # (what it inherited)
        if spec.share is not None:
            spec.share.install()
        _exit_when_orphaned(spec.start_method, spec.main_pid)
        _torch.set_worker_signal_handlers()
        reusing = spec.transport.worker_malloc == "reuse" and reuse_freed_memory()
        torch.set_num_threads(1)
        _Worker(spec, reusing).serve()
    except KeyboardInterrupt:
        pass
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass  # the main process went away; nothing is waiting for this worker's results
    finally:
        _torch.set_worker_info(None)


class _Outcome(NamedTuple):
    """What fetching a task gave: "data" (the batch), "error" (an ExceptionWrapper) or "end"
    (an IterableDataset ran out)."""

    status: str
    value: object = None


class _Worker:
    """One worker's state between tasks: its dataset and fetcher, its slab writer, and what
    it last sent of its RNG, iterator and skip-count states."""

    def __init__(self, spec: WorkerSpec, reusing: bool = False):
        self.spec = spec
        # glibc keeps freed memory for the next samples (reuse_freed_memory), as much as the
        # largest batch written so far calls for
        self.heap_kept_for = 0 if reusing else None
        worker_id = spec.worker_id
        seed = spec.base_seed + worker_id
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy as np

            np.random.seed(numpy_seed(spec.base_seed, worker_id))
        except ImportError:
            pass
        self.shared_rng = torch.Generator()
        self.dataset = spec.dataset
        if isinstance(self.dataset, IterDataPipe):
            self.shared_rng.manual_seed(spec.shared_seed)
            self.dataset = _torch.apply_random_seed(self.dataset, self.shared_rng)
        # User code calls torch.utils.data.get_worker_info(): it must see this worker.
        _torch.set_worker_info(_torch.WorkerInfo(
            id=worker_id, num_workers=spec.num_workers, seed=seed, dataset=self.dataset))
        self.writer = SlabWriter(spec.fd_sock, spec.transport)
        self.collate = collate.worker_collate_fn(spec.collate_fn, self.writer)
        # default-collated batches get their samples copied into the slab as they are made
        self.fills = spec.auto_collation and collate.is_default(spec.collate_fn)
        self.init_error = None
        self.fetcher = None
        try:
            if spec.init_fn is not None:
                spec.init_fn(worker_id)
            self.fetcher = _restore(self.make_fetcher, self.dataset, spec.restore)
        except Exception:
            self.init_error = self.error()
        self.rng_changes = resume.SentOnChange(resume.capture_rng)
        counters = offers.skip_counts(self.dataset)
        self.counts_changes = resume.SentOnChange(
            lambda _: None if counters is None else counters.row(worker_id))
        self.ended = False  # its IterableDataset ran out this epoch
        self.result_sent_at: float | None = None  # when it sent its last result this epoch

    def error(self):
        return ExceptionWrapper(where=f"in DataLoader worker process {self.spec.worker_id}")

    def make_fetcher(self):
        fetcher = _MapFetcher if self.spec.dataset_kind == DatasetKind.Map else _IterableFetcher
        return fetcher(self.dataset, self.spec.auto_collation, self.collate, self.spec.drop_last)

    def serve(self) -> None:
        idle_timeout = IDLE_WORKER_S
        while True:
            try:
                message = self.spec.index_queue.get(timeout=idle_timeout)
            except queue.Empty:
                if self.spec.done_event.is_set():  # told to stop, but Stop is not coming
                    break
                if idle_timeout == IDLE_WORKER_S:  # no work for a while: unmap the slabs here
                    self.writer.trim()  # and keep no free heap for the next samples
                    give_back_free_heap()
                idle_timeout = _torch.MP_STATUS_CHECK_INTERVAL
                continue
            idle_timeout = IDLE_WORKER_S
            if isinstance(message, Stop):
                break
            if isinstance(message, Resume):
                self.resume(message)
            elif not (self.spec.done_event.is_set() or self.ended):
                self.answer(message)

    def resume(self, message: Resume) -> None:
        self.spec.result_conn.send(Resumed())
        self.ended = False
        self.result_sent_at = None
        if isinstance(self.dataset, IterDataPipe):
            self.shared_rng.manual_seed(message.shared_seed)
            self.dataset = _torch.apply_random_seed(self.dataset, self.shared_rng)
        if message.epoch is not None:
            self.dataset.set_epoch(message.epoch)
        self.fetcher = self.make_fetcher()

    def answer(self, task: Task) -> None:
        """Fetch, collate and pack the task's batch into slabs, and send its Result."""
        waited_s = 0.0 if self.result_sent_at is None else time.monotonic() - self.result_sent_at
        self.writer.loop_spare_s = task.spare_s
        self.writer.begin()
        if self.init_error is not None:  # worker_init_fn raised: the first task says so
            outcome, self.init_error = _Outcome("error", self.init_error), None
        else:
            index = task.index
            if task.seed is not None:  # "auto": draws by the batch, whichever worker makes it
                seed_all(task.seed)
            size = len(index) if self.fills and hasattr(index, "__len__") else None
            with collate.filling(size, self.writer):
                outcome = self.fetch(index)
            self.ended = outcome.status == "end"
        iter_state = None
        if self.spec.dataset_kind == DatasetKind.Iterable and outcome.status != "error":
            # what a resumed or replacement worker goes on from (resume.py)
            iter_state = resume.iter_state(self.dataset, self.fetcher, ran_out=self.ended,
                                         sent=True)
        status = outcome.status
        try:
            payload = collate.pack(outcome.value, self.writer) if status != "end" else None
        except Exception:
            payload, status = collate.pack(self.error(), self.writer), "error"
        del outcome
        used, new = self.writer.finish()
        if self.heap_kept_for is not None and self.writer.batch_bytes > self.heap_kept_for:
            self.heap_kept_for = self.writer.batch_bytes
            keep_free_heap_for(self.heap_kept_for)
        # RNG states encoded here, so the main process's state_dict() (maybe every step) only
        # copies them
        rng = self.rng_changes.changed() if task.seed is None else None
        # plain pickle (ForkingPickler.dumps, as Connection.send, without its reducers: 4 us)
        self.spec.result_conn.send_bytes(pickle.dumps(
            Result(task.send_idx, status, payload, used, new,
                   None if rng is None else resume.encode_rng(rng),
                   iter_state, self.counts_changes.changed(), waited_s), pickle.DEFAULT_PROTOCOL))
        self.result_sent_at = time.monotonic()
        # A worker that waits for its tasks (the loop's step is the bottleneck) has the time to
        # fault its heap in again: it keeps no free heap between batches, as its slabs.
        kept = kept_heap_bytes(self.writer.batch_bytes)  # at most, at the heap's top
        if waited_s >= max(IDLE_TRIM_S, 3 * REFILL_S_PER_BYTE * kept):
            give_back_free_heap()

    def fetch(self, index) -> _Outcome:
        try:
            return _Outcome("data", self.fetcher.fetch(index))
        except StopIteration:
            if self.spec.dataset_kind == DatasetKind.Iterable:
                return _Outcome("end")
            return _Outcome("error", self.error())
        except Exception:
            return _Outcome("error", self.error())


class _MapFetcher(_torch.MapDatasetFetcher):
    """torch's fetcher for map-style datasets, handing each sample to the batch as it is made
    (_batch_fill.py) where the dataset has no ``__getitems__``."""

    def fetch(self, possibly_batched_index):
        if not self.auto_collation or getattr(self.dataset, "__getitems__", None):
            return super().fetch(possibly_batched_index)
        with _batch_fill.sample_by_sample() as put:
            data = [put(self.dataset[idx], i) for i, idx in enumerate(possibly_batched_index)]
        return self.collate_fn(data)


class _IterableFetcher(_torch.IterableDatasetFetcher):
    """torch's fetcher for iterable datasets, handing each sample to the batch as it is made."""

    def fetch(self, possibly_batched_index):
        if self.ended or not self.auto_collation:
            return super().fetch(possibly_batched_index)
        data = []
        with _batch_fill.sample_by_sample() as put:
            for position, _ in enumerate(possibly_batched_index):
                try:
                    data.append(put(next(self.dataset_iter), position))
                except StopIteration:
                    self.ended = True
                    break
        if not data or (self.drop_last and len(data) < len(possibly_batched_index)):
            raise StopIteration
        return self.collate_fn(data)


def _restore(make_fetcher, dataset, restore: Restore):
    """A restored worker's fetcher: its IterableDataset goes on from the iterator state it had
    after its last batch handed out, or pulls and drops the samples it had handed out (which
    brings a deterministic iterator to the same place); then the RNG states it had then."""
    fetcher = resume.resumed_fetcher(make_fetcher, dataset, restore.iter_state)
    for _ in range(restore.skip):
        try:
            next(fetcher.dataset_iter)
        except StopIteration:
            fetcher.ended = True
            break
    if restore.rng is not None:
        resume.apply_rng(resume.decode_rng(restore.rng))
    return fetcher
