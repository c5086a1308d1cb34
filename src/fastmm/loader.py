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

import functools
import logging
import operator
import os
import types
from collections.abc import Iterable

import torch
import torch.multiprocessing
import torch.utils.data
from torch.utils.data import Dataset, IterDataPipe, MapDataPipe, Sampler

from . import _torch, autotune, offers, resume
from ._messages import Restore, Task, WorkerSpec
from ._processes import STATUS_CHECK_INTERVAL_S, WorkerProcesses
from ._receiver import Arrived, Receiver
from ._respawn import Respawner
from ._tasks import Sent, TaskTable, WorkerRecord
from ._torch import DatasetKind
from ._torch import T_co as _T_co  # torch's own names in the signature, as inspect shows it
from ._torch import collate_fn_t as _collate_fn_t
from ._torch import worker_init_fn_t as _worker_init_fn_t
from .config import TransportConfig
from .shared import DatasetShare
from .slabs import SlabPool, cuda_page_locking
from .telemetry import auto as auto_export
from .telemetry.recorder import unwatched

log = logging.getLogger("fastmm")


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
        transport: TransportConfig | None = None,
        cpu_budget: float | None = None,
    ) -> None:
        """torch's arguments (the same meanings and defaults), plus ``snapshot_every_n_steps``,
        ``on_worker_failure``, ``transport`` and ``cpu_budget``.

        Args:
            dataset: the dataset to load from (map-style or iterable).
            batch_size: samples per batch; None: samples one by one, uncollated.
            shuffle: reshuffle the samples every epoch.
            sampler: the order samples are drawn in (any iterable with a length); not with
                ``shuffle``.
            batch_sampler: like ``sampler``, a batch of indices at a time; not with
                ``batch_size``, ``shuffle``, ``sampler`` or ``drop_last``.
            num_workers: worker processes (0: load in the main process). A whole number: torch
                takes 2.5 here and fails at the first ``iter()``; fastmm says so now (the same
                TypeError). "auto": as many as keep the loop fed, set while it runs within
                ``cpu_budget`` (``num_workers`` then reads as the most it may start; each
                batch's draws are seeded by the batch: docs/loader.md). FASTMM_NUM_WORKERS
                ("auto" or a number), where set, overrides it.
            collate_fn: merges a list of samples into a batch.
            pin_memory: hand out batches in pinned (page-locked) memory.
            drop_last: drop the last batch when it is short.
            timeout: seconds to wait for a batch from the workers (0: without end).
            worker_init_fn: called in each worker with its id, after seeding, before loading.
            multiprocessing_context: how workers start ("fork", "spawn", "forkserver", or a
                context); None: the platform's default.
            generator: the RNG the base seed (and a RandomSampler's order) is drawn from.
            prefetch_factor: batches each worker loads ahead (None: 2 with workers, set while
                it runs with ``num_workers="auto"``); a whole number, as ``num_workers``, or
                "auto" (2 to 8, deeper while batch times vary).
            persistent_workers: keep the workers alive from one epoch to the next.
            pin_memory_device: the device ``pin_memory`` pins for ("": the default).
            in_order: hand batches out in the sampler's order; False: as they are ready.
            snapshot_every_n_steps: torchdata's StatefulDataLoader argument (how often workers
                send their state), accepted so its users change only the import. fastmm's
                workers send what changed in their state with every batch, so ``state_dict()``
                is exact at any step whatever the value; it is checked (an int of 0 or more, or
                None) and kept, nothing more.
            on_worker_failure: "raise" (torch's behaviour: a worker killed by a signal or gone
                is an error naming it) or "respawn" (a new worker takes its place and gets its
                unfinished batches again, from its RNG states: nothing lost or repeated, the
                same batches in the same order as without the failure).
            transport: how workers hand their batches over (``fastmm.TransportConfig``: the
                shared-memory directory, slab memory, worker malloc, C++ or its twin); None:
                from the ``FASTMM_*`` variables each time workers start.
            cpu_budget: with ``num_workers="auto"``, the fraction of this process's usable
                cores the workers may use together (0.5: half); None: all of them, or
                FASTMM_CPU_BUDGET where set. Over it for one period (a second), a worker stops
                getting batches.
        """
        if transport is not None and not isinstance(transport, TransportConfig):
            raise TypeError(f"transport should be a fastmm.TransportConfig or None, but got "
                            f"{type(transport).__name__}")
        if on_worker_failure not in ("raise", "respawn"):
            raise ValueError(f"on_worker_failure={on_worker_failure!r}; use 'raise' or 'respawn'")
        num_workers, prefetch_factor, self.autotune = autotune.settings(
            num_workers, prefetch_factor, cpu_budget)
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
        self._tuner: autotune.Tuner | None = None  # "auto": kept from one iterator to the next
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.transport = transport
        self._restore_next: resume.Progress | None = None  # from load_state_dict, for next iter
        self._progress: resume.Progress | None = None  # where the latest iterator is
        self._findings_said: set[str] = set()  # doctor's findings warned of already
        self._dataset_share: DatasetShare | None = None  # the last iterator's (shared.py)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_dataset_share"] = None  # this process's buffer: a copy builds its own
        state.pop("_state_parts", None)  # (found again from the copy's own parts)
        state["_tuner"] = None  # (it measures this process's workers)
        return state

    @functools.cached_property
    def _state_parts(self) -> resume.LoaderParts:
        """The parts of this loader its states read, found once (resume.LoaderParts)."""
        return resume.LoaderParts.of(self)

    def check_worker_number_rationality(self):
        """torch's warning of more workers than cores; not for num_workers="auto", whose
        ``num_workers`` is the most it may start, past the cores only while cores are idle."""
        if self.autotune is None or not self.autotune.workers:  # (torch's frame warns)
            _call_as_torch(torch.utils.data.DataLoader.check_worker_number_rationality, self)

    def __iter__(self):
        # FASTMM_TELEMETRY=summary|trace: the epoch watched and exported (telemetry/auto.py)
        return auto_export.epoch(self, super().__iter__)

    def _get_iterator(self):
        restore, self._restore_next = self._restore_next, None
        if self.num_workers == 0:
            return _SingleProcessIter(self, restore)
        _call_as_torch(self.check_worker_number_rationality)
        from . import doctor  # (not at import: python -m fastmm.doctor runs it as __main__)

        it = _SlabDataLoaderIter(self, restore)
        doctor.warn_once(self._findings_said, doctor.copy_on_read_findings(it._dataset, it._share))
        return it

    def state_dict(self) -> dict:
        """Where the loader is in its epoch, as a small JSON-serialisable dict: a new loader
        given it by ``load_state_dict`` yields exactly the batches this one would yield next
        (same samples, order and augmentation draws). With ``in_order=False``: the samples
        not handed out yet, each once, in the order the workers finish them."""
        return resume.encode(self, self._progress)

    def load_state_dict(self, state: dict | list[dict]) -> None:
        """Start the next iteration where ``state`` (from ``state_dict``) was taken; a list of
        every rank's states resumes a job of another world size (docs/loader.md). Raises
        ValueError where the rest of a started epoch cannot be dealt out exactly once at this
        loader's shape (another dataset length or drop_last, an IterableDataset's workers...)."""
        progress = resume.decode(self, state)
        if self._iterator is not None:  # persistent workers of the old position: start anew
            self._iterator._shutdown_workers()
            self._iterator = None
        self._restore_next = self._progress = progress




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
        progress = resume.Progress.starting(loader.num_workers, self._base_seed, restore)
        progress.shape = resume.shape(loader)
        self._progress = loader._progress = progress
        self._first_sampler_iter = resume.SamplerTap(loader, progress, restore)

    def _note_epoch_start(self) -> None:
        """Keep an IterableDataset's own state as the epoch begins: a restored loader loads it,
        then each worker's iterator state over it (or pulls the samples handed out again, which
        would move a position the dataset keeps and count its bad samples twice if the state
        were the one at state_dict())."""
        if self._dataset_kind == DatasetKind.Iterable:
            self._progress.dataset_state = resume.dataset_state(self._dataset)

    def _next_data(self):
        # (not __next__: torch's warnings there name its caller, which must be the user's loop)
        try:
            return self._next_batch()
        except StopIteration:
            self._progress.done = True
            raise


