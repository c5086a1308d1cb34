"""SlabWriter and SlabPool in one process: lending, the pool, retirement and pinning hooks."""

from __future__ import annotations

import fcntl
import gc
import os
import signal
import socket
import time

import pytest
import torch

from fastmm.config import TransportConfig
from fastmm.slabs import SlabPool, SlabWriter


@pytest.fixture
def pair(transport):
    worker_sock, main_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    writer = SlabWriter(worker_sock, TransportConfig(pure_python=transport == "pure"))
    pinned: dict[int, int] = {}
    pool = SlabPool(
        keep_free=1,
        pin=lambda address, nbytes: pinned.__setitem__(address, nbytes),
        unpin=lambda address: pinned.pop(address),
    )
    pool.connect(0, main_sock)
    yield writer, pool, main_sock, pinned
    pool.close()
    writer.close()
    worker_sock.close()
    main_sock.close()


def _write_batch(writer, pool, payload: bytes, channel: int = 0):
    writer.begin()
    slab_id, offset, region = writer.alloc(len(payload))
    writer.gather(region, 0, [payload], len(payload))
    used, new = writer.finish()
    if new:
        pool.receive(channel, new, worker_id=channel)
    views = pool.lend(used)
    # The consumer must hold the lent view object itself, as torch.frombuffer does (a memoryview
    # slice or np.frombuffer shares the buffer without keeping the view object alive).
    region = torch.frombuffer(views[slab_id], dtype=torch.uint8, count=len(payload), offset=offset)
    return region.numpy(), slab_id


def test_lent_views_see_the_workers_bytes_and_come_back(pair):
    writer, pool, sock, pinned = pair
    first, first_id = _write_batch(writer, pool, b"a" * 100_000)
    assert bytes(first) == b"a" * 100_000
    assert list(pinned.values()) == [pool.nbytes]  # mapped once, pinned once
    pool.drain()
    assert pool._held[first_id]  # still viewed
    del first
    gc.collect()
    pool.drain()
    assert not pool._held[first_id]  # back in the pool
    again, again_id = _write_batch(writer, pool, b"b" * 100_000)
    assert again_id == first_id and bytes(again) == b"b" * 100_000  # reused


@pytest.fixture
def two_workers(transport):
    """A pool and the slab writers of two workers (channels 0 and 1), in this process."""
    config = TransportConfig(pure_python=transport == "pure")
    pool = SlabPool(keep_free=4)
    socks = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2)]
    writers = [SlabWriter(worker_sock, config) for worker_sock, _ in socks]
    for channel, (_, main_sock) in enumerate(socks):
        pool.connect(channel, main_sock)
    yield pool, writers
    pool.close()
    for writer in writers:
        writer.close()
    for pair in socks:
        for sock in pair:
            sock.close()


def test_a_slab_released_goes_to_whichever_worker_starts_next(two_workers):
    """One pool for all workers: a slab one worker wrote, once the loop lets go of it, is the
    one the other worker's next batch is written into (no new slab, no second copy held)."""
    pool, writers = two_workers
    first, first_id = _write_batch(writers[0], pool, b"a" * 50_000, channel=0)
    del first
    gc.collect()
    pool.drain()
    second, second_id = _write_batch(writers[1], pool, b"b" * 50_000, channel=1)
    assert second_id == first_id and len(pool._slabs) == 1
    assert bytes(second) == b"b" * 50_000
    third, third_id = _write_batch(writers[0], pool, b"c" * 50_000, channel=0)
    assert third_id != first_id and len(pool._slabs) == 2  # the first is held: a new one
    assert bytes(second) == b"b" * 50_000 and bytes(third) == b"c" * 50_000
    del second, third


def test_a_dead_workers_claims_go_back_to_the_pool(two_workers):
    """A worker that dies mid-batch leaves its slab taken in the table; forgetting its channel
    frees it for the others (and a slab it created but never sent is simply gone)."""
    pool, writers = two_workers
    batch, slab_id = _write_batch(writers[0], pool, b"a" * 50_000, channel=0)
    del batch
    gc.collect()
    pool.drain()
    writers[1].begin()
    assert writers[1].alloc(50_000)[0] == slab_id  # claimed, then its worker "dies"
    writers[1].begin()
    unsent = writers[1].alloc(60_000)[0]  # created, never sent
    pool.forget(1)
    batch, again = _write_batch(writers[0], pool, b"z" * 50_000, channel=0)
    assert again == slab_id and bytes(batch) == b"z" * 50_000
    assert pool._table._state[unsent] == 0  # its slot is empty again
    del batch


