"""PosixSource: directory trees and manifests, exact keys and bytes, bad input, splitting."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from fastmm.sources import PosixSource, Sample, SourceError, open_source


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
    src = PosixSource(tree)
    assert src.keys() == ["a/x", "a/y", "b"]
    assert len(src) == 3
    assert src.read(0) == Sample(
        "a/x", {"jpg": b"\xff\xd8jpeg-x", "txt": b"caption x"}, os.path.join(tree, "a/x")
    )
    assert src.read(1).members == {"jpg": b"", "seg.png": b"png-y"}
    assert src.read(2).members == {"jpg": b"jpeg-b", "json": b'{"b": 1}'}  # extensions lower-cased
    assert list(src.iter_samples()) == [src.read(i) for i in range(3)]
    assert src.skipped == {}


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
    src = PosixSource(_bad_manifest(tmp_path, tree), on_error="skip")
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
    src = PosixSource(_bad_manifest(tmp_path, tree))
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


def test_required_and_duplicate_members(tmp_path):
    root = str(tmp_path / "t")
    for rel in ("k1.jpg", "k1.txt", "k2.jpg", "k3.jpg", "k3.JPG", "k3.txt"):
        _write(root, rel, rel.encode())
    src = PosixSource(root, required=("jpg", "txt"), on_error="skip")
    assert src.keys() == ["k1"]
    assert src.skipped == {"missing_member": 1, "duplicate_member": 1}
    assert {p.key for p in src.problems} == {"k2", "k3"}


def test_too_large_member(tmp_path):
    root = str(tmp_path / "t")
    _write(root, "big.bin", b"x" * 100)
    _write(root, "ok.bin", b"x" * 10)
    src = PosixSource(root, max_member_bytes=50, on_error="skip")
    assert [s.key for s in src.iter_samples()] == ["ok"]
    assert src.skipped == {"too_large": 1}


@pytest.mark.parametrize("world_size,num_workers", [(1, 1), (2, 1), (1, 3), (2, 3), (4, 2)])
def test_round_robin_split_covers_each_sample_once(tmp_path, world_size, num_workers):
    root = str(tmp_path / "t")
    for i in range(17):
        _write(root, f"s{i:02d}.bin", bytes([i]))
    src = PosixSource(root)
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
    src = PosixSource(tree)
    src.keys()
    clone = pickle.loads(pickle.dumps(src))
    assert [clone.read(i) for i in range(len(clone))] == [src.read(i) for i in range(len(src))]
