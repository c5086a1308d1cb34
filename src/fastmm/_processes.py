"""The loader's worker processes: started, replaced, ended, and never left behind (at exit,
or with the loader's process killed: see _workers._exit_when_orphaned).

A worker has three channels to the main process: its index queue (tasks in), its result pipe
(batches out) and a socket that carries slabs' descriptors both ways (the slabs it creates; the
pool's table and slabs of other workers it may claim). The slab pool knows a worker by its
channel number: a replacement gets a new one, so what the pool's table says its predecessor
had claimed cannot be taken for its own.
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing.connection
import os
import pickle
import queue
import signal
import socket
import threading
import time
import warnings

from . import _torch
from ._messages import Restore, Stop, WorkerSpec
from ._workers import StopFlag, worker_loop
from .slabs import SlabPool, open_files_guard

STATUS_CHECK_INTERVAL_S = _torch.MP_STATUS_CHECK_INTERVAL
START_WAIT_S = 5.0  # a worker starting longer than this does not hold the next back
_OPEN_WORKERS: dict[int, "WorkerProcesses"] = {}  # id -> each pool not yet shut down


class WorkerProcesses:
    """The loader's worker processes running ``_workers.worker_loop``, and their channels, by
    worker id.

    Args:
        num_workers: how many.
        context: the multiprocessing context they start in.
        slab_pool: the main process's slab pool, which each worker's fd socket joins.
        spec: what they share; each gets its own id, channels and ``Restore``.
        warn_as_torch: calls a warning function as torch's module would (its warnings'
            filters then apply).
    """

    def __init__(self, num_workers: int, context, slab_pool: SlabPool, spec: WorkerSpec,
                 warn_as_torch):
        self.context, self.slab_pool, self.spec = context, slab_pool, spec
        self.owner_pid = os.getpid()
        if context.get_start_method() == "forkserver":
            preload_in_forkserver(context)
        self.done_event = StopFlag(context)
        self.processes: list = [None] * num_workers
        self.index_queues: list = [None] * num_workers
        self.result_conns: list = [None] * num_workers
        self.fd_socks: list = [None] * num_workers
        self.channels = list(range(num_workers))
        self._warn_as_torch = warn_as_torch
        self.signal_id = None  # the key its pids have in torch's SIGCHLD handler, if any
        # Under spawn each worker starts an interpreter and imports torch and the dataset's
        # modules (a second of CPU or more); under forkserver, what the server had not (the
        # dataset's: torchvision for an ImageFolder). Started all at once on fewer cores, they
        # would share them, and the first batch would wait for every one. So no more start at
        # once than there are cores; each says on this pipe when it has started.
        self.ready_recv = self.ready_send = None
        if context.get_start_method() in ("spawn", "forkserver"):
            from .doctor import usable_cores

            self.ready_recv, self.ready_send = context.Pipe(duplex=False)
            self.cores = usable_cores()
        self.starting: dict = {}  # pid -> (process, when): not started yet
        # Registered apart from the iterator: if the iterator dies in a reference cycle, its
        # channels must not be finalized (closed) before its own shutdown closes them.
        _OPEN_WORKERS[id(self)] = self

    def start(self, worker_id: int, restore: Restore, shared_seed: int) -> None:
        """Start worker ``worker_id`` from ``restore`` (resume.py)."""
        ends = []  # closed again if the worker cannot start
        if self.ready_recv is not None:
            self._wait_for_a_core()
        try:
            with open_files_guard(f"starting DataLoader worker {worker_id}"):
                index_queue = self.context.Queue()
                index_queue.cancel_join_thread()
                ends.append(index_queue)
                ends.extend(self.context.Pipe(duplex=False))
                ends.extend(socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET))
                result_recv, result_send, fd_main, fd_worker = ends[1:]
                process = self.context.Process(
                    target=worker_loop,
                    args=(dataclasses.replace(
                        self.spec, index_queue=index_queue, result_conn=result_send,
                        fd_sock=fd_worker, done_event=self.done_event, worker_id=worker_id,
                        shared_seed=shared_seed, restore=restore,
                        start_method=self.context.get_start_method(), main_pid=self.owner_pid,
                        ready_conn=self.ready_send),),
                    name=f"fastmm-worker-{worker_id}",
                    daemon=True,
                )
                start_on_a_lasting_thread(process.start)
        except BaseException as e:
            for end in ends:
                end.close()
            if isinstance(e, (TypeError, AttributeError, pickle.PicklingError)):
                self._warn_as_torch(  # torch's words (spawn and forkserver pickle the arguments)
                    warnings.warn, "Got pickle error when attempting to start a worker Process. This might be "
                    "because the worker Process arguments are not picklable. Python 3.14+ "
                    "changed the multiprocessing start method in non-Mac POSIX platforms to "
                    "'forkserver', which requires the worker Process arguments to be picklable. "
                    "You can also try multiprocessing.set_start_method('fork').", UserWarning)
            raise
        result_send.close()
        fd_worker.close()
        if self.ready_recv is not None:
            self.starting[process.pid] = (process, time.monotonic())
        self.index_queues[worker_id] = index_queue
        self.processes[worker_id] = process
        self.result_conns[worker_id] = result_recv
        self.fd_socks[worker_id] = fd_main
        self.slab_pool.connect(self.channels[worker_id], fd_main)

    def _wait_for_a_core(self) -> None:
        """Until fewer workers are starting than there are cores: those that said they have
        started, died, or took START_WAIT_S (waiting on something other than a core: a file
        system, a lock) no longer count."""
        while True:
            while self.ready_recv.poll():
                self.starting.pop(int.from_bytes(self.ready_recv.recv_bytes(), "little"), None)
            now = time.monotonic()
            self.starting = {pid: (process, since) for pid, (process, since)
                             in self.starting.items()
                             if process.exitcode is None and now - since < START_WAIT_S}
            if len(self.starting) < self.cores:
                return
            first = min(since for _, since in self.starting.values())
            multiprocessing.connection.wait(
                [self.ready_recv, *(process.sentinel for process, _ in self.starting.values())],
                first + START_WAIT_S - now)

    def end(self, worker_id: int) -> None:
        """End worker ``worker_id`` (dead, or lingering with its channel broken: it must not
        write on) and close its channels; ``start`` puts another in its place, whose channel
        number is new."""
        old = self.processes[worker_id]
        if old.is_alive():
            old.terminate()
        old.join(timeout=STATUS_CHECK_INTERVAL_S)
        self.result_conns[worker_id].close()
        self.fd_socks[worker_id].close()
        self.index_queues[worker_id].close()
        self.slab_pool.forget(self.channels[worker_id])
        self.channels[worker_id] = max(self.channels) + 1

    def stop(self, worker_id: int) -> None:
        """Tell worker ``worker_id`` to exit once it is done with what it was given."""
        self.index_queues[worker_id].put(Stop())

    def kill(self, worker_id: int) -> None:
        """SIGKILL: a worker stuck in C can be stopped no other way."""
        process = self.processes[worker_id]
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.join(timeout=STATUS_CHECK_INTERVAL_S)

    def failure(self, failed: list[int]) -> RuntimeError:
        """The error for workers that died or closed their channel, in torch's words."""
        details = "; ".join(f"worker {i} (pid {self.processes[i].pid}): "
                            f"{how_it_ended(self.processes[i].exitcode)}" for i in failed)
        pid, exitcode = self.processes[failed[0]].pid, self.processes[failed[0]].exitcode
        if exitcode is not None and exitcode < 0:  # (torch's SIGCHLD handler's)
            return RuntimeError(f"DataLoader worker (pid {pid}) is killed by signal: "
                                f"{how_it_ended(exitcode)}. ({details})")
        pids = ", ".join(str(self.processes[i].pid) for i in failed)
        return RuntimeError(f"DataLoader worker (pid(s) {pids}) exited unexpectedly: {details}")

    def tell_torch(self, owner: int) -> bool:
        """Give torch's SIGCHLD handler the started workers' pids, under ``owner`` (the
        iterator's id), again each time more start: a death is then torch's to report.
        Returns True: they are set (torch's ``_worker_pids_set``)."""
        if self.signal_id:
            _torch.remove_worker_pids(self.signal_id)
        _torch.set_worker_pids(owner, tuple(w.pid for w in self.started()))
        _torch.set_sigchld_handler()
        self.signal_id = owner
        return True

    def untell_torch(self) -> bool:
        """Take their pids back from torch's handler (their ends are no failures then);
        returns False: they are not set."""
        if self.signal_id:
            _torch.remove_worker_pids(self.signal_id)
            self.signal_id = None
        return False

    def started(self) -> list:
        """The worker processes, less any that never started (a start that failed)."""
        return [process for process in self.processes if process is not None]

    def close(self, join_s: float) -> None:
        """Close the result channels (a worker blocked on sending gets EPIPE and exits), give
        the workers ``join_s`` to go, end those still there; then close the rest."""
        for conn in filter(None, self.result_conns):
            conn.close()
        # unmapped before the join: the exiting workers then free the slabs' pages, in
        # parallel, instead of this thread after them
        self.slab_pool.close()
        deadline = time.monotonic() + join_s
        for process in self.started():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for index_queue in filter(None, self.index_queues):
            index_queue.cancel_join_thread()
            index_queue.close()

    def forget(self) -> None:
        """After close (or in its place, when it failed): end what is left, close the sockets."""
        end_processes(self.started())
        for sock in filter(None, self.fd_socks):
            sock.close()
        if self.ready_recv is not None:
            self.ready_recv.close()
            self.ready_send.close()
        _OPEN_WORKERS.pop(id(self), None)


