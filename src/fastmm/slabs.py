"""The shared-memory slab ring: the only module that touches fastmm._C (or its twin).

Workers write batches into slabs they own; the main process maps each slab once and wraps
regions of it as tensors without copying. A slab is lent to one batch at a time and goes back
to its worker when the last tensor viewing it is freed, so users may keep batches as long as
they like: the ring grows when all slabs are held and shrinks back when they are released.

Idle memory goes back when the time a process has to spare is several times what getting it
back will cost. Unmapping a slab (its pages stay in the slab file) costs a fault per page to map
it again (~0.1 ms/MB to read); giving its pages back to the system (a hole punched in the file)
costs reserving, zeroing and mapping them again before the next write (~0.45 ms/MB, measured).
The main process looks at the loop's step (waiting for data included): a slab the loop releases
is unmapped at 5x the read cost and given back at 5x both costs. A worker looks at how long the
loop spent outside next() (sent with each task: a paced, GPU-bound loop; 3x the refill cost) and
at how long its batch took to make (decoding; 20x): then it unmaps every slab once the batch is
sent and gives back the free ones, and each one that comes back; a worker without work for
IDLE_WORKER_S does so whatever the pace. A paced or decode-bound loader then holds about the
batches in flight, as torch's does, while a loop running flat out pays nothing for it.
FASTMM_SLAB_MEMORY=lean does all of it whatever the pace: torch's memory at full speed, for the
cost of every batch's pages reserved and faulted in again.

Slabs are unnamed files on /dev/shm (O_TMPFILE; memfd where unsupported) passed between
processes as file descriptors, so no crash or ``kill -9`` can leave one behind. Their space is
reserved at creation, and again before a write into one whose pages went back, so a full
/dev/shm raises SharedMemoryError instead of a SIGBUS later.
"""

from __future__ import annotations

import collections
import contextlib
import errno
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

from .config import TransportConfig

ALIGN = 64  # every region starts on a cache line, so any dtype view is aligned
_GRANULE = mmap.PAGESIZE  # slab sizes are rounded up to whole pages
IDLE_TRIM_S = 0.02  # below this much spare time per step, never unmap
PACE_STEPS = 4  # the loop's last steps whose mean is its pace, for giving pages back
IDLE_WORKER_S = 1.0  # a worker with no work this long drops its mappings whatever the loop does
_READ_REMAP_S_PER_BYTE = 0.1e-9  # faulting a slab's pages back in to read them (main)
_REFILL_S_PER_BYTE = 0.45e-9  # reserving a punched slab again and mapping it (worker: 34 ms
# for 77 MB on a 2-core Xeon VM, where an unmapped one takes 8 ms to map back)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels answer EINVAL and writes fault instead


class SharedMemoryError(RuntimeError):
    """The slabs need more shared memory than the system will reserve."""


def _load_native(pure_python: bool):
    if not pure_python:
        try:
            from . import _C

            return _C
        except ImportError:
            pass
    from . import _twin

    return _twin


def native_backend(config: TransportConfig | None = None):
    """The module that implements slab creation and gather: fastmm._C, or the twin."""
    config = config or TransportConfig.from_env()
    return _load_native(config.pure_python)


def uses_cpp(config: TransportConfig | None = None) -> bool:
    """True when the C++ extension is in use (not forced off and importable)."""
    return native_backend(config).__name__ == "fastmm._C"


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


@dataclass
class _OwnedSlab:
    mm: mmap.mmap
    fd: int  # kept to reserve the space again after its pages went back (punched)
    capacity: int
    address: int
    trimmed: bool = False  # this process maps none of its pages
    punched: bool = False  # its pages went back to the system: reserve them before a write


