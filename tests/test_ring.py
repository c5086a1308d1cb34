"""SlabWriter and SlabRing in one process: lending, return, retirement and pinning hooks."""

from __future__ import annotations

import gc
import socket

import pytest
import torch

from fastmm.config import TransportConfig
from fastmm.slabs import SlabRing, SlabWriter


@pytest.fixture
def pair(transport):
    worker_sock, main_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    writer = SlabWriter(worker_sock, TransportConfig(pure_python=transport == "pure"))
    pinned: dict[int, int] = {}
    ring = SlabRing(
        keep_free_per_worker=1,
        pin=lambda address, nbytes: pinned.__setitem__(address, nbytes),
        unpin=lambda address: pinned.pop(address),
    )
    yield writer, ring, main_sock, pinned
    writer.close()
    worker_sock.close()
    main_sock.close()


def _write_batch(writer, ring, sock, payload: bytes):
    writer.begin()
    slab_id, offset, region = writer.alloc(len(payload))
    writer.gather(region, 0, [payload], len(payload))
    used, new, retired = writer.finish()
    ring.retire(0, retired)
    if new:
        ring.receive(0, sock, new, worker_id=0)
    views = ring.lend(0, used)
    # The consumer must hold the lent view object itself, as torch.frombuffer does (a memoryview
    # slice or np.frombuffer shares the buffer without keeping the view object alive).
    region = torch.frombuffer(views[slab_id], dtype=torch.uint8, count=len(payload), offset=offset)
    return region.numpy(), slab_id


def test_lent_views_see_the_workers_bytes_and_come_back(pair):
    writer, ring, sock, pinned = pair
    first, first_id = _write_batch(writer, ring, sock, b"a" * 100_000)
    assert bytes(first) == b"a" * 100_000
    assert list(pinned.values()) == [ring.nbytes]  # mapped once, pinned once
    assert ring.drain() == {}  # still viewed
    del first
    gc.collect()
    assert ring.drain() == {0: ([first_id], [], [])}  # back to the worker for reuse


def test_surplus_free_slabs_are_retired_and_unpinned(pair):
    writer, ring, sock, pinned = pair
    views = [_write_batch(writer, ring, sock, bytes([i]) * 70_000) for i in range(3)]
    ids = [slab_id for _, slab_id in views]
    assert len(set(ids)) == 3 and len(pinned) == 3  # every batch still held: the ring grew
    for i, (view, _) in enumerate(views):
        assert bytes(view) == bytes([i]) * 70_000
    del views, view
    gc.collect()
    release, destroy, punched = ring.drain()[0]
    assert len(release) == 1 and len(destroy) == 2  # keep one free slab, retire the rest
    writer.apply(release, destroy, punched)
    assert len(pinned) == 1
    again, slab_id = _write_batch(writer, ring, sock, b"z" * 50_000)
    assert slab_id == release[0]  # reused, not created
    assert bytes(again) == b"z" * 50_000
    del again
    ring.close()
    assert pinned == {}  # nothing stays page-locked after close


@pytest.mark.slow
def test_slabs_too_small_for_grown_batches_are_retired_not_kept(pair):
    """Once batches outgrow a free slab, no batch starts in it again: it goes (and is unpinned),
    so that the free slabs kept are ones the next batches can use."""
    writer, ring, sock, pinned = pair
    small, small_id = _write_batch(writer, ring, sock, b"s" * 10_000)
    del small
    gc.collect()
    writer.apply(*ring.drain()[0])
    ids = set()
    for i in range(6):
        big, slab_id = _write_batch(writer, ring, sock, bytes([i]) * 100_000)
        assert bytes(big) == bytes([i]) * 100_000
        ids.add(slab_id)
        del big
        gc.collect()
        writer.apply(*ring.drain()[0])
    assert small_id not in ids and len(ids) == 1  # one big slab, reused by every batch
    assert (0, small_id) not in ring._maps and len(pinned) == 1
    ring.close()
    assert pinned == {}


def test_close_keeps_held_views_valid_until_they_go(pair):
    writer, ring, sock, pinned = pair
    view, _ = _write_batch(writer, ring, sock, b"q" * 20_000)
    ring.close()
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
    ring = SlabRing(keep_free_per_worker=1, pin=lambda a, n: None, unpin=lambda a: None,
                    fence=lambda: fences.append(Fence()) or fences[-1])
    view, slab_id = _write_batch(writer, ring, sock, b"c" * 30_000)
    del view
    gc.collect()
    assert len(fences) == 1 and ring.drain() == {}  # its copy is still queued: kept
    fences[0].passed = True
    assert ring.drain() == {0: ([slab_id], [], [])}
    view, _ = _write_batch(writer, ring, sock, b"d" * 30_000)
    del view
    gc.collect()
    ring.close()  # waits for the fence before unregistering the memory
    assert fences[1].passed
