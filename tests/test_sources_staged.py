"""StagedSource: atomic verified copies, concurrent stagers, caps, HTTP, safe unpacking, config."""

from __future__ import annotations

import functools
import http.server
import io
import json
import os
import pickle
import socket
import subprocess
import sys
import tarfile
import threading
import time

import pytest

from fastmm.config import ConfigError, SourceConfig
from fastmm.sources.base import ProgressLines
from fastmm.sources.staged import corpus_dir_name
from fastmm.sources import (
    FileSource,
    ShardSource,
    SourceError,
    StagedSource,
    open_source,
    write_file_manifest,
    write_shards,
)


def _tree(root, n=6):
    files = {}
    for i in range(n):
        for ext, data in (("jpg", bytes([i]) * (1000 + i)), ("txt", f"caption {i}".encode())):
            rel = f"part{i % 2}/s{i}.{ext}"
            files[rel] = data
            os.makedirs(os.path.join(root, f"part{i % 2}"), exist_ok=True)
            with open(os.path.join(root, rel), "wb") as f:
                f.write(data)
    return files


def _copy_of(stage, remote) -> str:
    """Where a corpus's copy lies: a directory of its own under the stage directory."""
    remote = str(remote)
    return os.path.join(str(stage), corpus_dir_name(
        remote if remote.startswith("http") else os.path.abspath(remote)))


