"""fastmm.DataLoader: torch's DataLoader with a multi-process iterator that moves batches
through a pool of reused shared-memory slabs.

It subclasses ``torch.utils.data.DataLoader``, so the signature, defaults, argument errors,
samplers, ``len()`` and the single-process path are torch's own, and ``isinstance(loader,
torch.utils.data.DataLoader)`` holds for tools that inspect or rebuild loaders. Only the
multi-process iterator is replaced; it keeps torch's observable rules: which worker gets which
batch, the order batches come back (``in_order``), the base seed drawn from ``generator`` and
the per-worker seeds, ``persistent_workers``, ``prefetch_factor`` and ``timeout``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import multiprocessing.connection
import operator
import os
import select
import time
import types
from collections.abc import Iterable

import torch
import torch.multiprocessing
import torch.utils.data
from torch.utils.data import Dataset, IterDataPipe, MapDataPipe, Sampler, _DatasetKind
from torch.utils.data import _utils as torch_utils
from torch.utils.data.dataloader import (
    _BaseDataLoaderIter,
    _collate_fn_t,
    _MultiProcessingDataLoaderIter,
    _sharding_worker_init_fn,
    _SingleProcessDataLoaderIter,
    _T_co,
    _worker_init_fn_t,
)

from . import collate, hooks, resume
from ._pool import STATUS_CHECK_INTERVAL_S, WorkerPool, how_it_ended
from .config import TransportConfig
from .slabs import SlabPool, cuda_page_locking
from .telemetry import auto as auto_export
from .telemetry.recorder import unwatched

log = logging.getLogger("fastmm")
_MAX_DEATHS_PER_TASK = 3  # a batch that kills a worker this often is the batch's fault
class _Received:
    """A batch as a worker sent it, rebuilt (collate.unpack) as it is handed out: an error in
    rebuilding it (an object that unpickles only in workers) is then that batch's, raised in its
    turn with the loader's account of it done, and the epoch goes on."""

    __slots__ = ("payload", "views", "worker_id")

    def __init__(self, payload, views: dict, worker_id: int):
        self.payload, self.views, self.worker_id = payload, views, worker_id

    def rebuild(self):
        try:
            return collate.unpack(self.payload, self.views)
        except Exception as e:
            e.add_note(f"(raised in the main process, rebuilding a batch from DataLoader "
                       f"worker {self.worker_id})")
            raise


