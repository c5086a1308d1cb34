"""The shared-memory slab pool, over the kernels of fastmm._C or its twin (_native.py).

Workers write batches into slabs of one pool that all of them share; the main process maps each
slab once and wraps regions of it as tensors without copying. A slab is lent to one batch at a
time and goes back to the pool when the last tensor viewing it is freed; the next worker to
start a batch claims it, whichever worker wrote it before. So the pool holds about the batches
in flight, as torch does (a ring per worker would keep a free slab waiting for that worker's
next batch), and users may keep batches as long as they like: the pool grows when all slabs
are held and shrinks back when they are released.

Who may write which slab is in a small shared table (SlabTable): each slab's slot is empty,
taken or free, changed under a POSIX record lock that the kernel drops if its holder dies. A
worker that creates a slab sends its descriptor to the main process, which passes it on to the
other workers when the slab is first free (news on each worker's fd socket).

Idle memory goes back when the time the loop has to spare is several times what getting it
back will cost. Unmapping a slab (its pages stay in the slab file) costs a fault per page to map
it again (~0.1 ms/MB to read); giving its pages back to the system (a hole punched in the file)
costs reserving, zeroing and mapping them again before the next write (~0.45 ms/MB, measured).
Both follow the loop's own time outside next() (a paced, GPU-bound loop): the main process
unmaps a slab the loop releases at 5x the read cost and gives it back at 5x both costs; a
worker, told that time with each task, unmaps every slab once its batch is sent and gives back
the free ones at 3x the refill cost. Time the loop spends waiting for data does not count: the
slab it lets go of then is claimed by the next batch a worker starts. Free slabs no worker
claimed for IDLE_FREE_S (the pool grew for a burst), and everything a worker without work for
IDLE_WORKER_S maps, go back whatever the pace. FASTMM_SLAB_MEMORY=lean does all of it for
every batch: the least memory at full speed, for the cost of every batch's pages reserved and
faulted in again.

Slabs are unnamed files on /dev/shm (O_TMPFILE; memfd where unsupported) passed between
processes as file descriptors, so no crash or ``kill -9`` can leave one behind. Their space is
reserved at creation, and again before a write into one whose pages went back, so a full
/dev/shm raises SharedMemoryError instead of a SIGBUS later.
"""

from __future__ import annotations

import array
import collections
import contextlib
import errno
import fcntl
import mmap
import os
import resource
import shutil
import socket
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ._messages import SLAB_NEWS_BYTES, NewSlab, SlabNews
from ._native import native_backend
from .config import TransportConfig

ALIGN = 64  # every region starts on a cache line, so any dtype view is aligned
_GRANULE = mmap.PAGESIZE  # slab sizes are rounded up to whole pages
IDLE_TRIM_S = 0.02  # below this much spare time per step, never unmap
IDLE_WORKER_S = 1.0  # a worker with no work this long drops its mappings whatever the loop does
IDLE_FREE_S = 1.0  # a slab free this long (more than the loop needs) gives its pages back
TABLE_PATIENCE_S = 10.0  # the main process's wait for the slab table's lock, at most
_READ_REMAP_S_PER_BYTE = 0.1e-9  # faulting a slab's pages back in to read them (main)
REFILL_S_PER_BYTE = 0.45e-9  # reserving a punched slab again and mapping it (worker: 34 ms
# for 77 MB on a 2-core Xeon VM, where an unmapped one takes 8 ms to map back)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels answer EINVAL and writes fault instead


class SharedMemoryError(RuntimeError):
    """The slabs need more shared memory than the system will reserve."""


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _shm_error(exc: OSError, nbytes: int, shm_dir: str) -> SharedMemoryError:
    try:
        usage = shutil.disk_usage(shm_dir)
        where = f"{shm_dir} has {usage.free:,} bytes free of {usage.total:,}"
    except OSError:
        where = f"{shm_dir} is not usable"
    return SharedMemoryError(
        f"fastmm could not reserve a {nbytes:,}-byte shared-memory slab for a batch "
        f"({os.strerror(exc.errno or 0)}): {where}. Give the container more shared memory "
        "(e.g. docker --shm-size), set FASTMM_SHM_DIR to a larger tmpfs, or lower batch_size, "
        "prefetch_factor or num_workers."
    )