def preload_in_forkserver(context) -> None:
    """Have the forkserver, if it has not started yet, import what every worker imports (torch,
    fastmm's worker side) once, beside what it preloads already (``__main__``), so that each
    worker it forks has them instead of importing them anew: seconds per worker."""
    from multiprocessing import forkserver

    modules = list(getattr(forkserver._forkserver, "_preload_modules", None) or ["__main__"])
    if "fastmm._workers" not in modules:
        context.set_forkserver_preload(modules + ["fastmm._workers"])


@atexit.register
def _close_open_workers() -> None:
    """At exit, close the channels of pools still open (persistent workers), as their own
    shutdown would: torch skips that shutdown at exit, and the workers then see their loop gone.
    Then end the workers: multiprocessing's exit handler (registered before this one, so it
    runs after) would wait without end for one that outlives SIGTERM."""
    workers = []
    for pool_id, pool in list(_OPEN_WORKERS.items()):
        for channel in [*pool.result_conns, *pool.fd_socks]:
            if channel is not None:
                channel.close()
        if pool.owner_pid == os.getpid():  # (a forked child's copy names its parent's workers)
            workers += pool.started()
            if pool.signal_id:  # their ends are not failures for torch's SIGCHLD handler
                try:
                    _torch.remove_worker_pids(pool.signal_id)
                except (RuntimeError, ValueError):
                    pass
    _OPEN_WORKERS.clear()
    end_processes(workers)


