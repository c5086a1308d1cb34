"""FileSource: directory trees and manifests, exact keys and bytes, bad input, splitting."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from fastmm.sources import FileSource, Sample, SourceError, open_source


def _write(root, rel, data: bytes):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


@pytest.fixture
def tree(tmp_path):
    root = str(tmp_path / "tree")
    files = {
        "a/x.jpg": b"\xff\xd8jpeg-x",
        "a/x.txt": b"caption x",
        "a/y.seg.png": b"png-y",
        "a/y.jpg": b"",  # a zero-byte member is data, kept as b""
        "b.jpg": b"jpeg-b",
        "b.JSON": b'{"b": 1}',
        ".hidden.jpg": b"never",
        "a/.lock": b"never",
        "README": b"no extension, not a member",
    }
    for rel, data in files.items():
        _write(root, rel, data)
    return root


def test_tree_exact_keys_members_and_origin(tree):
    src = FileSource(tree)
    assert src.keys() == ["a/x", "a/y", "b"]
    assert len(src) == 3
    assert src.read(0) == Sample(
        "a/x", {"jpg": b"\xff\xd8jpeg-x", "txt": b"caption x"}, os.path.join(tree, "a/x")
    )
    assert src.read(1).members == {"jpg": b"", "seg.png": b"png-y"}
    assert src.read(2).members == {"jpg": b"jpeg-b", "json": b'{"b": 1}'}  # extensions lower-cased
    assert list(src.iter_samples()) == [src.read(i) for i in range(3)]
    assert src.skipped == {}


def test_the_posix_kind_is_a_file_source_under_its_older_name_too(tree):
    """``PosixSource`` (its name before it read s3:// too) is ``FileSource``; "posix" opens it."""
    from fastmm.sources import PosixSource

    assert PosixSource is FileSource
    assert type(open_source("posix", tree)) is FileSource


def test_manifest_order_and_paths(tmp_path, tree):
    manifest = tmp_path / "tree" / "samples.jsonl"
    lines = [
        {"key": "second", "members": {"jpg": "b.jpg", "txt": "a/x.txt"}},
        {"key": "first", "members": {"jpg": "a/x.jpg"}},
    ]
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    src = open_source("posix", str(manifest))
    assert src.keys() == ["second", "first"]  # the manifest's order, not sorted
    assert src.read(0).members == {"jpg": b"jpeg-b", "txt": b"caption x"}
    assert src.read(1) == Sample("first", {"jpg": b"\xff\xd8jpeg-x"}, f"{manifest}:2")


def _bad_manifest(tmp_path, tree):
    manifest = tmp_path / "tree" / "m.jsonl"
    manifest.write_text(
        json.dumps({"key": "ok", "members": {"jpg": "b.jpg"}})
        + "\n"
        + "{not json\n"
        + json.dumps({"key": "escape", "members": {"jpg": "../outside.jpg"}})
        + "\n"
        + json.dumps({"key": "gone", "members": {"jpg": "missing.jpg"}})
        + "\n"
        + json.dumps({"key": "nocap", "members": {"jpg": "b.jpg"}, "x": 1})
        + "\n"
    )
    return str(manifest)


def test_manifest_bad_input_skip(tmp_path, tree):
    src = FileSource(_bad_manifest(tmp_path, tree), on_error="skip")
    assert src.keys() == ["ok", "gone", "nocap"]
    assert src.skipped == {"bad_manifest": 1, "unsafe_name": 1}
    assert [p.reason for p in src.problems] == ["bad_manifest", "unsafe_name"]
    assert src.problems[1].key == "escape" and src.problems[1].origin.endswith("m.jsonl:3")
    # streaming skips the unreadable sample; random access cannot, so it returns what it could read
    assert [s.key for s in src.iter_samples()] == ["ok", "nocap"]
    assert src.read(1) == Sample("gone", {}, os.path.join(tree, "missing.jpg"))
    assert src.skipped == {"bad_manifest": 1, "unsafe_name": 1, "unreadable": 2}
    assert src.problems[-1].key == "gone"


def test_manifest_bad_input_raise(tmp_path, tree):
    src = FileSource(_bad_manifest(tmp_path, tree))
    assert src.keys() == ["ok", "", "escape", "gone", "nocap"]  # damaged entries raise when touched
    assert src.read(0).members == {"jpg": b"jpeg-b"}
    with pytest.raises(SourceError) as e:
        src.read(2)
    assert isinstance(e.value, ValueError)
    assert (e.value.reason, e.value.key) == ("unsafe_name", "escape")
    with pytest.raises(SourceError, match="unreadable") as e:
        src.read(3)
    assert e.value.key == "gone" and e.value.origin.endswith("missing.jpg")
    it = src.iter_samples()
    assert next(it).key == "ok"
    with pytest.raises(SourceError, match="bad_manifest"):
        next(it)


def test_a_manifest_line_that_is_not_utf8_or_nests_too_deep_is_one_bad_line(tmp_path, tree):
    manifest = tmp_path / "tree" / "m.jsonl"
    good = json.dumps({"key": "ok", "members": {"jpg": "b.jpg"}}).encode()
    manifest.write_bytes(b"\n".join([good, b'{"key": "\xff\xfe", "members": {}}',
                                      b"[" * 100_000, good.replace(b'"ok"', b'"ok2"')]) + b"\n")
    src = FileSource(str(manifest), on_error="skip")
    assert src.keys() == ["ok", "ok2"]
    assert src.skipped == {"bad_manifest": 2}
    assert [p.origin.rsplit(":", 1)[1] for p in src.problems] == ["2", "3"]


def test_a_member_that_is_not_a_regular_file_is_not_read(tmp_path):
    """A FIFO would block its reader until a writer comes, a device never ends: neither is a
    sample member, whatever its name says (max_member_bytes could not stop /dev/zero)."""
    root = str(tmp_path / "t")
    _write(root, "a.jpg", b"jpeg-a")
    os.mkfifo(os.path.join(root, "b.jpg"))
    os.symlink("/dev/zero", os.path.join(root, "c.jpg"))
    src = FileSource(root, on_error="skip")
    assert src.read(0).members == {"jpg": b"jpeg-a"}
    assert src.read(1).members == {} and src.read(2).members == {}
    assert src.skipped == {"not_a_file": 2}
    assert [s.key for s in src.iter_samples()] == ["a"]
    with pytest.raises(SourceError, match="not_a_file: b.jpg is not a regular file"):
        FileSource(root).read(1)


def test_required_and_duplicate_members(tmp_path):
    root = str(tmp_path / "t")
    for rel in ("k1.jpg", "k1.txt", "k2.jpg", "k3.jpg", "k3.JPG", "k3.txt"):
        _write(root, rel, rel.encode())
    src = FileSource(root, required=("jpg", "txt"), on_error="skip")
    assert src.keys() == ["k1"]
    assert src.skipped == {"missing_member": 1, "duplicate_member": 1}
    assert {p.key for p in src.problems} == {"k2", "k3"}


def test_too_large_member(tmp_path):
    root = str(tmp_path / "t")
    _write(root, "big.bin", b"x" * 100)
    _write(root, "ok.bin", b"x" * 10)
    src = FileSource(root, max_member_bytes=50, on_error="skip")
    assert [s.key for s in src.iter_samples()] == ["ok"]
    assert src.skipped == {"too_large": 1}


@pytest.mark.parametrize("world_size,num_workers", [(1, 1), (2, 1), (1, 3), (2, 3), (4, 2)])
def test_round_robin_split_covers_each_sample_once(tmp_path, world_size, num_workers):
    root = str(tmp_path / "t")
    for i in range(17):
        _write(root, f"s{i:02d}.bin", bytes([i]))
    src = FileSource(root)
    seen = []
    for rank in range(world_size):
        for worker in range(num_workers):
            part = [s.key for s in src.iter_samples(rank, world_size, worker, num_workers)]
            # the documented order: sample i goes to rank i % W, worker (i // W) % N
            assert part == [
                f"s{i:02d}"
                for i in range(17)
                if (i % world_size, (i // world_size) % num_workers) == (rank, worker)
            ]
            seen += part
    assert sorted(seen) == src.keys()
    with pytest.raises(ValueError):
        list(src.iter_samples(rank=2, world_size=2))


def test_pickles_for_workers(tree):
    src = FileSource(tree)
    src.keys()
    clone = pickle.loads(pickle.dumps(src))
    assert [clone.read(i) for i in range(len(clone))] == [src.read(i) for i in range(len(src))]


def test_running_out_of_file_descriptors_is_not_a_bad_sample(tree, tmp_path):
    """EMFILE is the process's problem: it propagates under on_error="skip" (counted as an
    unreadable sample or directory, every later one would have been skipped too), from the
    posix source's listing and reads and from the shard source alike."""
    import errno
    import resource

    from fastmm.sources import ShardSource, write_shards

    indexed, fresh = FileSource(tree, on_error="skip"), FileSource(tree, on_error="skip")
    indexed.keys()
    shards = ShardSource(write_shards([("s0", {"txt": b"x"})], str(tmp_path / "shards")),
                         on_error="skip")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        while True:  # every descriptor the lowered limit allows, now taken
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        for read in (lambda: indexed.read(0), fresh.keys, shards.keys):
            with pytest.raises(OSError) as e:
                read()
            assert e.value.errno == errno.EMFILE
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert indexed.skipped == fresh.skipped == shards.skipped == {}
    assert indexed.read(0).members and fresh.keys() == indexed.keys() and shards.keys() == ["s0"]


def test_a_missing_root_is_an_error_not_an_empty_corpus(tmp_path):
    from fastmm.sources import ShardSource

    with pytest.raises(FileNotFoundError, match="no directory or manifest"):
        FileSource(str(tmp_path / "typo"))
    with pytest.raises(FileNotFoundError, match="no shard directory or shard"):
        ShardSource(str(tmp_path / "typo.tar"))


_UNLISTED_CHECK = """
import json, sys
from fastmm.sources import FileSource, SourceError
root = sys.argv[1]
skip = FileSource(root, on_error="skip")
strict = FileSource(root)
keys = strict.keys()
try:
    strict.read(keys.index("b/"))
    raised = None
except SourceError as e:
    raised = [e.reason, e.key]
print(json.dumps({"skip_keys": skip.keys(), "skipped": skip.skipped,
                  "problem": list(skip.problems[0][:2]), "strict_keys": keys, "raised": raised}))
"""


@pytest.mark.slow
def test_a_directory_that_cannot_be_listed_is_counted_not_lost(tmp_path):
    """os.walk passes over a directory it cannot list without a word: its samples were lost
    uncounted. Now it is one damaged entry ("b/"): counted under skip, raising when read under
    raise (and so counted once by a dataset that owns the policy). Run without the
    capabilities that let root list any directory."""
    import json
    import shutil
    import subprocess
    import sys

    root = tmp_path / "tree"
    for rel in ("a/x.jpg", "b/y.jpg", "c.jpg"):
        _write(str(root), rel, b"data")
    os.chmod(root / "b", 0)
    try:
        command = [sys.executable, "-c", _UNLISTED_CHECK, str(root)]
        if os.geteuid() == 0:
            if shutil.which("setpriv") is None:
                pytest.skip("root lists any directory, and setpriv is missing to drop that")
            caps = "-dac_override,-dac_read_search"
            command = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", *command]
        out = json.loads(subprocess.run(command, capture_output=True, text=True,
                                        check=True).stdout)
    finally:
        os.chmod(root / "b", 0o755)
    assert out["skip_keys"] == ["a/x", "c"] and out["skipped"] == {"unreadable": 1}
    assert out["problem"] == ["unreadable", "b/"]
    assert out["strict_keys"] == ["a/x", "c", "b/"]
    assert out["raised"] == ["unreadable", "b/"]
