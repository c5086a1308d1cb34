"""fastmm._C and its pure-Python twin: the same results and the same errors."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
import time

import numpy as np
import torch
import pytest

import fastmm
from fastmm.config import filesystem_type
from _shm import private_tmpfs, used_bytes


def test_create_slab_reserves_space_and_leaves_no_name(native, tmp_path):
    with private_tmpfs("16m") as shm:
        before = os.listdir(shm)
        fd = native.create_slab(shm, 4 << 20)
        try:
            assert os.fstat(fd).st_size == 4 << 20
            assert used_bytes(shm) >= 4 << 20  # reserved up front, not on first touch
            assert os.listdir(shm) == before  # unnamed: nothing to leak
            mm = mmap.mmap(fd, 4 << 20)
            mm[:5] = b"hello"
            assert mm[:5] == b"hello"
            mm.close()
        finally:
            os.close(fd)
        assert used_bytes(shm) == 0


def test_create_slab_full_tmpfs_is_enospc(native):
    with private_tmpfs("4m") as shm:
        with pytest.raises(OSError) as info:
            native.create_slab(shm, 8 << 20)
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename == shm
        assert used_bytes(shm) == 0


def test_create_slab_rejects_bad_size(native):
    with pytest.raises(ValueError, match="positive"):
        native.create_slab("/dev/shm", 0)


def test_create_slab_missing_dir(native, tmp_path):
    with pytest.raises(OSError) as info:
        native.create_slab(str(tmp_path / "absent"), 4096)
    assert info.value.errno == errno.ENOENT


def test_gather_places_each_source_in_its_slot(native):
    dst = bytearray(64)
    native.gather(dst, 4, [b"abc", np.array([1, 2], dtype=np.uint8), memoryview(b"xyz")], 10)
    expected = bytearray(64)
    expected[4:7] = b"abc"
    expected[14:16] = bytes([1, 2])
    expected[24:27] = b"xyz"
    assert dst == expected


@pytest.mark.parametrize("offset, size", [(3, (1 << 20) + 7), (64, 1 << 18), (5, (1 << 18) - 1)])
def test_gather_copies_large_sources_exactly_wherever_they_land(native, offset, size):
    """Large copies take another road in fastmm._C (stores that bypass the cache, from a
    16-byte boundary on): every byte lands, at any alignment, and nothing beside it moves."""
    source = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    dst = bytearray(b"\xee" * (offset + 2 * size + 9))
    native.gather(dst, offset, [source, source[::-1].copy()], size + 1)
    out = np.frombuffer(dst, dtype=np.uint8)
    assert np.array_equal(out[offset:offset + size], source)
    assert np.array_equal(out[offset + size + 1:offset + 2 * size + 1], source[::-1])
    assert not np.any(out[:offset] != 0xEE) and out[offset + size] == 0xEE
    assert not np.any(out[offset + 2 * size + 1:] != 0xEE)


def test_gather_is_bounds_checked(native):
    dst = bytearray(16)
    with pytest.raises(ValueError, match="does not fit"):
        native.gather(dst, 0, [b"12345"], 4)  # larger than its slot
    with pytest.raises(ValueError, match="does not fit"):
        native.gather(dst, 12, [b"1234", b"5678"], 4)  # past the end
    with pytest.raises(ValueError, match="non-negative"):
        native.gather(dst, -1, [b"1"], 4)
    # sums past 2**63 (found by fuzz/fuzz.py gather: the C++ check wrapped and wrote anywhere)
    with pytest.raises(ValueError, match="does not fit"):
        native.gather(dst, 2**63 - 1, [b"1"], 1)
    with pytest.raises(ValueError, match="does not fit"):
        native.gather(dst, 0, [b"", b"", b"1"], 2**62)
    assert dst == bytearray(16)  # nothing written when any source does not fit


def _channels_last_views() -> dict[str, torch.Tensor]:
    """Decoded pixels as decoders hand them out: HWC (or THWC) memory viewed as CHW (TCHW)."""
    generator = torch.Generator().manual_seed(0)
    thwc = torch.randint(0, 256, (4, 19, 227, 4), dtype=torch.uint8, generator=generator)
    hwc = thwc[0]
    return {
        "rgb": hwc[..., :3].contiguous().permute(2, 0, 1),
        "rgb_of_rgba": hwc.permute(2, 0, 1)[:3],
        "rgba": hwc.permute(2, 0, 1),
        "two_channels": hwc[..., :2].contiguous().permute(2, 0, 1),  # no vectorized row
        "crop": hwc.permute(2, 0, 1)[:3, 3:17, 5:200],
        "clip": thwc.permute(0, 3, 1, 2)[:, :3],
        "every_other_frame": thwc.permute(0, 3, 1, 2)[::2, :3],
        "batch_of_clips": thwc.view(2, 2, 19, 227, 4).permute(0, 1, 4, 2, 3),
        "int8": hwc.view(torch.int8)[..., :3].contiguous().permute(2, 0, 1),
        "bool": (hwc > 99).permute(2, 0, 1),
    }


@pytest.mark.parametrize("name", list(_channels_last_views()))
def test_planes_copies_channels_last_bytes_exactly(native, name):
    t = _channels_last_views()[name]
    out = torch.full(t.shape, 0xEE, dtype=torch.uint8)
    native.planes(out.numpy(), t.view(torch.uint8).numpy())
    assert torch.equal(out, t.view(torch.uint8))


def test_planes_refuses_what_it_cannot_copy(native):
    hwc = np.arange(60, dtype=np.uint8).reshape(4, 5, 3)
    dst = bytearray(b"\xee" * 60)
    with pytest.raises(ValueError, match="side by side"):
        native.planes(dst, hwc)  # not channels-last: pixels already planar
    with pytest.raises(ValueError, match="side by side"):
        native.planes(bytearray(240), hwc.astype(np.float32).transpose(2, 0, 1))
    with pytest.raises(ValueError, match="side by side"):  # 5 channels in a pixel
        native.planes(bytearray(100), np.zeros((4, 5, 5), np.uint8).transpose(2, 0, 1))
    with pytest.raises(ValueError, match="dst holds 59 bytes, src 60"):
        native.planes(bytearray(59), hwc.transpose(2, 0, 1))
    with pytest.raises(BufferError):
        native.planes(bytes(60), hwc.transpose(2, 0, 1))
    assert dst == bytearray(b"\xee" * 60)  # nothing written


def test_gather_needs_writable_destination(native):
    with pytest.raises(BufferError):
        native.gather(b"read-only", 0, [b"x"], 1)


def test_backend_choice_follows_environment(monkeypatch):
    monkeypatch.setenv("FASTMM_PURE_PYTHON", "1")
    assert fastmm.uses_cpp() is False
    monkeypatch.setenv("FASTMM_PURE_PYTHON", "maybe")
    with pytest.raises(fastmm.ConfigError, match="FASTMM_PURE_PYTHON='maybe'"):
        fastmm.uses_cpp()


def test_a_read_only_shm_dir_is_a_config_error(monkeypatch):
    with private_tmpfs("1m", "ro") as shm:
        monkeypatch.setenv("FASTMM_SHM_DIR", shm)
        with pytest.raises(fastmm.ConfigError, match="FASTMM_SHM_DIR=.* is not writable"):
            iter(fastmm.DataLoader(range(4), num_workers=1))


@pytest.mark.parametrize("path", ["/proc", "/sys/kernel"])
def test_a_shm_dir_that_cannot_hold_slabs_is_a_config_error(monkeypatch, path):
    """Not a place for files: refused, where the slabs once went to memfd without a word."""
    monkeypatch.setenv("FASTMM_SHM_DIR", path)
    with pytest.raises(fastmm.ConfigError, match=f"FASTMM_SHM_DIR='{path}' "):
        iter(fastmm.DataLoader(range(4), num_workers=1))


def test_a_shm_dir_on_disk_says_the_slabs_will_be_on_disk(monkeypatch):
    disk_dir = tempfile.mkdtemp(dir=os.path.dirname(__file__))  # the checkout, not /tmp
    try:
        fstype = filesystem_type(disk_dir)
        if fstype in ("tmpfs", "ramfs", "unknown"):
            pytest.skip(f"the checkout is on {fstype}")
        monkeypatch.setenv("FASTMM_SHM_DIR", disk_dir)
        with pytest.warns(fastmm.FastmmWarning, match=f"on {fstype}, not a tmpfs: the slabs will be "
                                             "files on that disk"):
            batches = list(fastmm.DataLoader(torch.arange(8 << 12).view(8, -1), batch_size=4,
                                             num_workers=1))
        assert torch.equal(torch.cat(batches), torch.arange(8 << 12).view(8, -1))
    finally:
        shutil.rmtree(disk_dir)


def test_filesystem_type_reads_the_mount_table():
    assert filesystem_type("/proc/self") == "proc"
    assert filesystem_type("/dev/shm") == "tmpfs"


def test_slab_memory_mode_follows_environment(monkeypatch):
    assert fastmm.TransportConfig.from_env().slab_memory == "auto"
    monkeypatch.setenv("FASTMM_SLAB_MEMORY", "Lean")
    assert fastmm.TransportConfig.from_env().slab_memory == "lean"
    monkeypatch.setenv("FASTMM_SLAB_MEMORY", "small")
    with pytest.raises(fastmm.ConfigError, match=r"FASTMM_SLAB_MEMORY='small'.*'auto', 'lean'"):
        iter(fastmm.DataLoader(range(4), num_workers=1))


@pytest.mark.parametrize("mode", ["reuse", None])
def test_workers_reuse_freed_memory(mode, monkeypatch, transport):
    """fastmm's workers have glibc keep what a batch frees for the next (FASTMM_WORKER_MALLOC,
    default "reuse"): a fresh 2.4 MB clip then costs no page faults after a worker's first
    batch, where glibc's defaults often give the freed batch back and fault every clip's ~590
    pages of 4 KiB in again (often, not always: it depends on what else sits on the heap)."""
    from _datasets import FaultCounter

    if mode is None:
        monkeypatch.delenv("FASTMM_WORKER_MALLOC", raising=False)
    else:
        monkeypatch.setenv("FASTMM_WORKER_MALLOC", mode)
    batches = fastmm.DataLoader(FaultCounter(), batch_size=32, num_workers=2)
    later = sorted(torch.cat([b["faults"] for b in batches][2:]).tolist())  # after the first two
    assert later[len(later) // 2] < 20, later


@pytest.mark.parametrize("mode, tuned", [("reuse", True), ("system", False), (None, True)])
def test_only_system_leaves_the_workers_malloc_alone(mode, tuned, monkeypatch, tmp_path):
    """FASTMM_WORKER_MALLOC=system: the workers never touch glibc's settings (every worker says
    whether it set them, through a file of its own; workers fork with this process's module)."""
    from fastmm import _workers

    def noting():
        (tmp_path / str(os.getpid())).touch()
        return True

    monkeypatch.setattr(_workers, "reuse_freed_memory", noting)
    if mode is None:
        monkeypatch.delenv("FASTMM_WORKER_MALLOC", raising=False)
    else:
        monkeypatch.setenv("FASTMM_WORKER_MALLOC", mode)
    pids = {int(p) for p in torch.cat(list(fastmm.DataLoader(PidOf(), num_workers=2,
                                                             batch_size=2))).tolist()}
    assert len(pids) == 2
    assert {int(p.name) for p in tmp_path.iterdir()} == (pids if tuned else set())