class _SingleProcessIter(_ResumableIter, _torch.SingleProcessDataLoaderIter):
    def __init__(self, loader: DataLoader, restore: resume.Progress | None) -> None:
        self._start_progress(loader, restore, super().__init__)
        self._sampler_iter = self._first_sampler_iter
        self._note_epoch_start()
        if restore is not None and restore.mid_epoch and self._dataset_kind == DatasetKind.Iterable:
            iter_state = restore.worker_iter_states[0]
            if iter_state is not None:  # the iterator goes on from its own state
                self._dataset_fetcher = resume.resumed_fetcher(lambda: DatasetKind.create_fetcher(
                    self._dataset_kind, self._dataset, self._auto_collation, self._collate_fn,
                    self._drop_last), self._dataset, iter_state)
            else:
                with resume.KeepRng():  # pull and drop what was handed out; its draws were made
                    for _ in range(restore.batches):
                        self._dataset_fetcher.fetch(next(self._sampler_iter))
        elif self._dataset_kind == DatasetKind.Iterable:
            # the state before the first batch: a iter_state may keep the caller's RNG state in it
            try:
                self._note_iter_state()
            except Exception:
                pass  # one whose state exists only once iterated: asked after each batch

    def _next_index(self):
        index = super()._next_index()
        # (a state from workers handing out of order may have batches ahead, skipped here)
        self._progress.count(getattr(self._sampler_iter, "position", None))
        return index

    def _next_batch(self):
        data = _torch.SingleProcessDataLoaderIter._next_data(self)
        if self._dataset_kind == DatasetKind.Iterable:
            self._note_iter_state()
        return data

    def _note_iter_state(self) -> None:
        self._progress.worker_iter_states[0] = resume.iter_state(self._dataset,
                                                                 self._dataset_fetcher)