class SlabWriter:
    """Worker side: owns this worker's slabs and hands out regions of them for one batch."""

    def __init__(self, fd_sock: socket.socket, config: TransportConfig):
        self._fd_sock = fd_sock
        self._config = config
        self._native = _load_native(config.pure_python)
        self._slabs: dict[int, _OwnedSlab] = {}
        self._free: list[int] = []
        self._next_id = 0
        self._expected = 0  # bytes of the largest batch so far: the size a new slab starts from
        self._batch: list[list[int]] = []  # [slab_id, bytes used] for the batch being written
        self._created: list[tuple[int, int, int]] = []  # (slab_id, capacity, fd) not yet sent
        self._retired: list[int] = []  # closed here, not yet reported to the main process
        self._began = 0.0
        self._spare = False  # the last batch left time to give memory back (finish)
        self.loop_spare_s = 0.0  # set from each task: the loop's last step outside next()

    @property
    def gather(self):
        return self._native.gather

    @property
    def planes(self):
        return self._native.planes

    def apply(self, release: list[int], destroy: list[int], punched: list[int]) -> None:
        """Take back slabs the main process no longer views (``punched``: those whose pages it
        gave back); drop the ones it retired. While batches leave time to spare, a slab that
        comes back gives its pages back at once."""
        self._free.extend(release)
        for slab_id in punched:
            self._slabs[slab_id].punched = self._slabs[slab_id].trimmed = True
        if self._spare:
            self._punch(release)
        for slab_id in destroy:
            self._close(self._slabs.pop(slab_id))

    def begin(self) -> None:
        self._batch = []
        self._began = time.monotonic()

    def trim(self) -> None:
        """Stop mapping every slab's pages, and give free slabs' pages back to the system:
        batches waiting for the loop count in no process, and free slabs take no memory,
        until they are used (the next write reserves and maps a slab back)."""
        for slab in self._slabs.values():
            if not slab.trimmed:
                _advise(slab.mm, mmap.MADV_DONTNEED)
                slab.trimmed = True
        self._punch(self._free)

    def _punch(self, slab_ids: list[int]) -> None:
        for slab_id in slab_ids:
            slab = self._slabs[slab_id]
            if not slab.punched:
                slab.punched = slab.trimmed = _advise(slab.mm, mmap.MADV_REMOVE)

    def alloc(self, nbytes: int) -> tuple[int, int, memoryview]:
        """A writable region of ``nbytes`` for the current batch: (slab id, offset, view)."""
        for entry in self._batch:
            slab_id, used = entry
            start = _round_up(used, ALIGN)
            if start + nbytes <= self._slabs[slab_id].capacity:
                entry[1] = start + nbytes
                return slab_id, start, memoryview(self._slabs[slab_id].mm)[start : start + nbytes]
        slab_id = self._take(nbytes)
        self._batch.append([slab_id, nbytes])
        return slab_id, 0, memoryview(self._slabs[slab_id].mm)[:nbytes]

    def locate(self, address: int, nbytes: int) -> tuple[int, int] | None:
        """(slab id, offset) if [address, address+nbytes) lies in a slab of the current batch."""
        for slab_id, used in self._batch:
            slab = self._slabs[slab_id]
            if slab.address <= address and address + nbytes <= slab.address + used:
                return slab_id, address - slab.address
        return None

    def finish(self) -> tuple[list[int], list[tuple[int, int]], list[int]]:
        """End the batch: send new slabs' fds; return (slabs used, [(new id, capacity)],
        slabs retired since the last batch, which the main process should unmap)."""
        used = [slab_id for slab_id, _ in self._batch]
        nbytes = sum(n for _, n in self._batch)
        self._expected = max(self._expected, nbytes)
        self._retire_small()
        refill_s = _REFILL_S_PER_BYTE * nbytes
        # a paced loop, or a slow batch (decoding), leaves time to reserve and map slabs again
        self._spare = (self._config.slab_memory == "lean"
                       or self.loop_spare_s >= max(IDLE_TRIM_S, 3 * refill_s)
                       or time.monotonic() - self._began >= 20 * refill_s)
        if self._spare:
            self.trim()
        self._batch = []
        created, self._created = self._created, []
        if created:
            socket.send_fds(self._fd_sock, [bytes([len(created)])], [fd for _, _, fd in created])
        retired, self._retired = self._retired, []
        return used, [(slab_id, capacity) for slab_id, capacity, _ in created], retired

    def _retire_small(self) -> None:
        """Close free slabs smaller than the largest batch: no batch will start in one again,
        and kept, they would fill the main process's quota of free slabs, so that it retired
        the big slabs instead and every batch created a new one."""
        for slab_id in [i for i in self._free if self._slabs[i].capacity < self._expected]:
            self._free.remove(slab_id)
            self._close(self._slabs.pop(slab_id))
            self._retired.append(slab_id)

    def _take(self, nbytes: int) -> int:
        # A batch's first region asks for a slab that can hold the largest batch seen so far,
        # so that one slab usually carries the whole batch; a batch outgrowing its slabs asks for
        # as much again as it holds, so it takes a few slabs, not one per tensor: a handful of
        # descriptors to send, never near the 253 Linux passes in one message.
        held = sum(used for _, used in self._batch)
        want = max(nbytes, held) if self._batch else max(nbytes, self._expected)
        fitting = [i for i in self._free if self._slabs[i].capacity >= want]
        if fitting:
            best = min(fitting, key=lambda i: self._slabs[i].capacity)
            self._free.remove(best)
            slab = self._slabs[best]
            if slab.punched:  # a full /dev/shm is an error here, not a SIGBUS at the write
                self._reserve(slab.fd, slab.capacity)
                slab.punched = False
            if slab.trimmed:  # map it back in one call rather than a fault per page
                _advise(slab.mm, _MADV_POPULATE_WRITE)
                slab.trimmed = False
            return best
        capacity = _round_up(want, _GRANULE)
        with self._no_space_is_an_error(capacity), \
                open_files_guard("creating a shared-memory slab in a worker"):
            fd = self._native.create_slab(self._config.shm_dir, capacity)
        try:
            with open_files_guard("mapping a shared-memory slab in a worker"):
                mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(fd)
            raise
        address = _address(mm)
        slab_id = self._next_id
        self._next_id += 1
        self._slabs[slab_id] = _OwnedSlab(mm, fd, capacity, address)
        self._created.append((slab_id, capacity, fd))
        return slab_id

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

    @staticmethod
    def _close(slab: _OwnedSlab) -> None:
        _close_quietly(slab.mm)
        os.close(slab.fd)

    def close(self) -> None:
        self._created = []
        for slab in self._slabs.values():
            self._close(slab)
        self._slabs.clear()


