"""The multi-process iterator's bookkeeping: the tasks of an epoch (which batch went to which
worker, which came back, in what order they are handed out), the round robin that picks each
task's worker, and what the iterator keeps of each worker."""

from __future__ import annotations

import dataclasses
import itertools

_PENDING = object()  # a task's data before its result came


@dataclasses.dataclass
class Sent:
    """A batch sent to a worker, until it is handed out."""

    worker_id: int
    index: object  # its indices (sent again to a replacement if its worker dies)
    position: int | None  # its batch's place in the epoch's order (resume.py)
    data: object = _PENDING  # its result, when it came before its turn
    rng: object = None  # the worker's RNG states after it
    iter_state: object = None  # the worker's iterator state after it
    counts: object = None  # the worker's skip counts after it
    deaths: int = 0  # workers that died while it was theirs
    seed: int | None = None  # its own seed, sent again with it (Task.seed)

    @property
    def pending(self) -> bool:
        return self.data is _PENDING


@dataclasses.dataclass
class WorkerRecord:
    """What the iterator keeps of one worker from its last batch received: where a replacement
    starts from (resume.py), and its part of the epoch so far."""

    rng: object = None  # its RNG states after that batch
    iter_state: object = None  # its IterableDataset's iterator state then (a respawn starts there)
    end_iter_state: object = None  # its iterator state as its epoch ran out
    counts: object = None  # its row of the dataset's skip counts then (offers.py)
    epoch_counts: object = None  # that row as the epoch began
    received: int = 0  # batches received from it this epoch


class TaskTable:
    """An epoch's tasks by their place in it (``send_idx``), from sent to handed out, and the
    worker each next task goes to, by torch's rules: strictly round robin over the active
    workers with ``in_order``, else the next active worker with under its share of tasks in
    flight. ``active`` and ``in_flight`` are torch's ``_workers_status`` and
    ``_workers_num_tasks``."""

    def __init__(self, num_workers: int, prefetch_factor: int, in_order: bool):
        self.num_workers, self.in_order = num_workers, in_order
        self.set_shape(num_workers, prefetch_factor)
        self.active = [False] * num_workers  # none until the first epoch starts
        self.in_flight = [0] * num_workers
        self.tasks: dict[int, Sent] = {}

    def set_shape(self, workers: int, prefetch_factor: int) -> None:
        """Tasks go to the first ``workers`` workers only (num_workers="auto": autotune.py),
        ``prefetch_factor`` each in flight at once."""
        self.workers = workers
        self.max_tasks = prefetch_factor * workers  # in flight at once

    def reset(self, first_worker: int, started: int | None = None) -> None:
        """A new epoch, its first task to ``first_worker``; the workers from ``started`` on
        have not started (num_workers="auto")."""
        self.tasks = {}  # send_idx -> each task sent and not yet handed out
        self.send_idx = 0  # the next task's
        self.rcvd_idx = 0  # the next one to hand out (in order)
        self.outstanding = 0  # sent, and no result received yet
        self.all_sent = False  # the sampler ran out: no more tasks this epoch
        started = self.num_workers if started is None else started
        self.active = [i < started for i in range(self.num_workers)]
        self.in_flight = [0] * self.num_workers  # per worker: sent, not yet handed out
        self._turns = itertools.islice(itertools.cycle(range(self.num_workers)),
                                       first_worker, None)

    @property
    def to_write(self) -> int | None:
        """How many batches are still to be written this epoch, once the sampler has run out
        (None before)."""
        return self.outstanding if self.all_sent else None

    def next_worker(self) -> int | None:
        """The worker the next task goes to, or None if none may take one now."""
        for _ in range(self.num_workers):
            worker_id = next(self._turns)
            if worker_id < self.workers and self.active[worker_id] and (
                    self.in_order or self.in_flight[worker_id]
                    < self.max_tasks // sum(self.active[:self.workers])):
                return worker_id
        return None

    def add(self, worker_id: int, index, position: int | None, seed: int | None = None) -> int:
        """Record a task sent; its ``send_idx``.

        Args:
            worker_id: the worker it goes to.
            index: the sampler's indices.
            position: its batch's place in the epoch's order (resume.py).
            seed: its batch's own seed (num_workers="auto"), or None.
        """
        idx = self.send_idx
        self.tasks[idx] = Sent(worker_id, index, position, seed=seed)
        self.in_flight[worker_id] += 1
        self.outstanding += 1
        self.send_idx += 1
        return idx

    def due(self) -> Sent | None:
        """The task to hand out next (its result in or still to come), passing over those of
        workers that ended their IterableDataset; None once every task was handed out."""
        while self.rcvd_idx < self.send_idx:
            task = self.tasks.get(self.rcvd_idx)
            if task:
                if not task.pending or self.active[task.worker_id]:
                    return task
                del self.tasks[self.rcvd_idx]
            self.rcvd_idx += 1
        return None

    def take(self, idx: int) -> Sent:
        """Remove task ``idx`` to hand it out (the next in order, or any with in_order off)."""
        if idx == self.rcvd_idx:
            self.rcvd_idx += 1
        return self.tasks.pop(idx)

    def handed_out(self, task: Sent) -> None:
        self.in_flight[task.worker_id] -= 1

    def pending_of(self, worker_id: int) -> list[int]:
        """The tasks ``worker_id`` owes, in order (a replacement gets them again)."""
        return sorted(i for i, task in self.tasks.items()
                      if task.worker_id == worker_id and task.pending)