def how_it_ended(exitcode: int | None) -> str:
    """A dead worker's end in words: the signal that killed it, or its exit code."""
    if exitcode is None:
        return "closed its result channel and did not exit"
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return signal.strsignal(-exitcode) or signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def end_processes(processes: list) -> None:
    """SIGTERM, one wait for all, then SIGKILL for any still there: one stopped (SIGSTOP, a
    debugger) or ignoring SIGTERM, which torch's loader and multiprocessing leave behind or
    wait for without end."""
    lingering = [process for process in processes if process.is_alive()]
    for process in lingering:
        process.terminate()
    deadline = time.monotonic() + STATUS_CHECK_INTERVAL_S
    for process in lingering:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in lingering:
        if process.is_alive():
            process.kill()
            process.join(timeout=STATUS_CHECK_INTERVAL_S)


_starter: tuple[int, queue.SimpleQueue] | None = None  # (pid, its starter thread's tasks)
_starter_lock = threading.Lock()


def start_on_a_lasting_thread(start) -> None:
    """``start()`` (a worker's ``Process.start``) on a thread that lives as long as this
    process: the main thread, or else one daemon thread kept for it. The kernel's parent-death
    signal, which ends a worker the moment the loader's process dies (even one stuck in C with
    the GIL held), follows the thread that forked the worker: from a loop's own thread it would
    end the workers with that thread, so it could not be used there."""
    global _starter
    if threading.current_thread() is threading.main_thread():
        start()
        return
    with _starter_lock:
        if _starter is None or _starter[0] != os.getpid():  # (none in a forked child)
            tasks: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_serve_starts, args=(tasks,), daemon=True,
                             name="fastmm-worker-starter").start()
            _starter = (os.getpid(), tasks)
    done: queue.SimpleQueue = queue.SimpleQueue()
    _starter[1].put((start, done))
    error = done.get()
    if error is not None:
        raise error


def _serve_starts(tasks: queue.SimpleQueue) -> None:
    while True:
        start, done = tasks.get()
        try:
            start()
        except BaseException as exc:  # raised again in the thread that asked
            done.put(exc)
        else:
            done.put(None)
        del start, done