def _listing(root):
    """Every path below root (files, dirs, links), to prove nothing was written where it must not be."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            out.add(os.path.relpath(os.path.join(dirpath, name), root))
    return out


def _samples(src):
    return [(s.key, s.members) for s in (src.read(i) for i in range(len(src)))]


def test_stage_before_then_reuse(tmp_path):
    remote, stage = str(tmp_path / "remote"), str(tmp_path / "stage")
    files = _tree(remote)
    src = StagedSource(remote, stage)
    assert _samples(src) == _samples(FileSource(remote))
    assert [(s.key, s.members) for s in src.iter_samples()] == _samples(FileSource(remote))
    cost = src.staging_cost
    assert (cost["files"], cost["bytes"]) == (len(files), sum(map(len, files.values())))
    assert cost["seconds"] > 0 and cost["bytes_per_s"] == pytest.approx(
        cost["bytes"] / cost["seconds"]
    )
    for rel, data in files.items():
        with open(os.path.join(_copy_of(stage, remote), rel), "rb") as f:
            assert f.read() == data
    assert (
        os.listdir(os.path.join(_copy_of(stage, remote), ".fastmm-stage", "tmp")) == []
    )  # no temp files left behind
    again = StagedSource(remote, stage)  # already staged and verified: nothing copied
    assert (again.staging_cost["files"], again.staging_cost["bytes"]) == (0, 0)
    assert _samples(again) == _samples(src)
    with open(
        os.path.join(remote, "part0/s0.txt"), "wb"
    ) as f:  # the source changed: restage that file
        f.write(b"new caption")
    third = StagedSource(remote, stage)
    assert third.staging_cost["files"] == 1 and third.read(0).members["txt"] == b"new caption"


def test_long_staging_reports_progress(tmp_path, monkeypatch, capsys):
    remote = str(tmp_path / "remote")
    files = _tree(remote)
    StagedSource(remote, str(tmp_path / "quick"))  # under 5 s: says nothing
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(ProgressLines, "EVERY_S", 0.0)  # as if every file took 5 s
    lines = []
    StagedSource(remote, str(tmp_path / "slow"), progress=lines.append)
    assert len(lines) == len(files)
    mb = sum(map(len, files.values())) / 1e6
    assert f"{mb:,.0f}/{mb:,.0f} MB ({len(files)}/{len(files)} files)" in lines[-1]
    assert "s left" in lines[0] and "s left" not in lines[-1]
    StagedSource(remote, str(tmp_path / "silent"), progress=None)
    assert capsys.readouterr().err == ""


def test_stage_on_touch(tmp_path):
    remote, stage = str(tmp_path / "remote"), str(tmp_path / "stage")
    _tree(remote)
    src = StagedSource(remote, stage, mode="on_touch")
    assert src.keys() == FileSource(remote).keys() and src.staging_cost["files"] == 0
    assert not os.path.exists(os.path.join(_copy_of(stage, remote), "part0"))
    sample = src.read(2)
    assert sample.members == FileSource(remote).read(2).members
    assert src.staging_cost["files"] == 2
    assert sorted(os.listdir(os.path.join(_copy_of(stage, remote), "part0"))) == [
        f"{sample.key.split('/')[1]}.{e}" for e in ("jpg", "txt")
    ]
    src.read(2)
    assert src.staging_cost["files"] == 2
    clone = pickle.loads(
        pickle.dumps(src)
    )  # as a worker process receives it: still stages on touch
    assert clone.read(3).members == FileSource(remote).read(3).members
    assert clone.staging_cost["files"] == 4 and os.path.exists(
        os.path.join(_copy_of(stage, remote), clone.keys()[3] + ".jpg")
    )


@pytest.mark.parametrize("mode", ["before", "on_touch"])
def test_stage_shards(tmp_path, mode):
    remote, stage = str(tmp_path / "remote"), str(tmp_path / "stage")
    samples = [(f"s{i:03d}", {"bin": bytes([i]) * i, "cls": b"%d" % (i % 3)}) for i in range(40)]
    write_shards(samples, remote, max_count=7)
    write_file_manifest(remote)
    src = StagedSource(remote, stage, inner="shards", mode=mode)
    assert isinstance(src.inner, ShardSource)
    assert src.staging_cost["files"] == (6 if mode == "before" else 0)
    parts = [list(src.iter_samples(0, 2, w, 2)) for w in range(2)] + [
        list(src.iter_samples(1, 2, w, 2)) for w in range(2)
    ]
    assert sorted((s.key, s.members) for p in parts for s in p) == samples
    assert _samples(src) == samples
    assert src.staging_cost["files"] == 6


def test_checksum_mismatch_is_refused(tmp_path):
    remote, stage = str(tmp_path / "remote"), str(tmp_path / "stage")
    _tree(remote)
    write_file_manifest(remote)
    with open(os.path.join(remote, "part1/s1.jpg"), "r+b") as f:
        f.write(b"X")  # same size, different bytes
    with pytest.raises(SourceError) as e:
        StagedSource(remote, stage)
    assert (e.value.reason, e.value.key) == ("checksum", "part1/s1.jpg")
    assert not os.path.exists(os.path.join(_copy_of(stage, remote), "part1/s1.jpg"))
    assert os.listdir(os.path.join(_copy_of(stage, remote), ".fastmm-stage", "tmp")) == []


@pytest.mark.parametrize("mode", ["before", "on_touch"])
def test_a_file_that_fails_to_stage_is_its_samples_problem(tmp_path, mode):
    """on_error="skip": a file whose copy fails verification does not stop the staging pass;
    its sample is counted (with its key and reason) and left out of the stream, or read without
    that member, and the file is tried again when read, so a remote mended since is staged."""
    remote, stage = str(tmp_path / "remote"), str(tmp_path / "stage")
    files = _tree(remote)
    write_file_manifest(remote)
    bad = os.path.join(remote, "part1/s1.jpg")
    with open(bad, "r+b") as f:
        f.write(b"X")  # same size, different bytes
    lines = []
    src = StagedSource(remote, stage, mode=mode, on_error="skip", progress=lines.append)
    if mode == "before":
        assert src.staging_failed == ["part1/s1.jpg"] and src.staging_cost["files"] == 11
        assert any("part1/s1.jpg failed (checksum" in line for line in lines)
    assert [s.key for s in src.iter_samples()] == [k for k in src.keys() if k != "part1/s1"]
    assert src.skipped == {"checksum": 1}
    assert src.problems[-1][:2] == ("checksum", "part1/s1")
    sample = src.read(src.keys().index("part1/s1"))
    assert sample.members == {"txt": b"caption 1"} and src.skipped == {"checksum": 2}
    assert not os.path.exists(os.path.join(_copy_of(stage, remote), "part1/s1.jpg"))
    with open(bad, "r+b") as f:
        f.write(files["part1/s1.jpg"][:1])  # mended
    assert src.read(src.keys().index("part1/s1")).members == {
        "jpg": files["part1/s1.jpg"], "txt": b"caption 1"}
    assert src.skipped == {"checksum": 2}


def test_a_shard_that_fails_to_stage_is_counted_and_the_others_read(tmp_path):
    remote, stage = str(tmp_path / "remote"), str(tmp_path / "stage")
    samples = [(f"s{i:03d}", {"bin": bytes([i]) * 50}) for i in range(20)]
    write_shards(samples, remote, max_count=5)
    write_file_manifest(remote)
    shard = sorted(n for n in os.listdir(remote) if n.endswith(".tar"))[1]
    with open(os.path.join(remote, shard), "r+b") as f:
        f.seek(600)
        f.write(b"X")
    src = StagedSource(remote, stage, inner="shards", on_error="skip", progress=None)
    assert src.staging_failed == [shard]
    assert _samples(src) == samples[:5] + samples[10:]
    assert src.skipped == {"checksum": 1}


@pytest.mark.parametrize("on_error", ["skip", "replace"])
def test_a_dataset_over_staged_shards_counts_a_shard_that_fails_to_stage_once(tmp_path, on_error):
    import fastmm
    from fastmm import MultimodalDataset

    remote = str(tmp_path / "remote")
    write_shards([(f"s{i:02d}", {"png": _png_of_level(10 * i)}) for i in range(12)], remote,
                 max_count=4)
    write_file_manifest(remote)
    shard = sorted(n for n in os.listdir(remote) if n.endswith(".tar"))[1]
    with open(os.path.join(remote, shard), "r+b") as f:
        f.seek(600)
        f.write(b"X")
    ds = MultimodalDataset(remote, source="staged", inner="shards", decoder="pil", size=8,
                           stage_dir=str(tmp_path / "stage"), on_error=on_error, progress=None)
    levels = [b["image"][:, 0, 0, 0].tolist()
              for b in fastmm.DataLoader(ds, batch_size=4, num_workers=2)]
    assert levels == ([[0, 10, 20, 30], [80, 90, 100], [110]] if on_error == "skip"
                      else [[0, 10, 20, 30], [80, 80, 90, 100], [110]])
    assert ds.skipped == {"checksum": 1}


@pytest.mark.parametrize("on_error", ["skip", "replace", "raise"])
def test_a_dataset_over_a_staged_source_applies_its_policy_to_files_that_fail_to_stage(
        tmp_path, on_error):
    """MultimodalDataset owns the policy: with skip or replace, a file that fails to stage is
    one bad sample, counted once across workers; with raise, staging stops."""
    import fastmm
    from fastmm import MultimodalDataset

    remote = tmp_path / "remote"
    remote.mkdir()
    for i in range(6):
        (remote / f"s{i}.png").write_bytes(_png_of_level(30 * i))
    write_file_manifest(str(remote))
    with open(remote / "s3.png", "r+b") as f:
        f.seek(30)
        f.write(b"XX")

    def make():
        return MultimodalDataset(str(remote), source="staged", stage_dir=str(tmp_path / "stage"),
                                 decoder="pil", size=8, on_error=on_error, progress=None)

    if on_error == "raise":
        with pytest.raises(SourceError, match="checksum"):
            make()
        return
    ds = make()
    levels = [b["image"][:, 0, 0, 0].tolist()
              for b in fastmm.DataLoader(ds, batch_size=3, num_workers=2)]
    assert levels == ([[0, 30, 60], [120, 150]] if on_error == "skip"
                      else [[0, 30, 60], [120, 120, 150]])
    assert ds.skipped == {"checksum": 1}


def test_a_full_staging_disk_stops_the_run_instead_of_counting_samples(tmp_path):
    """Out of space in stage_dir is no sample's fault: StagingError (a RuntimeError) under
    every policy, through the loader's workers too, never a run of "bad" samples skipped."""
    import numpy as np
    from PIL import Image

    import fastmm
    from _shm import private_tmpfs

    remote = tmp_path / "remote"
    remote.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):  # ~30 KB of noise each
        Image.fromarray(rng.integers(0, 256, (100, 100, 3), np.uint8)).save(remote / f"s{i}.png")
    with private_tmpfs("128k") as stage:
        src = StagedSource(str(remote), stage, mode="on_touch", on_error="skip", progress=None)
        with pytest.raises(fastmm.StagingError, match="No space left on device"):
            for i in range(len(src)):
                src.read(i)
        assert src.skipped == {}
    with private_tmpfs("128k") as stage:
        ds = fastmm.MultimodalDataset(str(remote), source="staged", stage_dir=stage,
                                      mode="on_touch", decoder="pil", size=8, on_error="skip")
        with pytest.raises(fastmm.StagingError, match="FASTMM_STAGE_DIR"):
            list(fastmm.DataLoader(ds, batch_size=2, num_workers=2))
        assert ds.skipped == {}
    with private_tmpfs("128k") as stage:  # mode "before" finds out before copying
        with pytest.raises(fastmm.StagingError, match="FASTMM_STAGE_DIR"):
            fastmm.MultimodalDataset(str(remote), source="staged", stage_dir=stage,
                                     mode="before", decoder="pil", size=8, on_error="skip")