class PidOf(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor(os.getpid())


def test_an_idle_worker_keeps_no_free_heap(monkeypatch):
    """A worker with no work for IDLE_WORKER_S gives back the free memory it kept for its next
    samples: sample 1 begins with sample 0's 24 MiB kept, sample 2 (asked for once the worker
    had been idle) without it."""
    from _datasets import HeapChurn
    from fastmm import slabs

    monkeypatch.setenv("FASTMM_WORKER_MALLOC", "reuse")
    loader = fastmm.DataLoader(HeapChurn(), batch_size=None, num_workers=1, prefetch_factor=1)
    it = iter(loader)
    next(it)  # sample 1 is asked for as sample 0 is handed out, sample 2 as sample 1 is
    time.sleep(slabs.IDLE_WORKER_S + 0.5)
    rss = [int(next(it)), int(next(it))]
    del it
    assert rss[0] - rss[1] > 16 * 2**20, rss


@pytest.mark.parametrize("paced", [False, True])
def test_a_worker_waiting_for_its_tasks_keeps_no_free_heap_between_them(paced, monkeypatch):
    """A worker that waits for its next task (the loop's step takes longer than its batch)
    gives back the free memory its batch left on the heap, as it does a slab's pages: each
    sample then begins without the 24 MiB the one before freed. One kept busy keeps it."""
    from _datasets import HeapChurn

    monkeypatch.setenv("FASTMM_WORKER_MALLOC", "reuse")
    at_start = []
    for rss in fastmm.DataLoader(HeapChurn(6), batch_size=None, num_workers=1, prefetch_factor=1):
        at_start.append(int(rss))
        if paced:
            time.sleep(0.2)  # the step
    grown = sorted(rss - at_start[0] for rss in at_start[2:])  # past the first two samples
    assert (grown[len(grown) // 2] < 8 * 2**20) if paced else (grown[0] > 16 * 2**20), at_start


def test_worker_malloc_follows_environment(monkeypatch):
    assert fastmm.TransportConfig.from_env().worker_malloc == "reuse"
    monkeypatch.setenv("FASTMM_WORKER_MALLOC", "System")
    assert fastmm.TransportConfig.from_env().worker_malloc == "system"
    monkeypatch.setenv("FASTMM_WORKER_MALLOC", "jemalloc")
    with pytest.raises(fastmm.ConfigError,
                       match=r"FASTMM_WORKER_MALLOC='jemalloc'.*'reuse', 'system'"):
        iter(fastmm.DataLoader(range(4), num_workers=1))