class _SlabDataLoaderIter(_ResumableIter, _torch.MultiProcessingDataLoaderIter):
    """Multi-process iterator; its scheduling mirrors torch's ``_MultiProcessingDataLoaderIter``
    (index dispatch, in-order delivery). Its parts: the worker processes (``WorkerProcesses``), the
    epoch's tasks and what is kept of each worker (``TaskTable``, ``WorkerRecord``), what the
    workers send (``Receiver``), replacements (``Respawner``) and the slab pool.

    What it takes from torch's classes, decided: from ``_BaseDataLoaderIter`` the iterator
    protocol (``__iter__``, ``__next__``, ``__len__``, ``_next_index``, ``__getstate__``) and
    its ``_reset``; from ``_MultiProcessingDataLoaderIter`` nothing but the type, for
    ``isinstance`` (Lightning shuts persistent workers down through such a check). Its methods
    that this class has not are fenced off below (``_not_ours``), those torch adds later too."""

    def __init__(self, loader: DataLoader, restore: resume.Progress | None = None) -> None:
        self._owner_pid = os.getpid()
        self._shutdown = self._worker_pids_set = False
        self._start_progress(loader, restore,
                             functools.partial(_torch.BaseDataLoaderIter.__init__, self))
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = loader.in_order
        _above_zero(num_workers=self._num_workers, prefetch_factor=self._prefetch_factor)
        self._table = TaskTable(self._num_workers, self._prefetch_factor, self._in_order)
        self._transport = loader.transport or TransportConfig.from_env()
        self._share = _dataset_share(loader, self._dataset, self._transport)
        # Workers run ahead by up to prefetch_factor batches each: keeping that many slabs in the
        # pool per worker, plus one, means a steady loop never creates or closes a slab.
        self._slab_pool = SlabPool(self._num_workers * (self._prefetch_factor + 1),
                                   lean=self._transport.slab_memory == "lean",
                                   **(cuda_page_locking() if self._pin_memory
                                      and self._pin_memory_device == "cuda" else {}))
        # the decode deadlines to hold workers to (a ConcatDataset's datasets may each have one)
        self._deadlines = offers.decode_deadlines(self._dataset, enforce=True)
        self._findings_said = loader._findings_said
        context = loader.multiprocessing_context or torch.multiprocessing
        self._worker_processes = WorkerProcesses(
            self._num_workers, context, self._slab_pool,
            _worker_spec(self, loader, context.get_start_method()), _call_as_torch)
        restored = restore is not None and restore.base_seed is not None
        self._records = [WorkerRecord(rng=restore.worker_rng[i] if restored else None,
                                      iter_state=self._progress.worker_iter_states[i])
                         for i in range(self._num_workers)]
        counters = offers.skip_counts(self._dataset)
        per_batch = (0 if self._dataset_kind != DatasetKind.Iterable else  # pulled to skip one
                     self._index_sampler.batch_size if self._auto_collation else 1)
        self._respawner = Respawner(self._worker_processes, self._records, counters, per_batch)
        self._receiver = Receiver(
            self._worker_processes, self._slab_pool, self._table, self._records, self._respawner,
            deadlines=self._deadlines, respawn=loader.on_worker_failure == "respawn",
            timeout=self._timeout, counted=counters is not None,
            shm_dir=self._transport.shm_dir, prefetch_factor=self._prefetch_factor)
        self._tuning = None if loader.autotune is None else autotune.Tuning(
            loader, self._dataset_kind == DatasetKind.Iterable, self._receiver)
        self._start_workers(range(self._table.workers), restore, per_batch)
        self._reset(loader, first_iter=True)

    def _start_workers(self, ids, restore: resume.Progress | None = None,
                       per_batch: int = 0) -> None:
        """Start workers ``ids`` (with "auto", more later, as the tuner calls for them)."""
        for worker_id in ids:
            self._respawner.start(worker_id, _restore_of(self._progress, restore, worker_id,
                                                         per_batch), self._shared_seed)
            self._table.active[worker_id] = True
        if not (self._receiver.respawn or self._deadlines):  # else deaths are ours, not torch's
            self._worker_pids_set = self._worker_processes.tell_torch(id(self))

    # torch's names for what the parts hold (tools and tests read them)
    @property
    def _workers(self) -> list:
        return self._worker_processes.processes

    @property
    def _workers_status(self) -> list[bool]:
        return self._table.active

    @property
    def fastmm_worker_replacements(self) -> int:
        """Workers replaced so far (respawned, or past the decode deadline): telemetry's."""
        return self._respawner.replacements

    # -- epoch -------------------------------------------------------------------------------

    def _reset(self, loader, first_iter=False) -> None:
        _torch.BaseDataLoaderIter._reset(self, loader, first_iter)  # not torch's multi-process one
        first_worker = 0
        if first_iter:
            self._sampler_iter = self._first_sampler_iter
            first_worker = self._progress.first_worker(self._dataset_kind == DatasetKind.Iterable)
        else:
            self._progress.next_epoch()
            self._progress.shape = resume.shape(loader)
            for record, iter_state in zip(self._records, self._progress.worker_iter_states):
                # a respawn starts there
                record.iter_state, record.end_iter_state = iter_state, None
            loader._progress = self._progress
            self._sampler_iter = resume.SamplerTap(loader, self._progress, None)
        self._table.reset(first_worker, started=len(self._worker_processes.started()))
        self._slab_pool.expect(None)
        # batches received from each worker this epoch (a restored one had skipped its own)
        for record, batches in zip(self._records, self._progress.worker_batches):
            record.received = batches if first_iter else 0
        if not first_iter:
            # a dataset offering fastmm_epoch (a ShardStream) has its workers' copies follow
            # the main one's set_epoch (offers.py)
            self._receiver.begin_epoch(self._shared_seed, offers.epoch(unwatched(self._dataset)))
        for record in self._records:
            record.epoch_counts = record.counts  # its skip counts as the epoch begins
        self._progress.worker_counts = [record.counts for record in self._records]
        self._note_epoch_start()
        for _ in range(self._table.max_tasks):
            self._try_put_index()

    def _next_batch(self):
        self._receiver.say_findings(self._findings_said)
        self._slab_pool.step()
        self._slab_pool.drain()  # slabs of batches the loop dropped go back before new tasks go out
        table = self._table
        while True:
            task = table.due()  # (passing over tasks of workers that ended their iterable)
            if task is None:
                # for the next epoch
                self._progress.worker_iter_states = [r.end_iter_state for r in self._records]
                if self._tuning is not None:
                    self._tuning.tuner.say_settled()
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration
            if not task.pending:
                return self._process_data(task.data, table.take(table.rcvd_idx))
            assert not self._shutdown and table.outstanding > 0
            event = (self._receiver.next_event(self._shared_seed) if self._tuning is None else
                     self._tuning.timed_wait(self._receiver.next_event, self._shared_seed))
            if not isinstance(event, Arrived):
                continue
            table.outstanding -= 1
            idx, data = event
            if self._dataset_kind == DatasetKind.Iterable and isinstance(
                    data, _torch.IterableDatasetStopIteration):
                if self._persistent_workers:
                    table.active[data.worker_id] = False
                else:
                    self._mark_worker_as_unavailable(data.worker_id)
                self._try_put_index()
                continue
            if idx != table.rcvd_idx and self._in_order:
                table.tasks[idx].data = data  # handed out in its turn
                continue
            return self._process_data(data, table.take(idx))

    # -- sending -----------------------------------------------------------------------------

    def _try_put_index(self) -> bool:
        """Send the next task, if there is one and room for it; whether it was sent."""
        if self._table.outstanding >= self._table.max_tasks:
            return False  # (the tuner lowered the count or the depth: none until it drains)
        try:
            index = self._next_index()
        except StopIteration:
            self._table.all_sent = True
            return False
        worker_id = self._table.next_worker()
        if worker_id is None:
            return False
        position = self._sampler_iter.position
        seed = None if self._tuning is None else self._tuning.seed(
            self._base_seed, self._progress.epoch, position)
        idx = self._table.add(worker_id, index, position, seed)
        task = Task(idx, index, self._slab_pool.loop_spare_s, seed)
        self._worker_processes.index_queues[worker_id].put(task)
        return True

    def _process_data(self, data, task: Sent):
        self._progress.handed_out(task.worker_id, task.rng, task.iter_state, task.position,
                                  task.counts)
        self._table.handed_out(task)
        self._try_put_index()
        self._slab_pool.expect(self._table.to_write)  # (the epoch's tail: known)
        if self._tuning is not None and self._tuning.retune():  # start what it calls for
            self._start_workers(range(len(self._worker_processes.started()), self._table.workers))
            while self._table.outstanding < self._table.max_tasks and self._try_put_index():
                pass
        data = data.rebuild()
        if isinstance(data, _torch.ExceptionWrapper):
            data.reraise()
        if self._pin_memory:  # a no-op for slab tensors: their slab is already page-locked
            data = _torch.pin_memory(data, self._pin_memory_device)
        return data

    # -- shutdown ----------------------------------------------------------------------------

    def _mark_worker_as_unavailable(self, worker_id: int, shutdown: bool = False) -> None:
        self._worker_processes.stop(worker_id)
        self._table.active[worker_id] = False

    def _shutdown_workers(self, join_s: float = STATUS_CHECK_INTERVAL_S) -> None:
        if _torch.python_exiting() or self._shutdown:
            return
        self._shutdown = True
        try:
            self._worker_processes.done_event.set()
            for worker_id, process in enumerate(self._workers):
                if process is not None and (self._persistent_workers
                                            or self._table.active[worker_id]):
                    self._mark_worker_as_unavailable(worker_id, shutdown=True)
            self._worker_processes.close(join_s)
        finally:
            self._worker_pids_set = self._worker_processes.untell_torch()
            self._worker_processes.forget()
            if self._tuning is not None:
                self._tuning.tuner.detach()
            self._table.tasks = {}
            self._slab_pool.close()  # (the share lives on with the loader, for the next epoch)

    def __del__(self) -> None:
        # only where it was made: a forked child may collect its copy of an iterator. The
        # garbage collector may run this in any thread, even the feeder thread of one of our
        # index queues, which then cannot deliver the workers' exit message: wait briefly,
        # then terminate them (they hold nothing anyone still reads).
        if hasattr(self, "_slab_pool") and self._owner_pid == os.getpid():
            self._shutdown_workers(join_s=0.2)