def _png_of_level(level: int) -> bytes:
    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.full((20, 24, 3), level, np.uint8)).save(out, "PNG")
    return out.getvalue()


def test_a_remote_root_that_is_not_there_is_an_error_not_an_empty_stage(tmp_path):
    with pytest.raises(FileNotFoundError):
        StagedSource(str(tmp_path / "typo"), str(tmp_path / "stage"))


def test_size_cap(tmp_path):
    remote, stage = str(tmp_path / "remote"), str(tmp_path / "stage")
    files = _tree(remote)
    total = sum(map(len, files.values()))
    with pytest.raises(
        SourceError, match=f"staging needs {total} bytes, over max_bytes={total - 1}"
    ) as e:
        StagedSource(remote, stage, max_bytes=total - 1)
    assert e.value.reason == "stage_cap"
    assert _listing(_copy_of(stage, remote)) <= {
        ".fastmm-stage",
        ".fastmm-stage/locks",
        ".fastmm-stage/records",
        ".fastmm-stage/tmp",
    }
    assert StagedSource(remote, stage, max_bytes=total).staging_cost["bytes"] == total


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    requests: list | None = None  # paths served, when a test wants to count them
    delay_s = 0.0

    def do_GET(self):
        if self.requests is not None:
            self.requests.append(self.path)
        time.sleep(self.delay_s)  # a slow remote, so concurrent stagers really overlap
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def serve(tmp_path):
    """Serve a directory on 127.0.0.1 (nothing else is reached); yields a function root -> URL."""
    servers = []

    def start(root, **attrs):
        handler = type("Handler", (_QuietHandler,), attrs)
        server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(handler, directory=root)
        )
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


