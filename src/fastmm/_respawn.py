"""Workers started, and started again: in the place of one that died (on_worker_failure=
"respawn") or that was stuck on one sample past the decode deadline."""

from __future__ import annotations

import logging
from . import resume
from ._messages import Restore, Task
from ._processes import WorkerProcesses, how_it_ended
from ._tasks import TaskTable, WorkerRecord

log = logging.getLogger("fastmm")
MAX_DEATHS_PER_TASK = 3  # a batch that kills a worker this often is the batch's fault


class Respawner:
    """Starts each worker, and a replacement from what the iterator kept of the one it
    replaces after its last batch received (its ``WorkerRecord``: RNG states, iterator state,
    skip counts), given that one's unfinished tasks again, in order: nothing lost or repeated.

    Args:
        workers: the worker processes.
        records: what is kept of each worker, by worker id.
        counters: the dataset's skip counts (offers.skip_counts), or None.
        per_batch: the IterableDataset samples a worker pulls and drops to get past a batch
            it made (0 for map-style datasets: their tasks name their indices).
    """

    def __init__(self, workers: WorkerProcesses, records: list[WorkerRecord], counters,
                 per_batch: int):
        self.workers, self.records, self.counters = workers, records, counters
        self.per_batch = per_batch
        self.replacements = 0  # workers replaced (respawned, or past the decode deadline)

    def start(self, worker_id: int, restore: Restore, shared_seed: int) -> None:
        if self.counters is not None:  # its row as it starts
            self.records[worker_id].counts = self.counters.row(worker_id)
        self.workers.start(worker_id, restore, shared_seed)

    def replace(self, worker_id: int, table: TaskTable, shared_seed: int,
                fault: bool = True) -> None:
        """A new worker in the place of a dead one, or of one stuck past the decode deadline.
        It starts from the RNG states after the last batch received from the old one; an
        IterableDataset worker also goes on from its iterator state then, or pulls and drops
        what was received.

        Args:
            worker_id: the worker to replace.
            table: the epoch's tasks; those it owed go to the replacement.
            shared_seed: the epoch's shared seed (IterDataPipe).
            fault: whether the worker died (counted against its batches: one that kills its
                worker MAX_DEATHS_PER_TASK times is the batch's fault) or was stuck.
        """
        lost = table.pending_of(worker_id)
        for i in lost if fault else ():
            table.tasks[i].deaths += 1
            if table.tasks[i].deaths > MAX_DEATHS_PER_TASK:
                why = how_it_ended(self.workers.processes[worker_id].exitcode)
                raise RuntimeError(
                    f"DataLoader worker {worker_id} died {table.tasks[i].deaths} times on the "
                    f"same batch (indices {table.tasks[i].index}; last: {why}); not respawning")
        self.replacements += 1
        self.workers.end(worker_id)
        record = self.records[worker_id]
        iter_state = resume.usable(record.iter_state)
        skip = 0 if iter_state is not None else record.received * self.per_batch
        if self.counters is not None and len(self.records) < self.counters.ROWS:
            # what it counted in tasks whose batches were lost, the replacement counts again;
            # pulling and dropping, it counts again what it met before them as well
            self.counters.set_row(worker_id, record.epoch_counts if skip else record.counts)
        self.start(worker_id, Restore(record.rng, skip, iter_state), shared_seed)
        for i in lost:
            sent = table.tasks[i]
            self.workers.index_queues[worker_id].put(Task(i, sent.index, 0.0, sent.seed))

    def replace_stuck(self, deadlines: list, table: TaskTable, shared_seed: int) -> list[int]:
        """Workers on one sample past the decode deadline: the sample is marked expired (the
        replacement meets it first and counts it, by the dataset's bad-input policy), the
        worker is killed and replaced. A decoder stuck in C can be stopped no other way."""
        active = [i for i, on in enumerate(table.active) if on]
        stuck = [(deadline, worker_id, item) for deadline in deadlines
                 for worker_id, item in deadline.overdue(active)]
        for deadline, worker_id, item in stuck:
            if not deadline.expire(item, worker_id):
                raise RuntimeError(
                    f"more than {deadline.CAP} samples took over decode_deadline="
                    f"{deadline.seconds:g}s: the deadline is too short for this data, or "
                    "the decoder is broken")
            log.warning("fastmm: worker %d (pid %d) spent over decode_deadline=%gs on sample "
                        "%d: replacing it", worker_id, self.workers.processes[worker_id].pid,
                        deadline.seconds, item)
            self.workers.kill(worker_id)
            self.replace(worker_id, table, shared_seed, fault=False)
        return [worker_id for _, worker_id, _ in stuck]