def _above_zero(**values) -> None:
    """torch's multi-process iterator's own checks, in its words."""
    for name, value in values.items():
        if value <= 0:
            raise AssertionError(
                f"{name} must be greater than 0 for MultiProcessingDataLoaderIter")


def _dataset_share(loader: DataLoader, dataset, transport: TransportConfig) -> DatasetShare | None:
    """The dataset's large containers, shared with the workers instead of copied (shared.py),
    built again only where they changed since the last epoch's; None where sharing is off."""
    share = loader._dataset_share = DatasetShare.build(
        dataset, last=loader._dataset_share) if transport.share_dataset else None
    if share is not None and (share.shared or share.not_shared):
        log.info("fastmm: %s", share.describe())
    return share


def _worker_spec(it: _SlabDataLoaderIter, loader: DataLoader, start_method: str) -> WorkerSpec:
    """What every worker of the iterator ``it`` starts from."""
    init_fn = loader.worker_init_fn
    if isinstance(it._dataset, (IterDataPipe, MapDataPipe)):
        init_fn = functools.partial(_torch.sharding_worker_init_fn, init_fn, it._world_size,
                                    it._rank)
    dataset, share = (it._dataset, None) if it._share is None else it._share.for_workers(
        it._dataset, start_method)
    return WorkerSpec(dataset_kind=it._dataset_kind, dataset=dataset, share=share,
                      auto_collation=it._auto_collation, collate_fn=it._collate_fn,
                      drop_last=it._drop_last, base_seed=it._base_seed, init_fn=init_fn,
                      num_workers=it._num_workers, transport=it._transport)