_STAGER = """
import json, sys, time
from fastmm.sources import StagedSource
remote, stage, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
while time.time() < start:
    time.sleep(0.001)
src = StagedSource(remote, stage, inner="shards")
print(json.dumps({"cost": src.staging_cost, "n": len(src), "last": src.read(len(src) - 1).members["bin"].hex()}))
"""


@pytest.mark.slow
def test_three_processes_stage_each_file_once(tmp_path, serve):
    remote, stage = str(tmp_path / "remote"), str(tmp_path / "stage")
    samples = [(f"s{i:03d}", {"bin": os.urandom(20000)}) for i in range(24)]
    paths = write_shards(samples, remote, max_count=3)
    write_file_manifest(remote)
    requests: list[str] = []
    url = serve(remote, requests=requests, delay_s=0.1)  # ~1 s of staging for the three to share
    start = time.time() + 3.0  # all three start staging at the same moment
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _STAGER, url, stage, str(start)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(requests) == sorted(
        ["/.fastmm-files.jsonl"] * 3 + [f"/{os.path.basename(p)}" for p in paths]
    )  # each shard fetched once
    assert sum(o["cost"]["files"] for o in outs) == len(paths)
    assert sum(o["cost"]["bytes"] for o in outs) == sum(os.path.getsize(p) for p in paths)
    assert all(o["n"] == 24 and o["last"] == samples[-1][1]["bin"].hex() for o in outs)
    assert os.listdir(os.path.join(_copy_of(stage, url), ".fastmm-stage", "tmp")) == []