def test_surplus_free_slabs_are_retired_and_unpinned(pair):
    writer, pool, sock, pinned = pair
    views = [_write_batch(writer, pool, bytes([i]) * 70_000) for i in range(3)]
    ids = [slab_id for _, slab_id in views]
    assert len(set(ids)) == 3 and len(pinned) == 3  # every batch still held: the pool grew
    for i, (view, _) in enumerate(views):
        assert bytes(view) == bytes([i]) * 70_000
    del views, view
    gc.collect()
    pool.drain()
    assert len(pool._slabs) == 1  # keep one free slab, retire the rest
    assert len(pinned) == 1
    kept = next(iter(pool._slabs))
    again, slab_id = _write_batch(writer, pool, b"z" * 50_000)
    assert slab_id == kept and len(writer._slabs) == 1  # reused, not created; the worker
    # unmapped the slabs retired
    assert bytes(again) == b"z" * 50_000
    del again
    pool.close()
    assert pinned == {}  # nothing stays page-locked after close


@pytest.mark.slow
def test_slabs_too_small_for_grown_batches_are_retired_not_kept(pair):
    """Once batches outgrow a free slab, no batch starts in it again: it goes (and is unpinned),
    so that the free slabs kept are ones the next batches can use."""
    writer, pool, sock, pinned = pair
    small, slot = _write_batch(writer, pool, b"s" * 10_000)
    small_slab = (slot, pool._slabs[slot].generation)  # (a slot is used again by new slabs)
    del small
    gc.collect()
    pool.drain()
    slabs = set()
    for i in range(6):
        big, slot = _write_batch(writer, pool, bytes([i]) * 100_000)
        assert bytes(big) == bytes([i]) * 100_000
        slabs.add((slot, pool._slabs[slot].generation))
        del big
        gc.collect()
        pool.drain()
    assert small_slab not in slabs and len(slabs) == 1  # one big slab, reused by every batch
    assert len(pool._slabs) == 1 and len(pinned) == 1
    pool.close()
    assert pinned == {}


def test_close_keeps_held_views_valid_until_they_go(pair):
    writer, pool, sock, pinned = pair
    view, _ = _write_batch(writer, pool, b"q" * 20_000)
    pool.close()
    assert bytes(view) == b"q" * 20_000
    assert len(pinned) == 1
    tail = view[10:]
    del view
    gc.collect()
    assert len(pinned) == 1  # a view of the view still holds the slab
    assert bytes(tail) == b"q" * 19_990
    del tail
    gc.collect()
    assert pinned == {}


class Fence:
    """Stands in for the CUDA event a pinned loop records as it drops a batch (the real one is
    checked in test_gpu.py): passed once the copies queued before it are done."""

    def __init__(self):
        self.passed = False

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.passed = True


def test_a_slab_goes_back_only_once_its_copies_are_done(pair):
    """pin_memory=True: dropping a batch while a non_blocking copy from it is still queued must
    not hand its slab to the worker, which would overwrite the bytes being copied."""
    writer, _, sock, pinned = pair
    fences = []
    pool = SlabPool(keep_free=1, pin=lambda a, n: None, unpin=lambda a: None,
                    fence=lambda: fences.append(Fence()) or fences[-1])
    pool.connect(0, sock)
    view, slab_id = _write_batch(writer, pool, b"c" * 30_000)
    del view
    gc.collect()
    pool.drain()
    assert len(fences) == 1 and pool._held[slab_id]  # its copy is still queued: kept
    fences[0].passed = True
    pool.drain()
    assert not pool._held[slab_id]
    view, _ = _write_batch(writer, pool, b"d" * 30_000)
    del view
    gc.collect()
    pool.close()  # waits for the fence before unregistering the memory
    assert fences[1].passed


def test_the_table_lock_is_bounded_for_main_and_dropped_with_a_dead_holder():
    """A worker stopped while it holds the slab table's lock makes the main process raise
    after its patience, not hang; a worker killed while holding it leaves it free."""
    from fastmm.slabs import SlabTable

    table = SlabTable.create(patience_s=0.3)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # a "worker" that takes the lock and stops there
        try:
            fcntl.lockf(table.fd, fcntl.LOCK_EX)
            os.write(write, b"x")
            time.sleep(60)
        finally:
            os._exit(0)
    try:
        assert os.read(read, 1) == b"x"
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="held fastmm's slab table"):
            table.free([(0, False)])
        assert 0.3 <= time.monotonic() - started < 5
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        table.free([(0, False)])  # the kernel dropped the dead holder's lock
    finally:
        try:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(read)
        os.close(write)
        table.close()