class SlabRing:
    """Main side: maps every worker's slabs and returns them once no tensor views them."""

    def __init__(self, keep_free_per_worker: int, pin=None, unpin=None, fence=None,
                 lean: bool = False):
        """``pin(address, nbytes)`` / ``unpin(address)``, if given, page-lock each mapping once
        for its lifetime (CUDA host registration), so batches need no pinned staging copy.
        ``fence()``, if given, marks the point a released slab's copies were queued up to (a
        CUDA event on the releasing thread's stream, with ``query()`` and ``synchronize()``):
        the slab goes back to its worker only once the fence is passed, so a
        ``non_blocking`` copy still queued is never overwritten by the next batch.
        ``lean``: unmap every slab the loop releases, whatever its pace (FASTMM_SLAB_MEMORY)."""
        self._keep = keep_free_per_worker
        self._lean = lean
        self._pin, self._unpin, self._fence = pin, unpin, fence
        self._maps: dict[tuple[int, int], mmap.mmap] = {}
        self._held: dict[tuple[int, int], bool] = {}
        # (slab, its fence or None), released by the loop and not yet given back
        self._released: collections.deque[tuple[tuple[int, int], object]] = collections.deque()
        self._mapped_free: set[tuple[int, int]] = set()  # returned slabs this process still maps
        self._punched: set[tuple[int, int]] = set()  # released, pages given back: tell the worker
        self._last_lend = self._last_step = time.monotonic()
        self.loop_spare_s = 0.0  # how long the loop's last step spent outside next()
        # how long the loop's last few steps took, waiting for data included: the last one, and
        # their mean, the pace (batches of several workers come in bursts, each step short)
        self._steps_s: collections.deque[float] = collections.deque(maxlen=PACE_STEPS)
        self._closed = False
        self._gone: set[int] = set()  # channels of workers that died (on_worker_failure="respawn")
        _raise_fd_limit()

    def receive(self, channel: int, fd_sock: socket.socket, new: list[tuple[int, int]],
                worker_id: int) -> None:
        """Map the slabs a worker just created (their fds wait on ``fd_sock``). ``channel``:
        the worker's key in this ring (a replacement worker gets a new one), ``worker_id`` for
        errors."""
        doing = f"mapping the slabs of DataLoader worker {worker_id}"
        _, fds, flags, _ = socket.recv_fds(fd_sock, 1, len(new))
        try:
            if flags & socket.MSG_CTRUNC or len(fds) != len(new):  # no room for the kernel's
                raise _too_many_files(doing)
            for (slab_id, capacity), fd in zip(new, fds):
                # Unpinned slabs map lazily: pages enter this process when the loop reads them.
                flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if self._pin is not None else 0)
                with open_files_guard(doing):  # the mapping keeps a duplicate descriptor
                    mm = mmap.mmap(fd, capacity, flags=flags)
                if self._pin is not None:
                    self._pin(_address(mm), capacity)
                self._maps[(channel, slab_id)] = mm
                self._held[(channel, slab_id)] = False
        finally:
            for fd in fds:
                os.close(fd)

    def retire(self, channel: int, slab_ids: list[int]) -> None:
        """Unmap free slabs their worker closed (SlabWriter._retire_small)."""
        for slab_id in slab_ids:
            self._held.pop((channel, slab_id), None)
            self._unmap((channel, slab_id))

    def lend(self, channel: int, slab_ids: list[int]) -> dict[int, memoryview]:
        """Views of a batch's slabs; each slab comes back when its view object is freed.

        Consumers must keep the view object itself alive, as ``torch.frombuffer`` does: a slice
        of it, or ``np.frombuffer``, shares the memory without holding the object."""
        self._last_lend = time.monotonic()
        views = {}
        for slab_id in slab_ids:
            key = (channel, slab_id)
            view = memoryview(self._maps[key])
            self._held[key] = True
            self._mapped_free.discard(key)
            weakref.finalize(view, self._on_release, key).atexit = False
            views[slab_id] = view
        return views

    def _on_release(self, key: tuple[int, int]) -> None:
        # May run in any thread, whenever the last tensor of a batch is freed.
        fence = self._fence() if self._fence is not None else None
        if self._closed:
            if fence is not None:
                fence.synchronize()  # its copies are done before the memory is unregistered
            self._held.pop(key, None)
            self._unmap(key)
        else:
            if self._pin is None:  # as torch frees a batch, at once (page-locked ones stay)
                if self._spare_for(key, give_back=True):
                    if _advise(self._maps[key], mmap.MADV_REMOVE):
                        self._punched.add(key)
                elif self._spare_for(key):
                    _advise(self._maps[key], mmap.MADV_DONTNEED)
            self._released.append((key, fence))

    def step(self) -> None:
        """The loop asks for its next batch: time its step, and what it did since the last one."""
        now = time.monotonic()
        self.loop_spare_s = now - self._last_lend
        self._steps_s.append(now - self._last_step)
        self._last_step = now

    def _spare_for(self, key: tuple[int, int], give_back: bool = False) -> bool:
        """Whether the loop's steps leave time to fault this slab back in later (and, to
        ``give_back`` its pages, for its worker to reserve them again)."""
        per_byte = _READ_REMAP_S_PER_BYTE + (_REFILL_S_PER_BYTE if give_back else 0.0)
        steps = self._steps_s or [0.0]
        step_s = sum(steps) / len(steps) if give_back else steps[-1]
        return self._lean or step_s >= max(IDLE_TRIM_S, 5 * per_byte * len(self._maps[key]))

    def forget(self, channel: int) -> None:
        """A worker is gone: unmap its free slabs now and its lent ones when they come back."""
        self._gone.add(channel)
        for key in [k for k, held in self._held.items() if k[0] == channel and not held]:
            del self._held[key]
            self._unmap(key)

    def drain(self) -> dict[int, tuple[list[int], list[int], list[int]]]:
        """Slabs released since the last call, per channel: (to reuse, to destroy, those to
        reuse whose pages were given back)."""
        out: dict[int, tuple[list[int], list[int], list[int]]] = {}
        copying = []
        while self._released:
            key, fence = self._released.popleft()
            if fence is not None and not fence.query():  # a copy from it is still queued
                copying.append((key, fence))
                continue
            channel, slab_id = key
            if channel in self._gone:  # nobody to give it back to
                self._held.pop(key, None)
                self._unmap(key)
                continue
            self._held[key] = False
            free = sum(1 for k, held in self._held.items() if k[0] == channel and not held)
            release, destroy, punched = out.setdefault(channel, ([], [], []))
            if key in self._punched:
                self._punched.discard(key)
                punched.append(slab_id)
            if free > self._keep:
                destroy.append(slab_id)
                del self._held[key]
                self._unmap(key)
            else:
                release.append(slab_id)
                if self._pin is None:  # page-locked slabs stay mapped for their lifetime
                    self._mapped_free.add(key)
        self._released.extend(copying)
        for key in [k for k in self._mapped_free if self._spare_for(k)]:  # unmap what came back
            _advise(self._maps[key], mmap.MADV_DONTNEED)
            self._mapped_free.discard(key)
        return out

    @property
    def nbytes(self) -> int:
        """Shared memory mapped by the main process (the ``shm_bytes`` metric)."""
        return sum(len(mm) for mm in self._maps.values())

    def close(self) -> None:
        """Drop every mapping no tensor views; held ones go when their tensors do."""
        self._closed = True
        while self._released:
            key, fence = self._released.popleft()
            if fence is not None:
                fence.synchronize()  # its copies are done before the memory is unregistered
            self._held[key] = False
        for key in [k for k, held in self._held.items() if not held]:
            del self._held[key]
            self._unmap(key)

    def _unmap(self, key: tuple[int, int]) -> None:
        self._mapped_free.discard(key)
        mm = self._maps.pop(key, None)
        if mm is not None:
            if self._unpin is not None:
                self._unpin(_address(mm))
            _close_quietly(mm)


def cuda_page_locking() -> dict:
    """SlabRing's ``pin``, ``unpin`` and ``fence`` for pin_memory=True on CUDA: each slab is
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