def _send_half_then_stall(handler, source, outputfile):
    data = source.read()
    if not handler.path.endswith(".tar"):  # the listing goes whole
        return outputfile.write(data)
    outputfile.write(data[: len(data) // 2])
    outputfile.flush()
    time.sleep(60)


@pytest.mark.slow
def test_a_stager_killed_mid_copy_leaves_no_partial_copy(tmp_path, serve):
    """kill -9 while a copy is half written: the next stager removes what it left (its bucket's
    lock is free, so no live stager is writing it) and stages the file whole."""
    remote, stage = str(tmp_path / "remote"), str(tmp_path / "stage")
    samples = [(f"s{i:03d}", {"bin": os.urandom(1_000_000)}) for i in range(6)]
    write_shards(samples, remote, max_count=3)  # 3 MB shards: the first 1 MiB chunk lands
    write_file_manifest(remote)
    stall = [True]

    def copyfile(handler, source, outputfile):
        if stall[0]:
            return _send_half_then_stall(handler, source, outputfile)
        return outputfile.write(source.read())

    url = serve(remote, copyfile=copyfile)
    proc = subprocess.Popen([sys.executable, "-c", _STAGER, url, stage, "0"],
                            stdout=subprocess.DEVNULL)
    tmp = os.path.join(_copy_of(stage, url), ".fastmm-stage", "tmp")

    def partial() -> int:
        names = os.listdir(tmp) if os.path.isdir(tmp) else []
        return sum(os.path.getsize(os.path.join(tmp, n)) for n in names)

    deadline = time.time() + 30
    while partial() < 1 << 20 and time.time() < deadline:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert partial() >= 1 << 20  # part of a shard, left by the killed stager
    stall[0] = False  # the job starts again, from the same server
    src = StagedSource(url, stage, inner="shards")
    assert os.listdir(tmp) == [] and _samples(src) == samples


def test_http_staging(tmp_path, serve):
    root = str(tmp_path / "served")
    url = serve(root)
    samples = [(f"s{i:03d}", {"jpg": bytes([i]) * 3000, "txt": b"t%d" % i}) for i in range(12)]
    write_shards(samples, root, max_count=5)
    with pytest.raises(SourceError, match="no_listing"):
        StagedSource(url, str(tmp_path / "stage"), inner="shards")
    write_file_manifest(root)
    src = StagedSource(url, str(tmp_path / "stage"), inner="shards")
    assert _samples(src) == samples
    assert src.staging_cost["files"] == 3
    lazy = StagedSource(url, str(tmp_path / "stage2"), inner="shards", mode="on_touch")
    assert [(s.key, s.members) for s in lazy.iter_samples(0, 1, 0, 1)] == samples
    os.unlink(os.path.join(root, "shard-000001.tar"))  # listed but gone: a typed error, not a crash
    with pytest.raises(SourceError, match="unreadable") as e:
        StagedSource(url, str(tmp_path / "stage3"), inner="shards")
    assert e.value.key == "shard-000001.tar"


def _hostile_tar(path, outside):
    def add(tar, name, kind=tarfile.REGTYPE, data=b"", size=None, **kw):
        info = tarfile.TarInfo(name)
        info.type = kind
        info.size = len(data) if kind == tarfile.REGTYPE else 0
        for k, v in kw.items():
            setattr(info, k, v)
        tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        add(tar, "../evil.txt", data=b"dotdot")
        add(tar, "sub/../../evil2.txt", data=b"dotdot")
        add(tar, os.path.join(outside, "abs_evil.txt"), data=b"absolute")
        add(tar, "good/a.jpg", data=b"good jpeg")
        add(tar, "good/a.txt", data=b"good caption")
        add(tar, "sym", tarfile.SYMTYPE, linkname=outside)
        add(
            tar, "sym/through_link.txt", data=b"must land in a real directory, not through the link"
        )
        add(tar, "hard.txt", tarfile.LNKTYPE, linkname=os.path.join(outside, "victim.txt"))
        add(tar, "dev.bin", tarfile.CHRTYPE, devmajor=1, devminor=3)
        add(tar, "fifo.bin", tarfile.FIFOTYPE)
        add(tar, "big.bin", data=b"x" * 5000)


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_extract_never_writes_outside_stage_dir(tmp_path, on_error):
    remote, stage = tmp_path / "remote", tmp_path / "stage"
    remote.mkdir()
    (tmp_path / "victim.txt").write_bytes(b"untouched")
    _hostile_tar(str(remote / "data.tar"), str(tmp_path))
    before = _listing(str(tmp_path))
    if on_error == "raise":
        with pytest.raises(SourceError, match="unsafe_name"):
            StagedSource(str(remote), str(stage), extract=True, max_member_bytes=4096)
        after = _listing(str(tmp_path))
        assert {p for p in after - before if not p.startswith("stage")} == set()
        assert not os.path.exists(os.path.join(_copy_of(stage, remote), "data"))
        return
    src = StagedSource(
        str(remote), str(stage), extract=True, max_member_bytes=4096, on_error="skip"
    )
    after = _listing(str(tmp_path))
    assert {p for p in after - before if not p.startswith("stage")} == set()
    assert (tmp_path / "victim.txt").read_bytes() == b"untouched"
    staged = {p for p in _listing(_copy_of(stage, remote)) if not p.startswith(".fastmm-stage")}
    assert staged == {
        "data",
        "data/good",
        "data/good/a.jpg",
        "data/good/a.txt",
        "data/sym",
        "data/sym/through_link.txt",
    }
    assert not any(os.path.islink(os.path.join(_copy_of(stage, remote), p))
               for p in _listing(_copy_of(stage, remote)))
    assert src.skipped == {"unsafe_name": 3, "not_a_file": 4, "too_large": 1}
    assert [(s.key, s.members) for s in src.iter_samples()] == [
        ("data/good/a", {"jpg": b"good jpeg", "txt": b"good caption"}),
        ("data/sym/through_link", {"txt": b"must land in a real directory, not through the link"}),
    ]


def test_config_precedence_and_bad_values(tmp_path, monkeypatch):
    remote = str(tmp_path / "remote")
    _tree(remote, 2)
    monkeypatch.delenv("FASTMM_SOURCE", raising=False)
    monkeypatch.delenv("FASTMM_STAGE_DIR", raising=False)
    assert SourceConfig.from_env() == SourceConfig("posix", None)
    assert isinstance(open_source(None, remote), FileSource)  # the default
    monkeypatch.setenv("FASTMM_SOURCE", "staged")
    monkeypatch.setenv("FASTMM_STAGE_DIR", str(tmp_path / "env_stage"))
    src = open_source(None, remote)  # both from the environment
    assert isinstance(src, StagedSource) and src.stage_dir == _copy_of(tmp_path / "env_stage", remote)
    assert open_source(None, remote, stage_dir=str(tmp_path / "arg_stage")).stage_dir == _copy_of(
        tmp_path / "arg_stage", remote
    )
    assert isinstance(open_source("posix", remote), FileSource)  # an argument beats the variable
    monkeypatch.setenv("FASTMM_SOURCE", "s3")
    with pytest.raises(ConfigError, match=r"FASTMM_SOURCE='s3'.*\('posix', 'staged', 'shards'\)"):
        open_source(None, remote)
    assert isinstance(open_source("shards", remote), ShardSource)
    with pytest.raises(ValueError, match="unknown source kind 'nfs'"):
        open_source("nfs", remote)
    monkeypatch.setenv("FASTMM_STAGE_DIR", "/no/such/parent/stage")
    with pytest.raises(ConfigError, match="FASTMM_STAGE_DIR='/no/such/parent/stage'"):
        StagedSource(remote)
    monkeypatch.delenv("FASTMM_STAGE_DIR")
    with pytest.raises(ValueError, match="needs stage_dir= or FASTMM_STAGE_DIR"):
        StagedSource(remote)


@pytest.mark.parametrize("mode", ["before", "on_touch"])
def test_stage_posix_manifest_and_subtree_entry(tmp_path, mode):
    remote = str(tmp_path / "remote")
    _tree(remote)
    with open(os.path.join(remote, "samples.jsonl"), "w") as f:
        f.write(
            json.dumps({"key": "one", "members": {"jpg": "part1/s3.jpg", "txt": "part0/s0.txt"}})
            + "\n"
        )
    src = StagedSource(remote, str(tmp_path / f"stage-{mode}"), entry="samples.jsonl", mode=mode)
    assert src.keys() == ["one"]
    assert src.read(0).members == {"jpg": bytes([3]) * 1003, "txt": b"caption 0"}
    assert src.staging_cost["files"] == (13 if mode == "before" else 3)
    sub = StagedSource(remote, str(tmp_path / f"sub-{mode}"), entry="part1", mode=mode)
    assert _samples(sub) == _samples(FileSource(os.path.join(remote, "part1")))


@pytest.mark.parametrize("mode", ["before", "on_touch"])
def test_two_corpora_with_the_same_names_in_one_stage_dir_stay_apart(tmp_path, mode):
    """A training and a validation set staged under one FASTMM_STAGE_DIR: the same shard names
    (write_shards numbers them from 0), each its own bytes (they served each other's)."""
    stage = str(tmp_path / "stage")
    corpora = {}
    for name, level in (("train", 10), ("val", 200)):
        samples = [(f"{name}{i}", {"bin": bytes([level + i]) * 500}) for i in range(6)]
        write_shards(samples, str(tmp_path / name), max_count=3)
        corpora[name] = samples
    train = StagedSource(str(tmp_path / "train"), stage, inner="shards", mode=mode)
    val = StagedSource(str(tmp_path / "val"), stage, inner="shards", mode=mode)
    assert _samples(val) == corpora["val"] and _samples(train) == corpora["train"]
    assert train.stage_dir != val.stage_dir and os.path.dirname(train.stage_dir) == stage


def test_an_extracted_tar_removed_at_the_source_is_no_longer_read(tmp_path):
    remote, stage = tmp_path / "remote", str(tmp_path / "stage")
    remote.mkdir()
    for name in ("a", "b"):
        with tarfile.open(remote / f"{name}.tar", "w") as tar:
            data = f"caption {name}".encode()
            member = tarfile.TarInfo(f"{name}1.txt")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    assert StagedSource(str(remote), stage, extract=True).keys() == ["a/a1", "b/b1"]
    os.unlink(remote / "b.tar")
    assert StagedSource(str(remote), stage, extract=True).keys() == ["a/a1"]


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_a_stage_dir_turned_read_only_stops_the_run_not_a_sample(tmp_path, on_error):
    """Every copy would fail: a StagingError under every policy, not samples counted bad."""
    from _shm import private_tmpfs

    from fastmm.sources.staged import StagingError

    remote = str(tmp_path / "remote")
    _tree(remote)
    with private_tmpfs("8m") as stage:
        src = StagedSource(remote, stage, mode="on_touch", on_error=on_error, progress=None)
        src.read(0)
        subprocess.run(["mount", "-o", "remount,ro", stage], check=True)
        with pytest.raises(StagingError, match="write permission"):
            src.read(3)
        assert src.skipped == {}


class _ChunkedDropping(http.server.BaseHTTPRequestHandler):
    """Sends files chunked, as a streaming proxy does, and drops the connection halfway through
    every one but the listing."""

    protocol_version = "HTTP/1.1"
    root = ""

    def log_message(self, *args):
        pass

    def do_GET(self):
        with open(os.path.join(self.root, self.path.lstrip("/")), "rb") as f:
            data = f.read()
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        listing = self.path.endswith(".jsonl")
        part = data if listing else data[: len(data) // 2]
        self.wfile.write(b"%x\r\n" % len(part) + part + b"\r\n")
        if listing:
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True


@pytest.mark.parametrize("mode", ["before", "on_touch"])
def test_a_chunked_connection_dropped_mid_file_is_that_files_problem(tmp_path, mode):
    """SourceError "unreadable" under raise, one counted skip under skip; not http.client's
    IncompleteRead from the depths."""
    remote = str(tmp_path / "remote")
    _tree(remote, 2)
    write_file_manifest(remote)
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), type("Handler", (_ChunkedDropping,), {"root": remote}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(SourceError, match="unreadable: IncompleteRead"):
            StagedSource(url, str(tmp_path / "raise"), mode=mode, progress=None).read(0)
        src = StagedSource(url, str(tmp_path / "skip"), mode=mode, on_error="skip", progress=None)
        assert list(src.iter_samples()) == [] and src.skipped == {"unreadable": 2}
    finally:
        server.shutdown()
        server.server_close()


def _manifest_of(remote, files: dict[str, bytes], listed: list[str]) -> None:
    """``files`` written under ``remote``; its manifest lists ``listed`` (each with the size and
    sha256 of the file of that name, or of b"x")."""
    import hashlib

    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(remote, rel)), exist_ok=True)
        with open(os.path.join(remote, rel), "wb") as f:
            f.write(data)
    with open(os.path.join(remote, ".fastmm-files.jsonl"), "w") as f:
        for rel in listed:
            data = files.get(rel, b"x")
            f.write(json.dumps({"path": rel, "size": len(data),
                                "sha256": hashlib.sha256(data).hexdigest()}) + "\n")


def _tar_of(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("extract", [False, True])
def test_listed_names_that_leave_collide_or_name_the_stage_are_counted_never_copied(tmp_path,
                                                                                    extract):
    """A published manifest names files outside the root, the staging directory's own records,
    and files whose copies would land on one another: none is copied, each is counted by name,
    and the rest stage and read."""
    remote, stage = tmp_path / "remote", tmp_path / "stage"
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "keep.txt").write_bytes(b"mine")
    files = {"good.jpg": b"good", "dup.jpg": b"dup", "c.tar": _tar_of({"in.jpg": b"in"}),
             "c/x.jpg": b"cx", "d": b"file d", ".fastmm-stage.tar": _tar_of({"a.b": b"!"}),
             ".tar": _tar_of({"z.jpg": b"z"})}
    hostile = [str(tmp_path / "victim" / "keep.txt"), "../victim/keep.txt", "a//b.jpg",
               "./good.jpg", ".fastmm-stage/records/0.json", "d", "d/e.jpg", "dup.jpg",
               "dup.jpg"]
    tars = ["c.tar", "c/x.jpg", ".fastmm-stage.tar", ".tar"]
    if extract:  # unpacked, these would replace other copies or the stage's records
        hostile += tars
    _manifest_of(str(remote), files, ["good.jpg", *hostile] + ([] if extract else tars))
    before = _listing(str(tmp_path))
    src = StagedSource(str(remote), str(stage), extract=extract, on_error="skip", progress=None)
    assert sorted(p.key for p in src.problems) == sorted(hostile)
    assert src.skipped == {"unsafe_name": len(hostile)}
    assert [f.path for f in src.files] == ["good.jpg"] + ([] if extract else tars)
    assert (tmp_path / "victim" / "keep.txt").read_bytes() == b"mine"
    assert {p for p in _listing(str(tmp_path)) - before if not p.startswith("stage")} == set()
    copy = _copy_of(stage, remote)
    records = os.listdir(os.path.join(copy, ".fastmm-stage", "records"))
    assert len(records) == len(src.files) and "0.json" not in records
    with pytest.raises(SourceError) as e:
        StagedSource(str(remote), str(tmp_path / "stage2"), extract=extract, progress=None)
    assert e.value.reason == "unsafe_name"


def test_a_tar_made_from_its_directory_unpacks_without_complaint(tmp_path):
    """``tar -C dir -cf x.tar .`` names members "./a.jpg" under a "./" entry: tar's own form."""
    remote, stage = tmp_path / "remote", tmp_path / "stage"
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.jpg").write_bytes(b"a")
    remote.mkdir()
    subprocess.run(["tar", "-C", str(tmp_path / "dir"), "-cf", str(remote / "x.tar"), "."],
                   check=True)
    src = StagedSource(str(remote), str(stage), extract=True, on_error="skip", progress=None)
    assert src.skipped == {}
    assert [(s.key, s.members) for s in src.iter_samples()] == [("x/a", {"jpg": b"a"})]
    shards = ShardSource(str(remote), on_error="skip", progress=None)
    assert shards.keys() == ["./a"] and shards.skipped == {}  # webdataset's key, as it splits


def test_a_manifest_over_the_cap_is_refused_whole(tmp_path, monkeypatch):
    import fastmm.sources.base as base

    remote = tmp_path / "remote"
    _manifest_of(str(remote), {f"s{i}.jpg": b"x" for i in range(50)},
                 [f"s{i}.jpg" for i in range(50)])
    (remote / "m.jsonl").write_text("".join(
        json.dumps({"key": f"s{i}", "members": {"jpg": f"s{i}.jpg"}}) + "\n" for i in range(50)))
    size = min(os.path.getsize(remote / n) for n in (".fastmm-files.jsonl", "m.jsonl"))
    monkeypatch.setattr(base, "MAX_MANIFEST_BYTES", size - 1)
    for make in (lambda: StagedSource(str(remote), str(tmp_path / "stage"), progress=None),
                 lambda: FileSource(str(remote / "m.jsonl"), on_error="skip").keys()):
        with pytest.raises(SourceError) as e:
            make()
        assert e.value.reason == "too_large" and "MAX_MANIFEST_BYTES" in str(e.value)
    monkeypatch.setattr(base, "MAX_MANIFEST_BYTES", 1 << 20)
    assert len(FileSource(str(remote / "m.jsonl")).keys()) == 50
