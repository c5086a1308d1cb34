"""The slab pool end to end: reuse, growth and shrink, nothing leaked, a full /dev/shm."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import Dataset

import fastmm
from fastmm.slabs import _address
from _processes import live_children, wait_until
from _shm import private_tmpfs, used_bytes


class Frames(Dataset):
    """Sample i is a 3x128x128 uint8 image filled with i % 251, plus its id."""

    def __init__(self, n: int = 64):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((3, 128, 128), i % 251, dtype=torch.uint8), i


def _check(batch, start: int, size: int):
    images, ids = batch
    assert ids.tolist() == list(range(start, start + size))
    for image, i in zip(images, ids.tolist()):
        assert int(image.min()) == int(image.max()) == i % 251


@pytest.fixture
def helpers_before():
    """Children that were there before the test (a forkserver, a resource tracker): not ours."""
    return live_children()


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_the_pool_reuses_slabs_in_steady_state(transport, monkeypatch):
    with private_tmpfs("256m") as shm:
        monkeypatch.setenv("FASTMM_SHM_DIR", shm)
        loader = fastmm.DataLoader(Frames(400), batch_size=8, num_workers=2)
        it = iter(loader)
        created = 0
        for k, batch in enumerate(it):
            _check(batch, 8 * k, 8)
            created = max(created, len(it._slab_pool._slabs))
        # 50 batches went through; each worker needs only prefetch + a few slabs.
        assert created <= 2 * (loader.prefetch_factor + 2)
        del it, batch
        gc.collect()
        assert wait_until(lambda: used_bytes(shm) == 0)


class Growing(Dataset):
    """Sample i holds min(i // 4, 10) + 1 KB: batches of 4 grow, then keep one size."""

    def __len__(self):
        return 400

    def __getitem__(self, i):
        return torch.full((1000 * (min(i // 4, 10) + 1),), i % 251, dtype=torch.uint8)


def test_batches_that_grew_then_settled_reuse_slabs(transport, monkeypatch):
    """Slabs too small for the grown batches must not crowd out the big ones: each batch once
    made (and threw away) a new slab, about 100 descriptor passes and 1 MB of page faults."""
    with private_tmpfs("256m") as shm:
        monkeypatch.setenv("FASTMM_SHM_DIR", shm)
        loader = fastmm.DataLoader(Growing(), batch_size=4, num_workers=2)
        it = iter(loader)
        settled = None
        for k, batch in enumerate(it):
            assert batch[:, 0].tolist() == [i % 251 for i in range(4 * k, 4 * k + 4)]
            if k == 20:  # batches stopped growing at 10
                settled = set(it._slab_pool._slabs)
            elif k > 20:
                settled |= set(it._slab_pool._slabs)
        assert len(settled) <= 2 * (loader.prefetch_factor + 2)  # 80 batches since
        del it, batch
        gc.collect()
        assert wait_until(lambda: used_bytes(shm) == 0)


def _numpy_stack(batch):
    return np.stack([image.numpy() for image, _ in batch]), np.array([i for _, i in batch])


def test_numpy_batches_travel_in_slabs_and_give_them_back(transport, monkeypatch):
    """A custom collate_fn's NumPy batch views a slab in the main process (no pickled copy),
    and its slab goes back when the array is dropped, as a tensor's does."""
    with private_tmpfs("256m") as shm:
        monkeypatch.setenv("FASTMM_SHM_DIR", shm)
        loader = fastmm.DataLoader(Frames(400), batch_size=8, num_workers=2, collate_fn=_numpy_stack)
        it = iter(loader)
        created = 0
        for k, batch in enumerate(it):
            images = batch[0]
            assert type(images) is np.ndarray and images.flags.writeable
            _check([torch.from_numpy(a) for a in batch], 8 * k, 8)
            assert any(_address(mm) <= images.ctypes.data < _address(mm) + len(mm)
                       for mm in it._slab_pool.mappings())
            created = max(created, len(it._slab_pool._slabs))
        assert created <= 2 * (loader.prefetch_factor + 2)
        del it, batch, images
        gc.collect()
        assert wait_until(lambda: used_bytes(shm) == 0)


def _aliases(batch):
    a = np.arange(8192, dtype=np.float64)  # 64 KiB: an array a slab carries
    return {"array": a, "reshaped": a.reshape(64, 128), "tensor": torch.from_numpy(a),
            "again": a}


def test_numpy_arrays_arrive_apart_as_pickle_gives_them(transport):
    """torch pickles each NumPy array on its own: views of one array, and a tensor on its
    memory, arrive as copies of their own; the same array twice stays one object."""
    for loader_class in (torch.utils.data.DataLoader, fastmm.DataLoader):
        loader = loader_class(range(4), batch_size=2, num_workers=1, collate_fn=_aliases)
        batch = next(iter(loader))
        batch["array"][0] = 42
        assert batch["reshaped"][0, 0] == 0 and batch["tensor"][0] == 0, loader_class
        assert batch["again"] is batch["array"]


def _read_only_stack(batch):
    return np.frombuffer(np.stack([image.numpy() for image, _ in batch]).tobytes(), np.uint8)


def _pickle_protocol_5(worker_id):
    import pickle

    pickle.DEFAULT_PROTOCOL = 5  # Python 3.14's default


@pytest.mark.parametrize("protocol", [4, 5])
def test_read_only_numpy_batches_travel_in_slabs_as_pickle_gives_them(transport, protocol):
    """np.frombuffer's arrays are read-only: they travel in the slab too and arrive writable
    or read-only as pickle with the worker's protocol would give them back."""
    loader = fastmm.DataLoader(Frames(32), batch_size=8, num_workers=2,
                               collate_fn=_read_only_stack,
                               worker_init_fn=_pickle_protocol_5 if protocol == 5 else None)
    it = iter(loader)
    for k, flat in enumerate(it):
        assert flat.flags.writeable == (protocol < 5) and flat.size == 8 * 3 * 128 * 128
        images = flat.reshape(8, 3, 128, 128)
        assert [int(images[j].min()) for j in range(8)] == [(8 * k + j) % 251 for j in range(8)]
        assert [int(images[j].max()) for j in range(8)] == [(8 * k + j) % 251 for j in range(8)]
        assert any(_address(mm) <= flat.ctypes.data < _address(mm) + len(mm)
                   for mm in it._slab_pool.mappings())
    assert k == 3


def test_kept_batches_grow_the_pool_and_stay_intact(transport, monkeypatch):
    with private_tmpfs("512m") as shm:
        monkeypatch.setenv("FASTMM_SHM_DIR", shm)
        loader = fastmm.DataLoader(
            Frames(320), batch_size=8, num_workers=2, persistent_workers=True
        )
        kept = list(loader)  # like torch: every batch stays valid while the user holds it
        assert len(kept) == 40
        for k, batch in enumerate(kept):
            _check(batch, 8 * k, 8)
        grown = used_bytes(shm)
        assert grown >= 40 * 8 * 3 * 128 * 128  # one slab per kept batch
        for k, batch in enumerate(kept):  # still intact after the epoch ended
            _check(batch, 8 * k, 8)
        del kept, batch
        gc.collect()
        for k, batch in enumerate(loader):  # a second epoch returns the freed slabs
            _check(batch, 8 * k, 8)
        del batch
        gc.collect()
        assert wait_until(lambda: used_bytes(shm) < grown / 4)
        del loader
        gc.collect()
        assert wait_until(lambda: used_bytes(shm) == 0)


def test_nothing_left_after_delete_or_error(transport, monkeypatch, helpers_before):
    with private_tmpfs("256m") as shm:
        monkeypatch.setenv("FASTMM_SHM_DIR", shm)
        shm_names = set(os.listdir("/dev/shm"))
        fds = _open_fds()

        loader = fastmm.DataLoader(Frames(64), batch_size=8, num_workers=2)
        for k, batch in enumerate(loader):
            if k == 2:
                break  # break out early
        del loader, batch
        gc.collect()
        assert wait_until(lambda: live_children() <= helpers_before)
        assert wait_until(lambda: used_bytes(shm) == 0)

        class Broken(Frames):
            def __getitem__(self, i):
                if i == 20:
                    raise ValueError("bad sample 20")
                return super().__getitem__(i)

        def consume():
            for _ in fastmm.DataLoader(Broken(64), batch_size=8, num_workers=2):
                pass

        with pytest.raises(ValueError, match="bad sample 20"):
            consume()
        gc.collect()
        assert wait_until(lambda: live_children() <= helpers_before)
        assert wait_until(lambda: used_bytes(shm) == 0)
        ours = [n for n in set(os.listdir("/dev/shm")) - shm_names if f"_{os.getpid()}_" in n]
        assert not ours  # nothing named by this process (other processes may share /dev/shm)
        assert wait_until(lambda: _open_fds() <= fds)


_KILLED_MAIN = textwrap.dedent(
    """
    import ctypes, sys, threading, time, torch, fastmm
    from torch.utils.data import Dataset

    class Slow(Dataset):
        def __len__(self):
            return 10_000
        def __getitem__(self, i):
            if i > 40:  # workers are busy in user code when the main process dies
                if sys.argv[1] == "python":
                    time.sleep(0.5)
                else:  # stuck in C for 60 s with the GIL held: no Python thread can run
                    ctypes.PyDLL(None).sleep(60)
            return torch.zeros(3, 256, 256, dtype=torch.uint8)

    def run():
        context = sys.argv[2] if sys.argv[2] in ("forkserver", "spawn") else None
        loader = fastmm.DataLoader(Slow(), batch_size=4, num_workers=2,
                                   multiprocessing_context=context)
        it = iter(loader)
        kept = [next(it) for _ in range(8)]
        print(" ".join(str(w.pid) for w in it._workers), flush=True)
        time.sleep(60)

    if __name__ == "__main__":
        if sys.argv[2] == "thread":  # the loop in a thread of its own, the main thread waiting
            threading.Thread(target=run, daemon=True).start()
            time.sleep(120)
        else:
            run()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["main-thread", "thread", "forkserver", "spawn"])
@pytest.mark.parametrize("stall", ["python", "c-holding-the-gil"])
def test_kill_9_of_main_leaves_no_worker_and_no_shared_memory(transport, tmp_path, stall, setup):
    """Every process the loader made (workers; under forkserver the forkserver and the
    resource tracker too) ends within seconds of a kill -9 of the main process, even with the
    workers stuck in C holding the GIL, whichever thread ran the loop and whatever the start
    method; the slabs' memory goes with them."""
    with private_tmpfs("256m") as shm:
        script = tmp_path / "main.py"
        script.write_text(_KILLED_MAIN)
        env = {**os.environ, "FASTMM_SHM_DIR": shm}
        main = subprocess.Popen([sys.executable, str(script), stall, setup],
                                stdout=subprocess.PIPE, env=env)
        try:
            pids = [int(p) for p in main.stdout.readline().split()]
            assert len(pids) == 2 and used_bytes(shm) > 0
            made = {p.pid for p in psutil.Process(main.pid).children(recursive=True)}
            assert set(pids) <= made
            main.send_signal(signal.SIGKILL)
            main.wait(timeout=10)
            assert wait_until(lambda: not any(psutil.pid_exists(p) for p in made), timeout=5), \
                [psutil.Process(p).cmdline() for p in made if psutil.pid_exists(p)]
            assert wait_until(lambda: used_bytes(shm) == 0, timeout=5)
        finally:
            main.kill()
            main.stdout.close()


class Columns(Dataset):
    """20 KB samples: each one its own region (over the inline limit), filled with its index."""

    def __len__(self):
        return 1200

    def __getitem__(self, i):
        return torch.full((5000,), i, dtype=torch.int32)


def test_a_batch_of_hundreds_of_tensors(transport):
    """A collate_fn that keeps the samples apart (detection style): 600 regions in one batch
    take a few slabs (once, each its own slab, and Linux passes at most 253 descriptors in a
    message: the worker died)."""
    loader = fastmm.DataLoader(Columns(), batch_size=600, num_workers=2, collate_fn=tuple)
    batches = list(loader)
    assert [len(b) for b in batches] == [600, 600]
    assert all(int(t[0]) == 600 * k + j for k, b in enumerate(batches) for j, t in enumerate(b))


def test_workers_started_from_a_thread_outlive_that_thread(transport):
    """The kernel's parent-death signal follows the thread that started a worker: workers that
    a short-lived thread started keep serving the loop after that thread has ended."""
    made = []
    starter = threading.Thread(target=lambda: made.append(
        iter(fastmm.DataLoader(Frames(64), batch_size=4, num_workers=2))))
    starter.start()
    starter.join()
    time.sleep(0.5)
    for step, batch in enumerate(made[0]):
        _check(batch, 4 * step, 4)
    assert step == 15


def test_full_shm_is_a_clear_error_not_a_sigbus(transport, monkeypatch, helpers_before):
    with private_tmpfs("8m") as shm:
        monkeypatch.setenv("FASTMM_SHM_DIR", shm)
        big = Frames(64)  # a batch of 16 images is 786,432 bytes: fits
        loader = fastmm.DataLoader(big, batch_size=32, num_workers=1)
        for batch in loader:
            _check(batch, int(batch[1][0]), 32)
        del batch

        class Huge(Dataset):
            def __len__(self):
                return 8

            def __getitem__(self, i):
                return torch.ones(4 << 20, dtype=torch.uint8)

        with pytest.raises(fastmm.SharedMemoryError) as info:
            next(iter(fastmm.DataLoader(Huge(), batch_size=4, num_workers=1)))
        message = str(info.value)
        assert shm in message and "bytes" in message and "shm-size" in message
        del info  # its traceback holds the iterator
        gc.collect()
        assert wait_until(lambda: live_children() <= helpers_before)


_FEW_FILES = textwrap.dedent(
    """
    import gc, os, resource, sys, psutil, torch, fastmm
    from torch.utils.data import Dataset

    class Images(Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            return torch.full((3, 128, 128), i, dtype=torch.uint8)

    spare, workers = int(sys.argv[1]), int(sys.argv[2])
    limit = len(os.listdir("/proc/self/fd")) + spare
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    kept = []
    try:
        for batch in fastmm.DataLoader(Images(), batch_size=2, num_workers=workers):
            kept.append(batch)  # every batch kept: the pool grows a slab per batch
    except RuntimeError as e:
        print(str(e).replace(chr(10), " "))
    else:
        print("no error", len(kept))
    del kept
    gc.collect()
    print(len(psutil.Process().children()))
    """
)


@pytest.mark.parametrize("spare, workers, where", [
    (8, 8, "starting DataLoader worker"),  # not enough for the workers' channels
    (24, 2, "slab"),  # the workers start; the kept batches' slabs run out of descriptors
])
@pytest.mark.slow
def test_too_few_file_descriptors_is_a_clear_error(transport, tmp_path, spare, workers, where):
    """Running out of descriptors is torch's RuntimeError naming the limit and the remedies
    (it was a bare OSError from socketpair or mmap), and leaves no worker behind."""
    script = tmp_path / "few_files.py"
    script.write_text(_FEW_FILES)
    run = subprocess.run([sys.executable, str(script), str(spare), str(workers)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    message, children = run.stdout.splitlines()[-2:]
    assert "Too many open files while" in message
    assert where in message and "ulimit -n" in message and "this process may open" in message
    assert children == "0"


def _slab_pss(pid: int, starts: set[int] | None = None) -> int:
    """Proportional resident bytes of a process's slab mappings (files on /dev/shm or memfd),
    or only of those starting at ``starts``."""
    total, slab = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                start = int(first.split("-")[0], 16)
                slab = ("/dev/shm/" in line or "/memfd:" in line) and (
                    starts is None or start in starts
                )
            elif slab and line.startswith("Pss:"):
                total += int(line.split()[1]) * 1024
    return total


class Big(Dataset):
    """4 MiB samples, so that a batch of 2 is 8 MiB."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.full((4, 1024, 1024), i % 251, dtype=torch.uint8)


@pytest.mark.slow
def test_slow_loop_maps_only_the_batch_in_hand(transport):
    """A loop slower than its workers: what is waiting or free is mapped by no process, so the
    slabs' PSS over main and workers is about the batch being read, not the whole pool."""
    batch_bytes = 2 * 4 * 1024 * 1024
    it = iter(fastmm.DataLoader(Big(), batch_size=2, num_workers=2))
    peaks, pooled = [], 0
    for k, batch in enumerate(it):
        assert int(batch[0, 0, 0, 0]) == 2 * k
        batch.sum()  # the loop reads the whole batch
        time.sleep(0.1)  # ... and computes for 100 ms, while the workers sit idle
        if k >= 4:
            ours = {_address(mm) for mm in it._slab_pool.mappings()}  # not other tests' slabs
            peaks.append(_slab_pss(os.getpid(), ours)
                         + sum(_slab_pss(w.pid) for w in it._workers))
            pooled = max(pooled, len(ours))
    assert pooled >= 4  # the pool itself holds more than two batches ...
    assert max(peaks) <= 2 * batch_bytes  # ... but only about one is mapped


@pytest.mark.slow
def test_lean_slab_memory_maps_no_waiting_batch_at_full_speed(transport, monkeypatch):
    """FASTMM_SLAB_MEMORY=lean: with a loop as fast as it can go, the batches queued for it are
    mapped by no process; only the batch being read and those being written count. (By default
    the whole pool stays mapped at full speed: measured here ~10 batches of the same loop.)"""
    monkeypatch.setenv("FASTMM_SLAB_MEMORY", "lean")
    batch_bytes = 2 * 4 * 1024 * 1024

    class Long(Big):
        def __len__(self):
            return 600

    it = iter(fastmm.DataLoader(Long(), batch_size=2, num_workers=2, prefetch_factor=4))
    peaks, pooled = [], 0
    for k, batch in enumerate(it):
        assert int(batch[0, 0, 0, 0]) == (2 * k) % 251
        batch.view(torch.int64).sum()  # reads every byte, fast: the loop runs flat out
        if k % 15 == 14:  # sampling is slow: let the loop get back to full speed in between
            ours = {_address(mm) for mm in it._slab_pool.mappings()}
            peaks.append(_slab_pss(os.getpid(), ours)
                         + sum(_slab_pss(w.pid) for w in it._workers))
            pooled = max(pooled, len(ours))
    assert pooled >= 5  # up to eight batches are in flight ...
    assert max(peaks) <= 3 * batch_bytes  # ... but one is read and at most two are written


class SlowBig(Dataset):
    """4 MiB samples that take 60 ms each: a decode-bound pipeline."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        time.sleep(0.06)
        return torch.full((4, 1024, 1024), i % 251, dtype=torch.uint8)


@pytest.mark.slow
def test_free_slabs_give_their_memory_back_while_batches_are_slow(transport, monkeypatch):
    """While batches are slow to make, the pool holds about the batches in flight (as torch
    would); slabs the pool made for batches kept give their pages back once the workers have
    nothing to do; and the slabs are written again afterwards, intact."""
    batch_bytes = 4 << 20
    with private_tmpfs("256m") as shm:
        monkeypatch.setenv("FASTMM_SHM_DIR", shm)
        idle = used_bytes(shm)
        it = iter(fastmm.DataLoader(SlowBig(), batch_size=1, num_workers=2))
        used, pooled = [], []
        for k in range(12):
            assert int(next(it)[0, 0, 0, 0]) == k  # (each batch dropped at once)
            if k >= 4:
                used.append(used_bytes(shm) - idle)
                pooled.append(sum(len(mm) for mm in it._slab_pool.mappings()))
        # one pool for both workers: a slab the loop lets go of is the next one written, so
        # the pool holds the batches in flight (one per worker writing, the one the loop just
        # dropped, one waiting at most), not prefetch_factor + 1 free slabs per worker
        assert sorted(pooled)[len(pooled) // 2] <= 4 * batch_bytes  # median
        assert max(used) <= max(pooled)
        kept = [next(it) for _ in range(6)]  # the pool grows for batches kept ...
        del kept
        assert int(next(it)[0, 0, 0, 0]) == 18  # ... whose slabs this call gives back
        time.sleep(2.0)  # the loop stops: the workers make the batches asked of them, then idle
        pooled = sum(len(mm) for mm in it._slab_pool.mappings())
        # in flight: num_workers x prefetch_factor batches made, and the one just dropped
        assert used_bytes(shm) - idle <= (2 * 2 + 1) * batch_bytes < pooled
        for k in range(19, 24):
            assert int(next(it)[0, 0, 0, 0]) == k
        del it


class QuickBig(SlowBig):
    """4 MiB samples that take 20 ms each, 400 of them."""

    def __len__(self):
        return 400

    def __getitem__(self, i):
        time.sleep(0.02)
        return torch.full((4, 1024, 1024), i % 251, dtype=torch.uint8)


@pytest.mark.slow
def test_slabs_a_burst_left_free_give_their_pages_back_while_the_loop_runs(transport, monkeypatch):
    """Batches kept for a while grow the pool; once released, the slabs beyond what the loop
    needs stay free, and after IDLE_FREE_S unclaimed give their pages back even though the loop
    runs on at full speed (the workers never idle)."""
    from fastmm.slabs import IDLE_FREE_S

    batch_bytes = 4 << 20
    with private_tmpfs("256m") as shm:
        monkeypatch.setenv("FASTMM_SHM_DIR", shm)
        idle = used_bytes(shm)
        it = iter(fastmm.DataLoader(QuickBig(), batch_size=1, num_workers=2))
        kept = [next(it) for _ in range(8)]  # the pool grows for batches kept ...
        assert len(it._slab_pool._slabs) >= 8
        del kept
        k = 8
        started = time.monotonic()
        while time.monotonic() - started < IDLE_FREE_S + 1.0:  # ... and the loop runs on
            assert int(next(it)[0, 0, 0, 0]) == k % 251
            k += 1
        pooled = sum(len(mm) for mm in it._slab_pool.mappings())
        used = used_bytes(shm) - idle
        # still pooled (up to prefetch_factor + 1 per worker), but only those in flight hold pages
        assert pooled >= 5 * batch_bytes
        assert used <= 4 * batch_bytes
        del it


class ShortBig(QuickBig):
    def __len__(self):
        return 16


def test_at_an_epochs_end_the_pool_holds_only_the_batches_the_loop_keeps(transport, monkeypatch):
    """Once no more batches are to be written this epoch, the free slabs give their pages back
    and so does each batch the loop drops, as torch's loader frees a batch: at full speed the
    pool otherwise keeps free slabs for the batches to come. The next epoch writes them again."""
    batch_bytes = 4 << 20
    with private_tmpfs("256m") as shm:
        monkeypatch.setenv("FASTMM_SHM_DIR", shm)
        idle = used_bytes(shm)
        loader = fastmm.DataLoader(ShortBig(), batch_size=1, num_workers=2, persistent_workers=True)
        it = iter(loader)
        for k in range(15):
            assert int(next(it)[0, 0, 0, 0]) == k  # (each batch dropped at once)
        last = next(it)  # the epoch's last batch (its end not asked for yet)
        assert used_bytes(shm) - idle <= batch_bytes
        del last
        assert used_bytes(shm) - idle == 0
        assert [int(b[0, 0, 0, 0]) for b in loader] == list(range(16))
        del it, loader


def test_a_full_shm_when_a_freed_slab_is_needed_again_is_a_clear_error(transport, monkeypatch):
    """A slab whose pages went back reserves them again before the next write: if /dev/shm
    filled up meanwhile, that is a SharedMemoryError, not a SIGBUS in the worker. (lean: every
    slab gives its pages back, whatever the pace.)"""
    with private_tmpfs("32m") as shm:
        monkeypatch.setenv("FASTMM_SHM_DIR", shm)
        monkeypatch.setenv("FASTMM_SLAB_MEMORY", "lean")
        it = iter(fastmm.DataLoader(SlowBig(), batch_size=1, num_workers=1))
        for _ in range(4):
            next(it)
        time.sleep(0.3)  # the worker has made its next batches and freed the slabs it had
        with open(os.path.join(shm, "filler"), "wb") as filler:
            free = shutil.disk_usage(shm).free
            filler.write(b"\0" * free)
        kept = []  # (kept: no batch's pages come back for the next one)
        with pytest.raises(fastmm.SharedMemoryError):
            for _ in range(20):
                kept.append(next(it))
        del it, kept