class DataLoader(torch.utils.data.DataLoader[_T_co]):
    __doc__ = (
        "Drop-in replacement for :class:`torch.utils.data.DataLoader` (same arguments, same "
        "behaviour) whose worker processes hand batches over through reused shared-memory "
        "slabs instead of a new shared-memory segment per tensor per batch.\n\n"
        + (torch.utils.data.DataLoader.__doc__ or "")
    )

    def __init__(
        self,
        dataset: Dataset[_T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler | Iterable | None = None,
        batch_sampler: Sampler[list] | Iterable[list] | None = None,
        num_workers: int = 0,
        collate_fn: _collate_fn_t | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: _worker_init_fn_t | None = None,
        multiprocessing_context=None,
        generator=None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        snapshot_every_n_steps: int | None = 1,
        on_worker_failure: str = "raise",
    ) -> None:
        """torch's arguments, plus:

        ``snapshot_every_n_steps``: torchdata's StatefulDataLoader argument (how often workers
        send their state), accepted so its users change only the import. fastmm's workers send
        what changed in their state with every batch, so ``state_dict()`` is exact at any step
        whatever the value; it is checked (an int of 0 or more, or None) and kept, nothing more.

        ``on_worker_failure``: "raise" (torch's behaviour: a worker killed by a signal or gone
        is an error naming it) or "respawn" (a new worker takes its place and gets its
        unfinished batches again, from its RNG states: nothing lost or repeated, the same
        batches in the same order as without the failure).

        ``num_workers`` and ``prefetch_factor`` must be whole numbers: torch takes 2.5 here and
        fails at the first ``iter()``; fastmm says so now (the same TypeError)."""
        if on_worker_failure not in ("raise", "respawn"):
            raise ValueError(f"on_worker_failure={on_worker_failure!r}; use 'raise' or 'respawn'")
        num_workers = _whole_number("num_workers", num_workers)
        if prefetch_factor is not None:
            prefetch_factor = _whole_number("prefetch_factor", prefetch_factor)
        if snapshot_every_n_steps is not None:
            snapshot_every_n_steps = _whole_number("snapshot_every_n_steps",
                                                   snapshot_every_n_steps)
            if snapshot_every_n_steps < 0:  # (torchdata: 0 or None, only when state is asked)
                raise ValueError("snapshot_every_n_steps should be a non-negative integer or "
                                 f"None, but got snapshot_every_n_steps={snapshot_every_n_steps}")
        super().__init__(
            dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
            pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device, in_order=in_order,
        )
        self.on_worker_failure = on_worker_failure
        self.snapshot_every_n_steps = snapshot_every_n_steps

    def __iter__(self):
        # FASTMM_TELEMETRY=summary|trace: the epoch watched and exported (telemetry/auto.py)
        return auto_export.epoch(self, super().__iter__)

    def _get_iterator(self):
        restore = self.__dict__.pop("_fastmm_restore", None)
        if self.num_workers == 0:
            return _SingleProcessIter(self, restore)
        _call_as_torch(self.check_worker_number_rationality)
        from . import doctor  # (not at import: python -m fastmm.doctor runs it as __main__)

        doctor.warn_once(self.__dict__.setdefault("_fastmm_findings", set()),
                         doctor.loader_findings(self))
        return _SlabDataLoaderIter(self, restore)

    def state_dict(self) -> dict:
        """Where the loader is in its epoch, as a small JSON-serialisable dict: a new loader
        given it by ``load_state_dict`` yields exactly the batches this one would yield next
        (same samples, order and augmentation draws). With ``in_order=False``: the samples
        not handed out yet, each once, in the order the workers finish them."""
        return resume.encode(self, self.__dict__.get("_fastmm_progress"))

    def load_state_dict(self, state: dict) -> None:
        """Start the next iteration where ``state`` (from ``state_dict``) was taken. Raises
        ValueError if this loader differs in a way that would change the batches left in a
        started epoch (workers, batch size, dataset length, world size, ...)."""
        progress = resume.decode(self, state)
        if self._iterator is not None:  # persistent workers of the old position: start anew
            self._iterator._shutdown_workers()
            self._iterator = None
        self.__dict__["_fastmm_restore"] = progress
        self.__dict__["_fastmm_progress"] = progress




def _whole_number(name: str, value):
    """``value`` as an int (bools and NumPy integers too), or a TypeError naming ``name``."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} should be an integer, but got {name}={value!r} "
                        f"({type(value).__name__})") from None


def _call(fn, *args):
    return fn(*args)


# _call with torch.utils.data.dataloader's globals: a warning raised in its frame (torch's, at
# stacklevel=2: too many workers, pin_memory without an accelerator; fastmm's in torch's words)
# belongs to torch's module, as with torch's loader, so a training script's
# filterwarnings(..., module="torch.utils.data.dataloader") still silences it.
_call_as_torch = types.FunctionType(_call.__code__, vars(torch.utils.data.dataloader),
                                    "_call_as_torch")


def _readable(conn) -> bool:
    """``conn.poll()`` for less: that builds a selector each call."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return bool(poller.poll(0))


class _ResumableIter:
    """What both iterators add to torch's for ``state_dict``: progress kept on the loader, the
    sampler replayed on restore, and a restored base seed drawn without trace."""

    def _start_progress(self, loader, restore: resume.Progress | None, init) -> None:
        if restore is not None and (restore.mid_epoch or restore.base_seed is not None):
            with resume.KeepRng(loader.generator):  # those draws were made before the save
                _call_as_torch(init, loader)
            if restore.base_seed is not None:
                self._base_seed = restore.base_seed
        else:
            _call_as_torch(init, loader)
        progress = resume.Progress(loader.num_workers, base_seed=self._base_seed)
        if restore is not None:
            if restore.base_seed is not None:
                progress.worker_rng = list(restore.worker_rng)
            if restore.mid_epoch:  # the sampler tap skips what was handed out
                progress.batches, progress.ahead = restore.batches, set(restore.ahead)
                progress.worker_batches = list(restore.worker_batches)
                progress.worker_streams = list(restore.worker_streams)
                progress.last_worker = restore.last_worker
            elif restore.base_seed is not None:  # the same persistent workers, a new epoch
                progress.worker_streams = resume.carried_streams(restore.worker_streams)
        self._progress = loader.__dict__["_fastmm_progress"] = progress
        self._first_sampler_iter = resume.SamplerTap(loader, progress, restore)

    def _note_epoch_start(self) -> None:
        """Keep an IterableDataset's own state as the epoch begins: a restored loader loads it,
        then each worker's stream state over it (or pulls the samples handed out again, which
        would move a position the dataset keeps and count its bad samples twice if the state
        were the one at state_dict())."""
        if self._dataset_kind == _DatasetKind.Iterable:
            self._progress.dataset_state = resume.dataset_state(self._dataset)

    def _next_data(self):
        # (not __next__: torch's warnings there name its caller, which must be the user's loop)
        try:
            return self._next_batch()
        except StopIteration:
            self._progress.done = True
            raise


class _SingleProcessIter(_ResumableIter, _SingleProcessDataLoaderIter):
    def __init__(self, loader: DataLoader, restore: resume.Progress | None) -> None:
        self._start_progress(loader, restore, super().__init__)
        self._sampler_iter = self._first_sampler_iter
        self._note_epoch_start()
        if restore is not None and restore.mid_epoch and self._dataset_kind == _DatasetKind.Iterable:
            stream = restore.worker_streams[0]
            if stream is not None:  # the stream goes on from its own state
                self._dataset_fetcher = resume.resumed_fetcher(lambda: _DatasetKind.create_fetcher(
                    self._dataset_kind, self._dataset, self._auto_collation, self._collate_fn,
                    self._drop_last), self._dataset, stream)
            else:
                with resume.KeepRng():  # pull and drop what was handed out; its draws were made
                    for _ in range(restore.batches):
                        self._dataset_fetcher.fetch(next(self._sampler_iter))
        elif self._dataset_kind == _DatasetKind.Iterable:
            # the state before the first batch: a stream may keep the caller's RNG state in it
            try:
                self._note_stream()
            except Exception:
                pass  # one whose state exists only once iterated: asked after each batch

    def _next_index(self):
        index = super()._next_index()
        self._progress.batches += 1
        return index

    def _next_batch(self):
        data = _SingleProcessDataLoaderIter._next_data(self)
        if self._dataset_kind == _DatasetKind.Iterable:
            self._note_stream()
        return data

    def _note_stream(self) -> None:
        self._progress.worker_streams[0] = resume.stream_state(self._dataset, self._dataset_fetcher)


_PENDING = object()  # a task's data before its result came


@dataclasses.dataclass
class _Task:
    """A batch sent to a worker, until it is handed out."""

    worker_id: int
    index: object  # its indices (sent again to a replacement if its worker dies)
    position: int | None  # its batch's place in the epoch's order (resume.py)
    data: object = _PENDING  # its result, when it came before its turn
    rng: object = None  # the worker's RNG states after it
    stream: object = None  # the worker's stream state after it
    counts: object = None  # the worker's skip counts after it
    deaths: int = 0  # workers that died while it was theirs

    @property
    def pending(self) -> bool:
        return self.data is _PENDING


@dataclasses.dataclass
class _WorkerRecord:
    """What the iterator keeps of one worker from its last batch received: where a replacement
    starts from (resume.py), and its part of the epoch so far. (Its scheduling state keeps
    torch's names: ``_workers_status``, ``_workers_num_tasks``.)"""

    rng: object = None  # its RNG states after that batch
    stream: object = None  # its IterableDataset's stream state then (a respawn goes on from it)
    end_stream: object = None  # its stream state as its epoch ran out
    counts: object = None  # its row of the dataset's skip counts then (hooks.py)
    epoch_counts: object = None  # that row as the epoch began
    received: int = 0  # batches received from it this epoch


class _Replacing:
    """Part of the multi-process iterator: a worker started, or started again in the place of
    one that died (on_worker_failure="respawn") or was stuck past the decode deadline, from
    what the iterator kept of it after its last batch received (RNG states, stream state, skip
    counts), and given its unfinished tasks again."""

    def _start_worker(self, worker_id: int, restore: tuple) -> None:
        if self._counters is not None:  # its row as it starts
            self._records[worker_id].counts = self._counters.row(worker_id)
        self._pool.start(worker_id, restore, self._shared_seed)

    def _replace_worker(self, worker_id: int, fault: bool = True) -> None:
        """A new worker in the place of a dead one (on_worker_failure="respawn") or of one
        stuck past the decode deadline (``fault=False``: not counted against its batch), from
        the RNG states after the last batch received from it (an IterableDataset worker also
        goes on from its stream state then, or pulls and drops what was received), given the
        old one's unfinished tasks again, in order."""
        lost = sorted(i for i, task in self._tasks.items()
                      if task.worker_id == worker_id and task.pending)
        for i in lost if fault else ():
            self._tasks[i].deaths += 1
            if self._tasks[i].deaths > _MAX_DEATHS_PER_TASK:
                why = how_it_ended(self._workers[worker_id].exitcode)
                raise RuntimeError(
                    f"DataLoader worker {worker_id} died {self._tasks[i].deaths} times on the "
                    f"same batch (indices {self._tasks[i].index}; last: {why}); not respawning"
                )
        self._replacements += 1
        self._pool.end(worker_id)
        record = self._records[worker_id]
        stream = resume.usable(record.stream)
        skip = 0 if stream is not None else self._samples_in(record.received)
        if self._counters is not None and self._num_workers < self._counters.ROWS:
            # what it counted in tasks whose batches were lost, the replacement counts again;
            # pulling and dropping, it counts again what it met before them as well
            self._counters.set_row(worker_id, record.epoch_counts if skip else record.counts)
        self._start_worker(worker_id, (record.rng, skip, stream))
        self._awaiting_resume.discard(worker_id)
        for i in lost:
            self._index_queues[worker_id].put(("task", i, self._tasks[i].index, 0.0))

    def _replace_stuck_workers(self) -> list[int]:
        """Workers on one sample past the decode deadline: the sample is marked expired (the
        replacement meets it first and counts it, by the dataset's bad-input policy), the
        worker is killed and replaced. A decoder stuck in C can be stopped no other way."""
        active = [i for i in range(self._num_workers) if self._workers_status[i]]
        stuck = [(watch, worker_id, item) for watch in self._watches
                 for worker_id, item in watch.overdue(active)]
        for watch, worker_id, item in stuck:
            if not watch.expire(item, worker_id):
                raise RuntimeError(
                    f"more than {watch.CAP} samples took over decode_deadline="
                    f"{watch.deadline:g}s: the deadline is too short for this data, or "
                    "the decoder is broken")
            log.warning("fastmm: worker %d (pid %d) spent over decode_deadline=%gs on sample "
                        "%d: replacing it", worker_id, self._workers[worker_id].pid,
                        watch.deadline, item)
            self._pool.kill(worker_id)
            self._replace_worker(worker_id, fault=False)
        return [w for _, w, _ in stuck]

    def _worker_resume(self, worker_id: int, restore: resume.Progress | None):
        """(RNG states to set, IterableDataset samples to drop, stream state to go on from)
        for a restored worker."""
        if restore is None:
            return None, 0, None
        rng = restore.worker_rng[worker_id] if restore.base_seed is not None else None
        stream = self._progress.worker_streams[worker_id]  # (between epochs: carried over)
        skip = 0
        if restore.mid_epoch and stream is None:
            skip = self._samples_in(restore.worker_batches[worker_id])
        return rng, skip, stream

    def _samples_in(self, batches: int) -> int:
        """IterableDataset samples a worker pulls and drops to get past ``batches`` it made
        (map-style workers need none: their tasks name their indices)."""
        if self._dataset_kind != _DatasetKind.Iterable:
            return 0
        return batches * (self._index_sampler.batch_size if self._auto_collation else 1)


class _Receiving:
    """Part of the multi-process iterator: the workers' results, received as they come (a dead
    worker noticed at once), and their slabs given back once the loop lets go of them."""

    def _check_shared_memory(self, slab_bytes: int) -> None:
        """Once batches show their size: will the slab pool fit? (Warned once per loader.)"""
        from . import doctor

        need = doctor.pool_bytes(self._num_workers, self._prefetch_factor, slab_bytes)
        if need > self._shm_checked:
            self._shm_checked = need
            finding = doctor.shm_finding(need, self._transport.shm_dir, held=self._slab_pool.nbytes)
            if finding:  # not now: a warning made an error (-W error) would lose this batch
                self._unsaid.append(finding)

    def _try_get_data(self, timeout: float):
        """(True, (idx, data)) from any worker within ``timeout`` s, else (False, None); a dead
        worker raises at once."""
        self._slab_pool.drain()
        if self._watches:
            replaced = self._replace_stuck_workers()
            if replaced:
                return True, ("respawned", replaced)
            deadline = min(watch.deadline for watch in self._watches)
            timeout = min(timeout, max(0.05, min(1.0, deadline / 4)))
        due = self._tasks.get(self._rcvd_idx)
        if due is not None and due.pending and self._workers_status[due.worker_id] \
                and _readable(self._result_conns[due.worker_id]):
            try:  # the batch due next is there: no need to watch every worker (10 us)
                return True, self._receive(due.worker_id)
            except EOFError:
                pass  # its channel closed: found again below, with the reason
        # Inactive workers (ended or told to stop) owe no results, as in torch.
        waiting = {
            conn: i for i, conn in enumerate(self._result_conns) if self._workers_status[i]
        }
        sentinels = {
            self._workers[i].sentinel: i
            for i in range(self._num_workers)
            if self._workers_status[i]
        }
        ready = multiprocessing.connection.wait([*waiting, *sentinels], timeout)
        # A worker whose result channel closed, or whose process is ending, can send nothing more.
        silent = [sentinels[obj] for obj in ready if obj in sentinels]
        for obj in ready:
            if obj in waiting:
                try:
                    return True, self._receive(waiting[obj])
                except EOFError:
                    silent.append(waiting[obj])
        for i in silent:  # its exit can lag its channel closing: wait so the error can say why
            self._workers[i].join(timeout=STATUS_CHECK_INTERVAL_S)
        failed = [
            i
            for i in range(self._num_workers)
            if self._workers_status[i] and (i in silent or not self._workers[i].is_alive())
        ]
        if failed and self._respawn:
            for i in failed:
                self._replace_worker(i)
            return True, ("respawned", failed)  # the caller looks again at what it waits for
        if failed:
            for i in failed:
                self._mark_worker_as_unavailable(i)
            raise self._pool.failure(failed)
        return False, None

    def _receive(self, worker_id: int):
        result = self._result_conns[worker_id].recv()
        if result[0] == "resumed":
            return "resumed", worker_id
        idx = result.send_idx
        record = self._records[worker_id]
        record.received += 1
        if result.counts is not None:
            record.counts = result.counts
        task = self._tasks.get(idx) or _Task(worker_id, None, None)  # (none: ended, dropped)
        if self._counters is not None:
            task.counts = record.counts
        if result.rng is not None:
            task.rng = record.rng = result.rng
        if result.stream is not None and result.status == "end":
            record.end_stream = record.stream = result.stream
        elif result.stream is not None:
            task.stream = record.stream = result.stream
        channel = self._channels[worker_id]
        if result.new:
            self._slab_pool.receive(channel, result.new, worker_id)
            self._check_shared_memory(max(capacity for *_, capacity in result.new))
        views = self._slab_pool.lend(result.used)
        if result.status == "end":
            return idx, torch_utils.worker._IterableDatasetStopIteration(worker_id)
        return idx, _Received(result.payload, views, worker_id)

    def _get_data(self):
        if self._timeout > 0:
            deadline = time.monotonic() + self._timeout
            while (remaining := deadline - time.monotonic()) > 0:
                success, data = self._try_get_data(remaining)
                if success:
                    return data
            raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
        while True:
            success, data = self._try_get_data(STATUS_CHECK_INTERVAL_S)
            if success:
                return data


class _SlabDataLoaderIter(_Receiving, _Replacing, _ResumableIter,
                         _MultiProcessingDataLoaderIter):
    """Multi-process iterator; its scheduling mirrors torch's ``_MultiProcessingDataLoaderIter``
    (index dispatch, in-order delivery); receiving (_Receiving) and replacing workers
    (_Replacing) are parts of their own, its processes a pool (_pool.py).

    What it takes from torch's classes, decided: from ``_BaseDataLoaderIter`` the iterator
    protocol (``__iter__``, ``__next__``, ``__len__``, ``_next_index``, ``__getstate__``) and
    its ``_reset``; from ``_MultiProcessingDataLoaderIter`` nothing but the type, for
    ``isinstance`` (Lightning shuts persistent workers down through such a check). Its methods
    that this class has not are fenced off below (``_not_ours``), those torch adds later too."""

    def __init__(self, loader: DataLoader, restore: resume.Progress | None = None) -> None:
        self._owner_pid = os.getpid()
        self._replacements = 0  # workers replaced (respawned, or past the decode deadline)
        self._start_progress(loader, restore,
                             functools.partial(_BaseDataLoaderIter.__init__, self))
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = loader.in_order
        if self._num_workers <= 0:
            raise AssertionError("num_workers must be greater than 0 for MultiProcessingDataLoaderIter")
        if self._prefetch_factor <= 0:
            raise AssertionError(
                "prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter"
            )
        context = loader.multiprocessing_context or torch.multiprocessing
        self._worker_init_fn = loader.worker_init_fn
        if isinstance(self._dataset, (IterDataPipe, MapDataPipe)):
            self._worker_init_fn = functools.partial(
                _sharding_worker_init_fn, self._worker_init_fn, self._world_size, self._rank
            )
        transport = TransportConfig.from_env()
        self._shutdown = False
        self._worker_pids_set = False
        self._workers_status = [False] * self._num_workers
        # Workers run ahead by up to prefetch_factor batches each: keeping that many slabs in the
        # pool per worker, plus one, means a steady loop never creates or closes a slab.
        locking = self._pin_memory and self._pin_memory_device == "cuda"
        self._slab_pool = SlabPool(self._num_workers * (self._prefetch_factor + 1),
                                   lean=transport.slab_memory == "lean",
                                   **(cuda_page_locking() if locking else {}))
        self._transport = transport
        self._respawn = loader.on_worker_failure == "respawn"
        # the decode deadlines to hold workers to (a ConcatDataset's datasets may each have one)
        self._watches = hooks.sample_watches(self._dataset)
        for watch in self._watches:
            watch.watched = True
        self._awaiting_resume: set[int] = set()  # workers yet to acknowledge a new epoch
        self._shm_checked = 0  # the largest pool size checked against free shared memory
        self._findings_said = loader.__dict__.setdefault("_fastmm_findings", set())
        self._unsaid: list[str] = []  # warned at the next next(), before it changes anything
        self._pool = WorkerPool(self._num_workers, context, self._slab_pool, dict(
            dataset_kind=self._dataset_kind, dataset=self._dataset,
            auto_collation=self._auto_collation, collate_fn=self._collate_fn,
            drop_last=self._drop_last, base_seed=self._base_seed,
            init_fn=self._worker_init_fn, num_workers=self._num_workers,
            transport=transport), _call_as_torch)
        # the pool's own lists, by worker id (a replacement takes its predecessor's place)
        self._workers, self._index_queues = self._pool.processes, self._pool.index_queues
        self._result_conns = self._pool.result_conns
        self._channels = self._pool.channels  # the slab pool's key for each (_pool.py)
        self._records = [_WorkerRecord() for _ in range(self._num_workers)]
        self._counters = hooks.skip_counts(self._dataset)
        for worker_id in range(self._num_workers):
            self._start_worker(worker_id, self._worker_resume(worker_id, restore))
        for worker_id, record in enumerate(self._records):
            if restore is not None and restore.base_seed is not None:
                record.rng = restore.worker_rng[worker_id]
            record.stream = self._progress.worker_streams[worker_id]
        if not (self._respawn or self._watches):  # else deaths are this iterator's, not torch's
            torch_utils.signal_handling._set_worker_pids(
                id(self), tuple(w.pid for w in self._workers))
            torch_utils.signal_handling._set_SIGCHLD_handler()
            self._worker_pids_set = self._pool.signal_id = id(self)
        self._reset(loader, first_iter=True)

    # -- epoch -------------------------------------------------------------------------------

    def _reset(self, loader, first_iter=False) -> None:
        _BaseDataLoaderIter._reset(self, loader, first_iter)  # not torch's multi-process one
        first_worker = 0
        if first_iter:
            self._sampler_iter = self._first_sampler_iter
            first_worker = self._progress.first_worker(self._dataset_kind == _DatasetKind.Iterable)
        else:
            self._progress.next_epoch()
            for record, stream in zip(self._records, self._progress.worker_streams):
                record.stream, record.end_stream = stream, None  # a respawn starts there
            loader.__dict__["_fastmm_progress"] = self._progress
            self._sampler_iter = resume.SamplerTap(loader, self._progress, None)
        self._send_idx = 0  # next task to send
        self._rcvd_idx = 0  # next task to return
        self._tasks: dict[int, _Task] = {}  # idx -> each task sent and not yet handed out
        # batches received from each worker this epoch (a restored one had skipped its own)
        for record, batches in zip(self._records, self._progress.worker_batches):
            record.received = batches if first_iter else 0
        self._tasks_outstanding = 0
        self._workers_status = [True] * self._num_workers
        self._workers_num_tasks = [0] * self._num_workers
        self._worker_queue_idx_cycle = itertools.islice(
            itertools.cycle(range(self._num_workers)), first_worker, None
        )
        if not first_iter:
            # a dataset offering fastmm_epoch (a ShardStream) has its workers' copies follow
            # the main one's set_epoch (hooks.py)
            epoch = hooks.epoch(unwatched(self._dataset))
            for index_queue in self._index_queues:
                index_queue.put(("resume", self._shared_seed, epoch))
            self._awaiting_resume = set(range(self._num_workers))  # a respawned one starts anew
            while self._awaiting_resume:
                idx, worker_id = self._get_data()
                if idx == "resumed":
                    self._awaiting_resume.discard(worker_id)
        for record in self._records:
            record.epoch_counts = record.counts  # its skip counts as the epoch begins
        self._progress.worker_counts = [record.counts for record in self._records]
        self._note_epoch_start()
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()

    def _next_batch(self):
        if self._unsaid:
            from . import doctor

            unsaid, self._unsaid = self._unsaid, []
            doctor.warn_once(self._findings_said, unsaid, stacklevel=5)
        self._slab_pool.step()
        self._slab_pool.drain()  # slabs of batches the loop dropped go back before new tasks go out
        while True:
            # Skip tasks of workers that ended their IterableDataset; stop when none is left.
            while self._rcvd_idx < self._send_idx:
                task = self._tasks.get(self._rcvd_idx)
                if task:
                    if not task.pending or self._workers_status[task.worker_id]:
                        break
                    del self._tasks[self._rcvd_idx]
                self._rcvd_idx += 1
            else:
                # for the next epoch
                self._progress.worker_streams = [record.end_stream for record in self._records]
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration

            if not self._tasks[self._rcvd_idx].pending:
                task = self._tasks.pop(self._rcvd_idx)
                self._rcvd_idx += 1
                return self._process_data(task.data, task)

            assert not self._shutdown and self._tasks_outstanding > 0
            idx, data = self._get_data()
            if idx in ("resumed", "respawned"):
                continue
            self._tasks_outstanding -= 1
            if self._dataset_kind == _DatasetKind.Iterable and isinstance(
                data, torch_utils.worker._IterableDatasetStopIteration
            ):
                if self._persistent_workers:
                    self._workers_status[data.worker_id] = False
                else:
                    self._mark_worker_as_unavailable(data.worker_id)
                self._try_put_index()
                continue

            if idx != self._rcvd_idx:
                if not self._in_order:
                    return self._process_data(data, self._tasks.pop(idx))
                self._tasks[idx].data = data
            else:
                self._rcvd_idx += 1
                return self._process_data(data, self._tasks.pop(idx))

    # -- sending -----------------------------------------------------------------------------

    def _try_put_index(self) -> None:
        max_tasks = self._prefetch_factor * self._num_workers
        assert self._tasks_outstanding < max_tasks
        try:
            index = self._next_index()
        except StopIteration:
            return
        for _ in range(self._num_workers):  # the next active worker, round robin
            worker_id = next(self._worker_queue_idx_cycle)
            if self._workers_status[worker_id]:
                if self._in_order:
                    break
                if self._workers_num_tasks[worker_id] < max_tasks // sum(self._workers_status):
                    break
        else:
            return
        self._index_queues[worker_id].put(
            ("task", self._send_idx, index, self._slab_pool.loop_spare_s)
        )
        self._tasks[self._send_idx] = _Task(worker_id, index, self._sampler_iter.position)
        self._workers_num_tasks[worker_id] += 1
        self._tasks_outstanding += 1
        self._send_idx += 1

    def _process_data(self, data, task: "_Task"):
        self._progress.handed_out(task.worker_id, task.rng, task.stream, task.position,
                                  task.counts)
        self._workers_num_tasks[task.worker_id] -= 1
        self._try_put_index()
        data = data.rebuild()
        if isinstance(data, torch._utils.ExceptionWrapper):
            data.reraise()
        if self._pin_memory:  # a no-op for slab tensors: their slab is already page-locked
            data = torch_utils.pin_memory.pin_memory(data, self._pin_memory_device)
        return data

    # -- shutdown ----------------------------------------------------------------------------

    def _mark_worker_as_unavailable(self, worker_id: int, shutdown: bool = False) -> None:
        self._index_queues[worker_id].put(None)
        self._workers_status[worker_id] = False

    def _shutdown_workers(self, join_s: float = STATUS_CHECK_INTERVAL_S) -> None:
        if torch_utils is None or torch_utils.python_exit_status in (True, None):
            return
        if self._shutdown:
            return
        self._shutdown = True
        try:
            self._pool.done_event.set()
            for worker_id in range(len(self._workers)):
                started = self._workers[worker_id] is not None
                if started and (self._persistent_workers or self._workers_status[worker_id]):
                    self._mark_worker_as_unavailable(worker_id, shutdown=True)
            self._pool.close(join_s)
        finally:
            if self._worker_pids_set:
                torch_utils.signal_handling._remove_worker_pids(id(self))
                self._worker_pids_set = self._pool.signal_id = False
            self._pool.forget()
            self._tasks = {}
            self._slab_pool.close()

    def __del__(self) -> None:
        # only where it was made: a forked child may collect its copy of an iterator. The
        # garbage collector may run this in any thread, even the feeder thread of one of our
        # index queues, which then cannot deliver the workers' exit message: wait briefly,
        # then terminate them (they hold nothing anyone still reads).
        if hasattr(self, "_slab_pool") and self._owner_pid == os.getpid():
            self._shutdown_workers(join_s=0.2)


def _not_ours(name: str):
    def refused(self, *args, **kwargs):
        raise NotImplementedError(
            f"{name} is torch's multi-process iterator's; fastmm's replaces that iterator "
            "and runs none of its code")

    refused.__name__ = name
    return refused


_OWN = {name for part in _SlabDataLoaderIter.__mro__ if part.__module__ == __name__
        for name in vars(part)}
for _name, _value in vars(_MultiProcessingDataLoaderIter).items():
    if callable(_value) and _name not in _OWN:
        setattr(_SlabDataLoaderIter, _name, _not_ours(_name))
del _name, _value
