"""Pre-flight checks: the loader's warnings at start (large Python containers in the dataset,
CUDA before fork) and once its first batch shows the size (shared memory too small for its
slab pool), and the ``fastmm-doctor`` command."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils.data import Dataset

import fastmm
from fastmm import doctor

from _shm import private_tmpfs


class ListHolder(Dataset):
    def __init__(self, n):
        self.paths = [f"img/{i}.jpg" for i in range(n)]

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return i


class Big(Dataset):
    """3 MiB per sample."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.full((3 << 20,), i, dtype=torch.uint8)


def _findings(loader, epochs=1):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(epochs):
            list(loader)
    return [str(w.message) for w in caught if issubclass(w.category, doctor.FastmmWarning)]


class Labels(int):
    """A type sharing does not cover."""


def test_a_large_python_list_the_workers_will_copy_is_named_once(monkeypatch):
    """Shared (str), nothing to say; not shared (a type it does not cover, or sharing off):
    named once per loader, with why and what to do."""
    assert _findings(fastmm.DataLoader(ListHolder(200_000), batch_size=2, num_workers=2)) == []
    holder = ListHolder(200_000)
    holder.labels = [Labels(1)] * 200_000
    found = _findings(fastmm.DataLoader(holder, batch_size=2, num_workers=2), epochs=2)
    assert len(found) == 1
    assert "dataset.labels (list of 200,000 items: it holds a test_doctor.Labels)" in found[0]
    assert "(shared, read in place: dataset.paths)" in found[0]
    monkeypatch.setenv("FASTMM_SHARE_DATASET", "0")
    found = _findings(fastmm.DataLoader(ListHolder(200_000), batch_size=2, num_workers=2))
    assert len(found) == 1 and "dataset.paths (list of 200,000 items)" in found[0]
    assert "FASTMM_SHARE_DATASET=0 turned sharing them with the workers off" in found[0]
    assert _findings(fastmm.DataLoader(ListHolder(10), batch_size=2, num_workers=2)) == []
    assert _findings(fastmm.DataLoader(ListHolder(200_000), batch_size=2)) == []  # no workers


def test_shared_memory_too_small_for_the_slab_pool_is_said_at_the_first_batch(monkeypatch):
    with private_tmpfs("16m") as path:
        monkeypatch.setenv("FASTMM_SHM_DIR", path)
        loader = fastmm.DataLoader(Big(), batch_size=1, num_workers=2)
        found = _findings(loader)
        assert len(found) == 1
        assert "21 MiB of shared memory" in found[0] and path in found[0]  # (2 x 3 + 1) x 3 MiB
        assert "SharedMemoryError" in found[0]
        monkeypatch.setenv("FASTMM_SHM_DIR", "/dev/shm")
        assert _findings(fastmm.DataLoader(Big(), batch_size=1, num_workers=2)) == []


def test_the_shared_memory_warning_made_an_error_loses_no_batch(monkeypatch):
    """Under -W error the warning raises from next() and names the loop's line; the loop may go
    on and gets every batch (it once lost the batch being received, then waited for it)."""
    with private_tmpfs("16m") as path:
        monkeypatch.setenv("FASTMM_SHM_DIR", path)
        it = iter(fastmm.DataLoader(Big(), batch_size=1, num_workers=2, timeout=30))
        got, raised = [], []
        with warnings.catch_warnings():
            warnings.simplefilter("error", doctor.FastmmWarning)
            while True:
                try:
                    got.append(int(next(it)[0, 0]))
                except StopIteration:
                    break
                except doctor.FastmmWarning as warning:
                    raised.append(warning)
        assert len(raised) == 1 and "21 MiB of shared memory" in str(raised[0])
        assert got == [0, 1]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            list(fastmm.DataLoader(Big(), batch_size=1, num_workers=2))
        assert [w.filename for w in caught] == [__file__]


def test_pool_bytes_follow_the_documented_formula():
    assert doctor.pool_bytes(8, 2, 77_000_000) == (8 * 3 + 1) * 77_000_000


@pytest.mark.slow
def test_the_doctor_command_reports_and_flags_problems():
    ok = subprocess.run([sys.executable, "-m", "fastmm.doctor"], capture_output=True, text=True)
    assert ok.returncode == 0 and "shared memory (" in ok.stdout and ok.stdout.endswith("OK\n")
    huge = subprocess.run([sys.executable, "-m", "fastmm.doctor", "--num-workers", "1",
                           "--batch-mb", str(10**9)], capture_output=True, text=True)
    assert huge.returncode == 1 and "PROBLEM: the slab pool will need" in huge.stdout
    assert "RuntimeWarning" not in huge.stderr
    many = subprocess.run([sys.executable, "-m", "fastmm.doctor", "--num-workers",
                           str(10 * os.cpu_count())], capture_output=True, text=True)
    assert many.returncode == 0 and "WARNING: " in many.stdout  # slower, not broken


@pytest.mark.slow
def test_the_doctor_names_each_bad_variable_and_refuses_bad_arguments(tmp_path):
    bad = dict(os.environ, FASTMM_SHM_DIR=str(tmp_path / "missing"), FASTMM_DECODE="opencv",
               FASTMM_STAGE_DIR=str(tmp_path / "missing" / "stage"))
    said = subprocess.run([sys.executable, "-m", "fastmm.doctor"], capture_output=True,
                          text=True, env=bad)
    assert said.returncode == 1 and said.stdout.endswith("problems found\n"), said.stderr
    for name in ("FASTMM_SHM_DIR", "FASTMM_DECODE", "FASTMM_STAGE_DIR"):
        assert f"PROBLEM: {name}=" in said.stdout
    assert "Traceback" not in said.stderr
    for argv in (["--num-workers", "-3"], ["--num-workers", "2", "--batch-mb", "nan"],
                 ["--num-workers", "2", "--batch-mb", "-5"], ["--prefetch-factor", "0"]):
        refused = subprocess.run([sys.executable, "-m", "fastmm.doctor", *argv],
                                 capture_output=True, text=True)
        assert refused.returncode == 2 and "fastmm-doctor: error: " in refused.stderr, argv




def test_the_doctor_says_what_a_dataset_shares_and_saves(tmp_path, monkeypatch, capsys):
    (tmp_path / "user_data.py").write_text(
        "class Index:\n"
        "    def __init__(self):\n"
        "        self.paths = [f'img/{i}.jpg' for i in range(200_000)]\n"
        "        self.weights = [object()] * 200_000\n"
        "    def __getitem__(self, i):\n"
        "        return self.paths[i]\n"
        "def make():\n"
        "    return Index()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in ("user_data:make", "user_data:Index", f"{tmp_path}/user_data.py:make"):
        doctor.main(["--dataset", spec])
        out = capsys.readouterr().out
        assert "dataset.paths: list of 200,000 items" in out
        assert "MiB of Python objects copied into each worker" in out
        assert "WARNING: the dataset holds large Python containers" in out
        assert "dataset.weights (list of 200,000 items: it holds a builtins.object)" in out
    with pytest.raises(SystemExit, match="give it as module:name"):
        doctor.main(["--dataset", "user_data"])
