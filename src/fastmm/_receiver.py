"""What the multi-process iterator hears from its workers: their result pipes and process
sentinels turned into events (a batch arrived, a worker began the new epoch, workers were
replaced), a dead worker noticed the moment it dies."""

from __future__ import annotations

import multiprocessing.connection
import select
import time
from typing import NamedTuple

from . import _torch, collate
from ._messages import Result, Resume, Resumed
from ._processes import STATUS_CHECK_INTERVAL_S, WorkerProcesses
from ._respawn import Respawner
from ._tasks import Sent, TaskTable, WorkerRecord
from .autotune import PERIOD_S
from .slabs import SlabPool


class Arrived(NamedTuple):
    """A batch came back for task ``idx``: a Received, or torch's sign that an IterableDataset
    worker ran out."""

    idx: int
    data: object


class WorkerResumed(NamedTuple):
    """A worker began the new epoch."""

    worker_id: int


class Heard(NamedTuple):
    """A worker sent ``message``."""

    worker_id: int
    message: Result | Resumed


class Replaced(NamedTuple):
    """Workers were replaced (dead, or stuck past the decode deadline): the caller looks again
    at what it waits for."""

    worker_ids: list[int]


class Received:
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


class Receiver:
    """The events of the active workers (``table.active``). A worker that died is replaced
    where ``respawn`` is on, else an error in torch's words; one on a sample past a decode
    deadline is replaced. What each result says of its worker's states is kept in its record
    and its task, for resume and respawn; shared-memory findings wait in ``unsaid`` for the
    loop to warn of them.

    Args:
        workers: the worker processes and their channels.
        slab_pool: maps the slabs workers create and lends each batch its slabs.
        table: the epoch's tasks; ``table.active`` says which workers owe results.
        records: what is kept of each worker (WorkerRecord), by worker id.
        respawner: replaces dead and stuck workers.
        deadlines: the dataset's decode deadlines (offers.decode_deadlines).
        respawn: on_worker_failure == "respawn".
        timeout: the loader's ``timeout`` (0: wait without end).
        counted: whether the dataset keeps skip counts (tasks then carry them).
        shm_dir: where slabs live, for the shared-memory check.
        prefetch_factor: the loader's, for the shared-memory check.
    """

    def __init__(self, workers: WorkerProcesses, slab_pool: SlabPool, table: TaskTable,
                 records: list[WorkerRecord], respawner: Respawner, *, deadlines: list,
                 respawn: bool, timeout: float, counted: bool, shm_dir: str,
                 prefetch_factor: int):
        self.workers, self.slab_pool, self.table, self.records = workers, slab_pool, table, records
        self.respawner, self.deadlines, self.respawn = respawner, deadlines, respawn
        self.timeout, self.counted, self.shm_dir = timeout, counted, shm_dir
        self.prefetch_factor = prefetch_factor
        self.shm_checked = 0  # the largest pool size checked against free shared memory
        self.largest_slab = 0  # the largest slab a worker made, in bytes
        self.unsaid: list[str] = []  # findings to warn of at the next next()
        # the workers' waits for a task with every batch they were given made (Result.waited_s),
        # summed, each counted up to one adjustment period: one num_workers="auto" gave no
        # batches for a while waited for the tuner, not for the loop
        self.tasks_waited_s = 0.0

    def next_event(self, shared_seed: int) -> Arrived | WorkerResumed | Replaced:
        """The next thing the workers did, waiting at most the loader's ``timeout`` (then
        torch's error) or without end."""
        if self.timeout > 0:
            deadline = time.monotonic() + self.timeout
            while (remaining := deadline - time.monotonic()) > 0:
                event = self.poll(remaining, shared_seed)
                if event is not None:
                    return event
            raise RuntimeError(f"DataLoader timed out after {self.timeout} seconds")
        while True:
            event = self.poll(STATUS_CHECK_INTERVAL_S, shared_seed)
            if event is not None:
                return event

    def say_findings(self, said: set) -> None:
        """Warn of the findings not said yet (doctor.py), from ``next()``: a warning made an
        error (-W error) then loses no batch. ``said``: the loader's, said once each."""
        if self.unsaid:
            from . import doctor

            unsaid, self.unsaid = self.unsaid, []
            doctor.warn_once(said, unsaid, stacklevel=6)  # (the user's frame, from here)

    def begin_epoch(self, shared_seed: int, epoch: int | None) -> None:
        """Persistent workers' next epoch: each started worker told (``Resume``), and waited
        for until it has begun it (a replacement begins anew)."""
        started = len(self.workers.started())
        for index_queue in self.workers.index_queues[:started]:
            index_queue.put(Resume(shared_seed, epoch))
        awaiting = set(range(started))
        while awaiting:
            event = self.next_event(shared_seed)
            awaiting -= ({event.worker_id} if isinstance(event, WorkerResumed) else
                         set(event.worker_ids) if isinstance(event, Replaced) else set())

    def poll(self, timeout: float, shared_seed: int) -> Arrived | WorkerResumed | Replaced | None:
        """One event within ``timeout`` s, else None."""
        self.slab_pool.drain()
        if self.deadlines:
            replaced = self.respawner.replace_stuck(self.deadlines, self.table, shared_seed)
            if replaced:
                return Replaced(replaced)
            deadline = min(deadline.seconds for deadline in self.deadlines)
            timeout = min(timeout, max(0.05, min(1.0, deadline / 4)))
        due = self.table.tasks.get(self.table.rcvd_idx)
        heard = self._wait(timeout, due.worker_id if due is not None and due.pending else None)
        if isinstance(heard, Heard):
            return self._take_in(*heard)
        if heard and self.respawn:
            for worker_id in heard:
                self.respawner.replace(worker_id, self.table, shared_seed)
            return Replaced(heard)
        if heard:
            for worker_id in heard:
                self.workers.stop(worker_id)
                self.table.active[worker_id] = False
            raise self.workers.failure(heard)
        return None

    def _wait(self, timeout: float, due: int | None) -> Heard | list[int] | None:
        """What a worker sent, or the workers that died or closed their pipe (they can
        send nothing more), or None after ``timeout``. ``due``: the worker whose result is
        handed out next, read at once if it is there (10 us; a wait on every worker builds a
        selector). Inactive workers (ended or told to stop) owe no results, as in torch."""
        active, conns = self.table.active, self.workers.result_conns
        processes = self.workers.processes
        if due is not None and active[due] and _readable(conns[due]):
            try:
                return Heard(due, conns[due].recv())
            except EOFError:
                pass  # its channel closed: found again below, with the reason
        waiting = {conns[i]: i for i in range(len(conns)) if active[i]}
        sentinels = {processes[i].sentinel: i for i in range(len(processes)) if active[i]}
        ready = multiprocessing.connection.wait([*waiting, *sentinels], timeout)
        silent = [sentinels[obj] for obj in ready if obj in sentinels]
        for obj in ready:
            if obj in waiting:
                try:
                    return Heard(waiting[obj], obj.recv())
                except EOFError:
                    silent.append(waiting[obj])
        for i in silent:  # its exit can lag its channel closing: wait so the error can say why
            processes[i].join(timeout=STATUS_CHECK_INTERVAL_S)
        return [i for i in range(len(processes))
                if active[i] and (i in silent or not processes[i].is_alive())] or None

    def _take_in(self, worker_id: int, message: Result | Resumed) -> Arrived | WorkerResumed:
        """A worker's message taken in: what it says of the worker's states kept, its new
        slabs mapped, the batch's slabs lent to it."""
        if isinstance(message, Resumed):
            return WorkerResumed(worker_id)
        record = self.records[worker_id]
        record.received += 1
        self.tasks_waited_s += min(message.waited_s, PERIOD_S)
        if message.counts is not None:
            record.counts = message.counts
        task = self.table.tasks.get(message.send_idx) or Sent(worker_id, None, None)
        if self.counted:
            task.counts = record.counts
        if message.rng is not None:
            task.rng = record.rng = message.rng
        if message.iter_state is not None and message.status == "end":
            record.end_iter_state = record.iter_state = message.iter_state
        elif message.iter_state is not None:
            task.iter_state = record.iter_state = message.iter_state
        if message.new:
            self.slab_pool.receive(self.workers.channels[worker_id], message.new, worker_id)
            self._check_shared_memory(max(slab.capacity for slab in message.new))
        views = self.slab_pool.lend(message.used)
        if message.status == "end":
            return Arrived(message.send_idx, _torch.IterableDatasetStopIteration(worker_id))
        return Arrived(message.send_idx, Received(message.payload, views, worker_id))

    def _check_shared_memory(self, slab_bytes: int) -> None:
        """Once batches show their size: will the slab pool fit? (Said once per loader.)"""
        from . import doctor

        self.largest_slab = max(self.largest_slab, slab_bytes)
        need = doctor.pool_bytes(len(self.records), self.prefetch_factor, slab_bytes)
        if need > self.shm_checked:
            self.shm_checked = need
            finding = doctor.shm_finding(need, self.shm_dir, held=self.slab_pool.nbytes)
            if finding:  # not now: a warning made an error (-W error) would lose this batch
                self.unsaid.append(finding)

    def room(self, workers: int, prefetch_factor: int) -> str | None:
        """Why the slab pool of ``workers`` prefetching ``prefetch_factor`` batches each would
        not fit in shared memory (the tuner asks before it goes there), or None."""
        from . import doctor

        if not self.largest_slab:
            return None  # no batch seen yet
        need = doctor.pool_bytes(workers, prefetch_factor, self.largest_slab)
        return doctor.shm_finding(need, self.shm_dir, held=self.slab_pool.nbytes)


def _readable(conn) -> bool:
    """``conn.poll()`` for less: that builds a selector each call."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return bool(poller.poll(0))