@contextlib.contextmanager
def open_files_guard(doing: str):
    """Running out of file descriptors raises torch's kind of error (RuntimeError, "Too many
    open files") with fastmm's remedies, instead of a bare OSError from deep in the transport."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        raise _too_many_files(doing) from exc


def _too_many_files(doing: str) -> RuntimeError:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return RuntimeError(
        f"Too many open files while {doing} (this process may open {soft}). Each DataLoader "
        "worker holds a few descriptors, and each slab the main process maps holds one (about "
        "prefetch_factor + 2 per worker, more while batches are kept alive). Raise the limit "
        "(`ulimit -n`), lower num_workers or prefetch_factor, or keep fewer batches."
    )


_EMPTY, _TAKEN, _FREE = 0, 1, 2  # a slot's states in the table (an unused one is zeros)
_SLOTS = 16384  # slabs alive at once, all workers together
_HEADER = 64  # the table's first cache line: the largest batch so far (bytes)
_ENTRY = np.dtype([("state", "u1"), ("punched", "u1"), ("owner", "<i4"), ("generation", "<u4")],
                  align=True)
_TABLE_BYTES = _HEADER + _SLOTS * _ENTRY.itemsize


class SlabTable:
    """The pool's shared state: each slab's slot (its number in every process) is empty, taken
    (a worker writes it, or the loop holds its batch) or free (the next worker to start a
    batch may claim it). Changed only under a POSIX record lock on the table's file, which the
    kernel drops if the process holding it dies."""

    def __init__(self, fd: int, patience_s: float | None = None):
        """``patience_s``: how long to wait for the lock before raising (the main process must
        not hang on a worker stopped while holding it); None: as long as it takes."""
        self.fd = fd
        self._patience_s = patience_s
        self._mm = mmap.mmap(fd, _TABLE_BYTES, flags=mmap.MAP_SHARED)
        self._largest = np.frombuffer(self._mm, dtype="<u8", count=1)
        entries = np.frombuffer(self._mm, dtype=_ENTRY, count=_SLOTS, offset=_HEADER)
        self._state, self._punched = entries["state"], entries["punched"]
        self._owner, self._generation = entries["owner"], entries["generation"]

    @classmethod
    def create(cls, patience_s: float | None = None) -> "SlabTable":
        with open_files_guard("creating the slab pool's table"):
            fd = os.memfd_create("fastmm-slab-table", os.MFD_CLOEXEC)
        os.ftruncate(fd, _TABLE_BYTES)
        return cls(fd, patience_s)

    @contextlib.contextmanager
    def _locked(self):
        if self._patience_s is None:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
        else:
            deadline = time.monotonic() + self._patience_s
            while True:
                try:
                    fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"a DataLoader worker has held fastmm's slab table for over "
                            f"{self._patience_s:g} s (stopped by SIGSTOP or a debugger?)"
                        ) from None
                    time.sleep(0.001)
        try:
            yield
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)

    @property
    def largest(self) -> int:
        """Bytes of the largest batch written so far, by any worker."""
        return int(self._largest[0])

    def note_batch(self, nbytes: int) -> None:
        if nbytes > self._largest[0]:
            with self._locked():
                self._largest[0] = max(int(self._largest[0]), nbytes)

    def claim(self, candidates: list[tuple[int, int]], owner: int, unpunched: bool = False,
              first: bool = True) -> list[tuple[int, bool]]:
        """Take free slabs among ``candidates`` for ``owner``. Returns [(slot, whether its
        pages went back)].

        Args:
            candidates: (slot, generation) pairs, in the order preferred; a slot is taken only
                while its generation is still that one.
            owner: who takes them: a worker's channel, or -1 for the main process.
            unpunched: take only those whose pages are there.
            first: take the first one; False: all.
        """
        taken = []
        with self._locked():
            for slot, generation in candidates:
                if self._state[slot] == _FREE and self._generation[slot] == generation \
                        and not (unpunched and self._punched[slot]):
                    self._state[slot], self._owner[slot] = _TAKEN, owner
                    taken.append((slot, bool(self._punched[slot])))
                    if first:
                        break
        return taken

    def give_back(self, candidates: list[tuple[int, int]], owner: int, slabs: dict,
                  keep: int = 0) -> None:
        """Give back the pages of free slabs that still have theirs.

        Args:
            candidates: (slot, generation) pairs, as for ``claim``.
            owner: who holds them meanwhile: a worker's channel, or -1 for the main process.
            slabs: each slot's slab (its ``mm``, the mapping to punch).
            keep: how many of them keep their pages.
        """
        if len(candidates) <= keep:
            return
        taken = self.claim(candidates, owner, unpunched=True, first=False)
        self.free([(slot, i >= keep and _advise(slabs[slot].mm, mmap.MADV_REMOVE))
                   for i, (slot, _) in enumerate(taken)])

    def new_slot(self, owner: int) -> tuple[int, int]:
        """An empty slot, now taken by ``owner`` for a slab it creates: (slot, generation)."""
        with self._locked():
            empty = np.flatnonzero(self._state == _EMPTY)
            if not len(empty):
                raise RuntimeError(
                    f"fastmm's slab pool is full: {_SLOTS} slabs are alive, one or more for each "
                    "batch the loop keeps. Keep fewer batches alive (copy what you keep).")
            slot = int(empty[0])
            self._state[slot], self._owner[slot], self._punched[slot] = _TAKEN, owner, 0
            self._generation[slot] += 1
            return slot, int(self._generation[slot])

    def free(self, slots: list[tuple[int, bool]]) -> None:
        """Put taken slabs back for any worker to claim: [(slot, whether its pages went back)]."""
        with self._locked():
            for slot, punched in slots:
                self._punched[slot], self._state[slot] = punched, _FREE

    def empty(self, slots: list[int], only_free: bool = False) -> list[int]:
        """Empty slots (their slabs are closed): all, or those still free. Returns them."""
        emptied = []
        with self._locked():
            for slot in slots:
                if not only_free or self._state[slot] == _FREE:
                    self._state[slot] = _EMPTY
                    emptied.append(slot)
        return emptied

    def release_claims(self, owner: int, pooled: set[int]) -> None:
        """A worker died: the slabs it had taken and not handed over are free again if the main
        process maps them (``pooled``: pages unknown, so counted as given back), else empty."""
        with self._locked():
            for slot in np.flatnonzero((self._state == _TAKEN) & (self._owner == owner)):
                slot = int(slot)
                if slot in pooled:
                    self._punched[slot], self._state[slot] = 1, _FREE
                else:
                    self._state[slot] = _EMPTY

    def close(self) -> None:
        del self._largest, self._state, self._punched, self._owner, self._generation
        _close_quietly(self._mm)
        os.close(self.fd)


@dataclass
class _MappedSlab:
    mm: mmap.mmap
    fd: int  # kept to reserve the space again after its pages went back (punched)
    capacity: int
    generation: int
    address: int
    trimmed: bool = False  # this process maps none of its pages


def _map_slab(fd: int, capacity: int, generation: int, populate: bool, doing: str) -> _MappedSlab:
    """A slab's shared memory mapped into this process.

    Args:
        fd: the slab's file descriptor, which the mapping keeps.
        capacity: the slab's bytes.
        generation: its slot's generation as the slab was made.
        populate: map every page now (MAP_POPULATE); else pages enter as they are read, and
            the slab counts as ``trimmed``.
        doing: what this process is doing, for the error if it runs out of file descriptors.
    """
    with open_files_guard(doing):  # the mapping keeps a duplicate descriptor
        mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0))
    return _MappedSlab(mm, fd, capacity, generation, _address(mm), trimmed=not populate)


def _close_slab(slab: _MappedSlab) -> None:
    _close_quietly(slab.mm)
    os.close(slab.fd)


class SlabWriter:
    """Worker side: claims slabs of the pool (or creates them) and hands out regions of them
    for one batch."""

    def __init__(self, fd_sock: socket.socket, config: TransportConfig):
        self._fd_sock = fd_sock
        self._config = config
        self._native = native_backend(config)
        self._table: SlabTable | None = None  # the first news from the main process
        self._channel = -1  # this worker's number in the table
        self._slabs: dict[int, _MappedSlab] = {}  # by slot: every slab this worker maps
        self._batch: list[list[int]] = []  # [slot, bytes used] for the batch being written
        self._created: list[int] = []  # slots created for this batch, not yet sent
        self.loop_spare_s = 0.0  # set from each task: the loop's last step outside next()
        self.batch_bytes = 0  # what the last finished batch took in slabs

    @property
    def gather(self):
        return self._native.gather

    @property
    def planes(self):
        return self._native.planes

    def _sync(self, wait: bool = False) -> None:
        """Take in the main process's news: the table (``wait``: waited for, if not here
        yet), slabs this worker may claim, slabs gone."""
        while True:
            flags = 0 if wait and self._table is None else socket.MSG_DONTWAIT
            try:
                data, fds, _ = _recv_fds(self._fd_sock, SLAB_NEWS_BYTES, 1, flags)
            except BlockingIOError:
                return
            if not data:  # the main process closed its end: nothing more will come
                if self._table is None:
                    raise EOFError("the main process closed the slab channel")
                return
            news = SlabNews.unpack(data)
            if news.kind == SlabNews.TABLE:
                if self._table is not None:
                    self._table.close()
                self._table, self._channel = SlabTable(fds[0]), news.channel
                continue
            old = self._slabs.get(news.slot)
            if old is not None and (news.kind == SlabNews.FREE
                                    or old.generation == news.generation):
                _close_slab(self._slabs.pop(news.slot))  # gone, or its slot holds another now
            if news.kind == SlabNews.FREE:
                self._slabs[news.slot] = _map_slab(fds[0], news.capacity, news.generation, False,
                                                   "mapping a shared-memory slab in a worker")

    def begin(self) -> None:
        self._batch = []

    def trim(self) -> None:
        """Stop mapping every slab's pages, and give free slabs' pages back to the system:
        batches waiting for the loop count in no process, and free slabs take no memory,
        until they are used (the next write reserves and maps a slab back)."""
        self._sync()
        for slab in self._slabs.values():
            if not slab.trimmed:
                _advise(slab.mm, mmap.MADV_DONTNEED)
                slab.trimmed = True
        if self._table is not None:
            known = [(slot, slab.generation) for slot, slab in self._slabs.items()]
            self._table.give_back(known, self._channel, self._slabs)

    def alloc(self, nbytes: int) -> tuple[int, int, memoryview]:
        """A writable region of ``nbytes`` for the current batch: (slot, offset, view)."""
        for entry in self._batch:
            slot, used = entry
            start = _round_up(used, ALIGN)
            if start + nbytes <= self._slabs[slot].capacity:
                entry[1] = start + nbytes
                return slot, start, memoryview(self._slabs[slot].mm)[start : start + nbytes]
        slot = self._take(nbytes)
        self._batch.append([slot, nbytes])
        return slot, 0, memoryview(self._slabs[slot].mm)[:nbytes]

    def locate(self, address: int, nbytes: int) -> tuple[int, int] | None:
        """(slot, offset) if [address, address+nbytes) lies in a slab of the current batch."""
        for slot, used in self._batch:
            slab = self._slabs[slot]
            if slab.address <= address and address + nbytes <= slab.address + used:
                return slot, address - slab.address
        return None

    def finish(self) -> tuple[list[int], list[NewSlab]]:
        """End the batch: send new slabs' fds; return the slots it used and the slabs it
        created."""
        used = [slot for slot, _ in self._batch]
        nbytes = self.batch_bytes = sum(n for _, n in self._batch)
        if self._table is not None:
            self._table.note_batch(nbytes)
        refill_s = REFILL_S_PER_BYTE * nbytes
        # a paced loop leaves time to reserve and map slabs again (a decode-bound one does not:
        # its next batch claims the slab the loop lets go of)
        if (self._config.slab_memory == "lean"
                or self.loop_spare_s >= max(IDLE_TRIM_S, 3 * refill_s)):
            self.trim()
        self._batch = []
        created, self._created = self._created, []
        if created:
            socket.send_fds(self._fd_sock, [bytes([len(created)])],
                            [self._slabs[slot].fd for slot in created])
        return used, [NewSlab(slot, self._slabs[slot].generation, self._slabs[slot].capacity)
                      for slot in created]

    def _take(self, nbytes: int) -> int:
        # A batch's first region asks for a slab that can hold the largest batch seen so far,
        # so that one slab usually carries the whole batch; a batch outgrowing its slabs asks for
        # as much again as it holds, so it takes a few slabs, not one per tensor: a handful of
        # descriptors to send, never near the 253 Linux passes in one message.
        self._sync(wait=True)
        held = sum(used for _, used in self._batch)
        want = max(nbytes, held) if self._batch else max(nbytes, self._table.largest)
        fitting = sorted((slab.capacity, slot, slab.generation)
                         for slot, slab in self._slabs.items() if slab.capacity >= want)
        claimed = self._table.claim([(slot, gen) for _, slot, gen in fitting], self._channel)
        if claimed:
            slot, punched = claimed[0]
            slab = self._slabs[slot]
            if punched:  # a full /dev/shm is an error here, not a SIGBUS at the write
                try:
                    self._reserve(slab.fd, slab.capacity)
                except BaseException:
                    self._table.free([(slot, True)])
                    raise
            if slab.trimmed:  # map it back in one call rather than a fault per page
                _advise(slab.mm, _MADV_POPULATE_WRITE)
                slab.trimmed = False
            return slot
        capacity = _round_up(want, _GRANULE)
        slot, generation = self._table.new_slot(self._channel)
        try:
            with self._no_space_is_an_error(capacity), \
                    open_files_guard("creating a shared-memory slab in a worker"):
                fd = self._native.create_slab(self._config.shm_dir, capacity)
            try:
                self._slabs[slot] = _map_slab(fd, capacity, generation, True,
                                              "mapping a shared-memory slab in a worker")
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            self._table.empty([slot])
            raise
        self._created.append(slot)
        return slot

    def _reserve(self, fd: int, capacity: int) -> None:
        with self._no_space_is_an_error(capacity):
            os.posix_fallocate(fd, 0, capacity)

    @contextlib.contextmanager
    def _no_space_is_an_error(self, nbytes: int):
        try:
            yield
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise _shm_error(exc, nbytes, self._config.shm_dir) from None
            raise

    def close(self) -> None:
        self._created = []
        for slab in self._slabs.values():
            _close_slab(slab)
        self._slabs.clear()
        if self._table is not None:
            self._table.close()
            self._table = None


class SlabPool:
    """Main side: owns the pool's table, maps every slab, lends batches' slabs to the loop and
    puts each back in the pool, for any worker to claim, once no tensor views it."""

    def __init__(self, keep_free: int, pin=None, unpin=None, fence=None, lean: bool = False):
        """An empty pool and its table; slabs join it as workers create them.

        Args:
            keep_free: slabs the pool keeps beyond those the loop holds (more are closed).
            pin: ``pin(address, nbytes)``, if given, page-locks each mapping once for its
                lifetime (CUDA host registration), so batches need no pinned staging copy.
            unpin: ``unpin(address)``, which undoes ``pin`` when the slab is closed.
            fence: ``fence()``, if given, marks the point a released slab's copies were queued
                up to (a CUDA event on the releasing thread's stream, with ``query()`` and
                ``synchronize()``): the slab goes back to the pool only once the fence is
                passed, so a ``non_blocking`` copy still queued is never overwritten by the
                next batch.
            lean: unmap every slab the loop releases, whatever its pace (FASTMM_SLAB_MEMORY).
        """
        self._keep = keep_free
        self._lean = lean
        self._pin, self._unpin, self._fence = pin, unpin, fence
        self._table = SlabTable.create(patience_s=TABLE_PATIENCE_S)
        self._slabs: dict[int, _MappedSlab] = {}  # by slot: every slab of the pool
        self._known_by: dict[int, set[int]] = {}  # by slot: the channels of workers mapping it
        self._held: dict[int, bool] = {}  # by slot: lent to the loop (else in the pool)
        # (slot, its fence or None), released by the loop and not yet back in the pool
        self._released: collections.deque[tuple[int, object]] = collections.deque()
        self._mapped_free: set[int] = set()  # slabs back in the pool this process still maps
        self._punched: set[int] = set()  # released with their pages given back
        self._socks: dict[int, socket.socket] = {}  # each live worker's fd socket, by channel
        self._unsent: dict[int, list[bytes]] = {}  # news of slabs gone a full socket refused
        self._last_lend = time.monotonic()
        self.loop_spare_s = 0.0  # how long the loop's last step spent outside next()
        self._freed_at: dict[int, float] = {}  # by slot: when it went back to the pool
        self._to_write: int | None = None  # batches still to be written this epoch, once known
        self._closed = False
        _raise_fd_limit()

    def keep_free(self, slabs: int) -> None:
        """Keep up to ``slabs`` free slabs from now on (the tuner changed the prefetch)."""
        self._keep = slabs

    def expect(self, batches: int | None) -> None:
        """At most ``batches`` more batches will be written this epoch (None: not known yet):
        free slabs beyond those give their pages back, so that at an epoch's end the pool holds
        the batches the loop keeps and no more, as torch's loader does."""
        self._to_write = batches
        if batches is not None and self._pin is None:
            self._table.give_back([(slot, self._slabs[slot].generation) for slot, held
                                   in self._held.items() if not held], -1, self._slabs, batches)

    def connect(self, channel: int, fd_sock: socket.socket) -> None:
        """A worker joins the pool (``channel``: its number here; a replacement gets a new
        one): it is sent the table and the free slabs."""
        self._socks[channel] = fd_sock
        socket.send_fds(fd_sock, [SlabNews(SlabNews.TABLE, channel=channel).pack()],
                        [self._table.fd])
        for slot, held in self._held.items():
            if not held:
                self._tell(slot)

    def receive(self, channel: int, new: list[NewSlab], worker_id: int) -> None:
        """Map the slabs a worker just created (``new``; their fds wait on its socket);
        ``worker_id`` for errors."""
        doing = f"mapping the slabs of DataLoader worker {worker_id}"
        _, fds, flags = _recv_fds(self._socks[channel], 1, len(new))
        adopted = 0
        try:
            if flags & socket.MSG_CTRUNC or len(fds) != len(new):  # no room for the kernel's
                raise _too_many_files(doing)
            for (slot, generation, capacity), fd in zip(new, fds):
                # Unpinned slabs map lazily: pages enter this process when the loop reads them.
                slab = _map_slab(fd, capacity, generation, self._pin is not None, doing)
                if self._pin is not None:
                    self._pin(slab.address, capacity)
                self._slabs[slot], self._known_by[slot] = slab, {channel}
                self._held[slot] = False
                adopted += 1
        finally:
            for fd in fds[adopted:]:
                os.close(fd)

    def lend(self, slots: list[int]) -> dict[int, memoryview]:
        """Views of a batch's slabs; each slab comes back when its view object is freed.

        Consumers must keep the view object itself alive, as ``torch.frombuffer`` does: a slice
        of it, or ``np.frombuffer``, shares the memory without holding the object."""
        self._last_lend = time.monotonic()
        views = {}
        for slot in slots:
            view = memoryview(self._slabs[slot].mm)
            self._held[slot] = True
            self._mapped_free.discard(slot)
            weakref.finalize(view, self._on_release, slot).atexit = False
            views[slot] = view
        return views

    def _on_release(self, slot: int) -> None:
        # May run in any thread, whenever the last tensor of a batch is freed.
        fence = self._fence() if self._fence is not None else None
        if self._closed:
            if fence is not None:
                fence.synchronize()  # its copies are done before the memory is unregistered
            self._drop(slot)
        else:
            if self._pin is None:  # as torch frees a batch, at once (page-locked ones stay)
                mm = self._slabs[slot].mm
                if self._to_write == 0 or self._spare_for(slot, give_back=True):
                    if _advise(mm, mmap.MADV_REMOVE):
                        self._punched.add(slot)
                elif self._spare_for(slot):
                    _advise(mm, mmap.MADV_DONTNEED)
            self._released.append((slot, fence))

    def step(self) -> None:
        """The loop asks for its next batch: time its step, and what it did since the last one."""
        self.loop_spare_s = time.monotonic() - self._last_lend

    def _spare_for(self, slot: int, give_back: bool = False) -> bool:
        """Whether the loop's own time (its last step outside next()) leaves time to fault
        this slab back in later (and, to ``give_back`` its pages, for a worker to reserve them
        again). Time spent waiting for data does not count: a slab let go of then is claimed
        by the next batch a worker starts."""
        per_byte = _READ_REMAP_S_PER_BYTE + (REFILL_S_PER_BYTE if give_back else 0.0)
        return self._lean or \
            self.loop_spare_s >= max(IDLE_TRIM_S, 5 * per_byte * self._slabs[slot].capacity)

    def forget(self, channel: int) -> None:
        """A worker is gone: the slabs it had claimed go back to the pool."""
        self._socks.pop(channel, None)
        self._unsent.pop(channel, None)
        for channels in self._known_by.values():
            channels.discard(channel)
        self._table.release_claims(channel, {slot for slot, held in self._held.items()
                                             if not held})

    def drain(self) -> None:
        """Put the slabs released since the last call back in the pool (beyond ``keep_free``,
        or smaller than the largest batch, they are closed instead), and tell every worker of
        them."""
        for channel in list(self._unsent):
            unsent, self._unsent[channel] = self._unsent.pop(channel), []
            for news in unsent:
                self._send(channel, news)
        outgrown = [slot for slot, held in self._held.items()
                    if not held and self._slabs[slot].capacity < self._table.largest]
        for slot in self._table.empty(outgrown, only_free=True):
            self._drop(slot)
        copying, freed = [], []
        while self._released:
            slot, fence = self._released.popleft()
            if fence is not None and not fence.query():  # a copy from it is still queued
                copying.append((slot, fence))
                continue
            self._held[slot] = False
            punched = slot in self._punched
            self._punched.discard(slot)
            pooled = sum(1 for held in self._held.values() if not held)
            if pooled > self._keep or self._slabs[slot].capacity < self._table.largest:
                self._table.empty([slot])
                self._drop(slot)
            else:
                freed.append((slot, punched))
                if self._pin is None:  # page-locked slabs stay mapped for their lifetime
                    self._mapped_free.add(slot)
        self._released.extend(copying)
        if freed:
            self._table.free(freed)
            now = time.monotonic()
            for slot, _ in freed:
                self._freed_at[slot] = now
                self._tell(slot)
        self._give_back_idle()
        for slot in [s for s in self._mapped_free if self._spare_for(s)]:  # unmap what came back
            _advise(self._slabs[slot].mm, mmap.MADV_DONTNEED)
            self._mapped_free.discard(slot)

    def _give_back_idle(self) -> None:
        """Free slabs no worker claimed for IDLE_FREE_S are more than the loop needs now (the
        pool grew for a burst): their pages go back to the system."""
        now = time.monotonic()
        idle = [(slot, self._slabs[slot].generation) for slot, at in self._freed_at.items()
                if now - at >= IDLE_FREE_S and not self._held.get(slot, True)]
        for slot, _ in idle:
            del self._freed_at[slot]
        self._table.give_back(idle, -1, self._slabs)

    def _tell(self, slot: int) -> None:
        """Send a free slab to every worker that does not map it yet."""
        slab, knowing = self._slabs[slot], self._known_by[slot]
        news = SlabNews(SlabNews.FREE, slot, slab.generation, slab.capacity).pack()
        for channel in self._socks:
            if channel not in knowing and self._send(channel, news, [slab.fd]):
                knowing.add(channel)

    def _send(self, channel: int, news: bytes, fds: list[int] = ()) -> bool:
        """Send news without waiting; news of a slab gone that the socket has no room for is
        sent again at the next drain."""
        try:
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            self._socks[channel].sendmsg([news], rights, socket.MSG_DONTWAIT)
            return True
        except BlockingIOError:
            if not fds:
                self._unsent.setdefault(channel, []).append(news)
            return False
        except OSError:  # its worker is gone: forget() follows
            return False

    def _drop(self, slot: int) -> None:
        """Close a slab whose slot is empty (or, after close, not in the table any more)."""
        slab = self._slabs.pop(slot, None)
        self._held.pop(slot, None)
        self._mapped_free.discard(slot)
        self._freed_at.pop(slot, None)
        if slab is None:
            return
        for channel in self._known_by.pop(slot, ()):
            if channel in self._socks:
                self._send(channel, SlabNews(SlabNews.GONE, slot, slab.generation).pack())
        if self._unpin is not None:
            self._unpin(slab.address)
        _close_slab(slab)

    @property
    def nbytes(self) -> int:
        """Shared memory mapped by the main process (the ``shm_bytes`` metric)."""
        return sum(slab.capacity for slab in self._slabs.values())

    def mappings(self) -> list[mmap.mmap]:
        """This process's mapping of each slab of the pool."""
        return [slab.mm for slab in self._slabs.values()]

    def close(self) -> None:
        """Drop every mapping no tensor views; held ones go when their tensors do."""
        self._closed = True
        self._socks.clear()  # the workers are ending: no more news
        while self._released:
            slot, fence = self._released.popleft()
            if fence is not None:
                fence.synchronize()  # its copies are done before the memory is unregistered
            self._held[slot] = False
        for slot in [s for s, held in self._held.items() if not held]:
            self._drop(slot)
        if self._table is not None:
            self._table.close()
            self._table = None


