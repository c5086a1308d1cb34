"""Data never runs code: shard members that would run code when unpickled or torch.load-ed stay
raw bytes through every reader, fastmm's sources unpickle nothing, and no FASTMM_* value can
make fastmm run a shell command."""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import re
import subprocess
import sys

import pytest
import torch

import fastmm
from fastmm.sources import ShardSource, write_shards

SRC = pathlib.Path(fastmm.__file__).parent


class _Trap:
    """Unpickling it creates the file at ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (20, 20), (200, 10, 10)).save(buf, format="JPEG")
    return buf.getvalue()


def test_code_carrying_members_stay_bytes_everywhere(tmp_path):
    marker = tmp_path / "ran"
    trap = pickle.dumps(_Trap(str(marker)))
    pth = io.BytesIO()
    torch.save({"x": _Trap(str(marker))}, pth)
    samples = [(f"s{i}", {"jpg": _jpeg(), "pyd": trap, "pth": pth.getvalue(), "pickle": trap,
                          "cls": b"1"}) for i in range(4)]
    shards = tmp_path / "shards"
    write_shards(samples, str(shards), max_count=2)
    source = ShardSource(str(shards))
    read = [source.read(i) for i in range(len(source))] + list(source.iter_samples())
    assert all(s.members["pyd"] == trap for s in read)
    ds = fastmm.MultimodalDataset(str(shards), source="shards", size=16, modality="image")
    items = list(fastmm.DataLoader(ds, batch_size=2, num_workers=2))
    stream = list(fastmm.DataLoader(fastmm.ShardStream(ds, rank=0, world_size=1), batch_size=2))
    staged = fastmm.MultimodalDataset(str(shards), source="staged", stage_dir=str(tmp_path / "st"),
                                      inner="shards", size=16, modality="image")
    list(fastmm.DataLoader(staged, batch_size=2))
    assert len(items) == 2 and len(stream) == 2
    assert not marker.exists()  # nothing was unpickled


def test_sources_and_decoders_unpickle_nothing():
    """The unpicklers in the package read what fastmm's own processes pickled: the worker -> main
    channel (collate.py), as torch's queue does, and shared.py's copy of a dataset's containers
    (items the main process checked to be plain types, and the dataset sent to a spawned worker,
    as multiprocessing sends it); nothing reads data with pickle, torch.load, eval, exec or a
    shell."""
    risky = re.compile(r"pickle\.loads?\(|Unpickler|torch\.load\(|\beval\(|\bexec\(|shell=True|"
                       r"os\.system\(|os\.popen\(")
    hits = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if risky.search(p.read_text())}
    assert hits == {"collate.py", "shared.py"}


@pytest.mark.parametrize("name", ["FASTMM_DECODE", "FASTMM_DEVICE", "FASTMM_SOURCE",
                                  "FASTMM_STAGE_DIR", "FASTMM_SHM_DIR", "FASTMM_SLAB_MEMORY",
                                  "FASTMM_TELEMETRY", "FASTMM_TELEMETRY_DIR",
                                  "FASTMM_PURE_PYTHON", "FASTMM_DECODE_DEADLINE",
                                  "FASTMM_WORKER_MALLOC"])
@pytest.mark.slow
def test_no_environment_value_runs_a_command(name, tmp_path):
    marker = tmp_path / "ran"
    code = ("import fastmm, torch\n"
            "try:\n"
            "    list(fastmm.DataLoader(torch.arange(8), batch_size=2, num_workers=1))\n"
            "    fastmm.MultimodalDataset\n"
            "except Exception as e:\n"
            "    print(type(e).__name__)\n")
    value = f"$(touch {marker}) `touch {marker}`; touch {marker} | touch {marker} && touch {marker}"
    env = dict(os.environ, FASTMM_TELEMETRY_DIR=str(tmp_path / "t"))
    env[name] = value
    subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, timeout=120,
                   capture_output=True)
    assert not marker.exists(), f"{name}={value!r} ran a command"