def _restore_of(progress: resume.Progress, restore: resume.Progress | None, worker_id: int,
                per_batch: int) -> Restore:
    """Where worker ``worker_id`` of a loader begins.

    Args:
        progress: the new iterator's progress.
        restore: the state loaded into the loader, or None.
        worker_id: the worker.
        per_batch: IterableDataset samples it pulls and drops to skip a batch it made.
    """
    if restore is None:
        return Restore()
    rng = restore.worker_rng[worker_id] if restore.base_seed is not None else None
    iter_state = progress.worker_iter_states[worker_id]  # (between epochs: carried over)
    skip = 0
    if restore.mid_epoch and iter_state is None:
        skip = restore.worker_batches[worker_id] * per_batch
    return Restore(rng, skip, iter_state)


def _not_ours(name: str):
    def refused(self, *args, **kwargs):
        raise NotImplementedError(
            f"{name} is torch's multi-process iterator's; fastmm's replaces that iterator "
            "and runs none of its code")

    refused.__name__ = name
    return refused


_OWN = {name for part in _SlabDataLoaderIter.__mro__ if part.__module__ == __name__
        for name in vars(part)}
for _name, _value in vars(_torch.MultiProcessingDataLoaderIter).items():
    if callable(_value) and _name not in _OWN:
        setattr(_SlabDataLoaderIter, _name, _not_ours(_name))
del _name, _value