def cuda_page_locking() -> dict:
    """SlabPool's ``pin``, ``unpin`` and ``fence`` for pin_memory=True on CUDA: each slab is
    page-locked once for its lifetime (cudaHostRegister), so batches need no pinned copy."""
    cudart = torch.cuda.cudart()

    def pin(address: int, nbytes: int) -> None:
        _check_cuda(cudart.cudaHostRegister(address, nbytes, 0), "cudaHostRegister")

    def unpin(address: int) -> None:
        _check_cuda(cudart.cudaHostUnregister(address), "cudaHostUnregister")

    def fence() -> torch.cuda.Event:
        # On the releasing thread's current stream: the copies the loop queued from the
        # batch (x.cuda(non_blocking=True), in that stream or before dropping x in it).
        event = torch.cuda.Event()
        event.record()
        return event

    return {"pin": pin, "unpin": unpin, "fence": fence}


def _check_cuda(status, what: str) -> None:
    if int(status) != 0:
        raise RuntimeError(f"fastmm: {what} failed with CUDA error {int(status)} ({status})")


def _address(mm: mmap.mmap) -> int:
    return np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data


def _advise(mm: mmap.mmap, advice: int) -> bool:
    """madvise a whole mapping; whether the kernel took it. Only a hint: a kernel that refuses
    changes no data. MADV_DONTNEED on a shared file mapping drops this process's page-table
    entries only; MADV_REMOVE gives the pages back (a hole in the file, unmapped everywhere)."""
    try:
        mm.madvise(advice)
    except (OSError, ValueError):
        return False
    return True


def _recv_fds(sock: socket.socket, nbytes: int, maxfds: int, flags: int = 0):
    """socket.recv_fds, with ``flags`` honoured (Python 3.11's drops them): (data, fds,
    the message's flags).

    Args:
        sock: the Unix socket to read.
        nbytes: the most bytes of data to take.
        maxfds: the most file descriptors to take.
        flags: recvmsg's flags (socket.MSG_DONTWAIT, say).
    """
    data, ancillary, msg_flags, _ = sock.recvmsg(nbytes, socket.CMSG_LEN(maxfds * 4), flags)
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), msg_flags


def _close_quietly(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a region is still viewed: the mapping goes with its last view
        pass


def _raise_fd_limit() -> None:
    """Each mapped slab keeps one descriptor open; lift the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
