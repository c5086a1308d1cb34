"""ShardSource and write_shards: webdataset interop both ways (and webdataset pipelines in
fastmm's loader), index vs stream, bad and hostile tars."""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import pathlib
import tarfile

import numpy as np
import pytest
import torch

import fastmm
from fastmm.sources import Sample, ShardSource, SourceError, open_source, slot_of, write_shards
from fastmm.sources.base import ProgressLines

wds = pytest.importorskip("webdataset")


def _samples(n=23):
    out = []
    for i in range(n):
        members = {
            "jpg": hashlib.sha256(str(i).encode()).digest() * (i % 7),
            "txt": f"caption {i}".encode(),
            "cls": str(i % 5).encode(),
        }
        if i % 4 == 0:
            members["seg.png"] = b"png" * i
        out.append((f"d{i % 3}/s{i:04d}", members))
    return out


def _plain(wds_sample):
    return wds_sample["__key__"], {k: v for k, v in wds_sample.items() if not k.startswith("__")}


def test_our_shards_read_by_webdataset(tmp_path):
    samples = _samples()
    paths = write_shards(samples, str(tmp_path), max_count=5)
    assert [os.path.basename(p) for p in paths] == [f"shard-{i:06d}.tar" for i in range(5)]
    got = [_plain(x) for x in wds.WebDataset(paths, shardshuffle=False)]
    assert got == samples  # same keys, same bytes (the zero-byte "jpg" of sample 0 included)
    assert samples[0][1]["jpg"] == b""


def test_webdataset_shards_read_by_us(tmp_path):
    samples = _samples()
    samples.append(("k" * 150, {"txt": b"a name longer than ustar's 100 bytes needs a pax header"}))
    with wds.ShardWriter(str(tmp_path / "wds-%06d.tar"), maxcount=6, verbose=0) as sink:
        for key, members in samples:
            sink.write({"__key__": key, **members})
    src = ShardSource(str(tmp_path))
    assert len(src.shards) == 4
    assert [(s.key, s.members) for s in src.iter_samples()] == samples
    assert [(src.read(i).key, src.read(i).members) for i in range(len(src))] == samples
    assert src.skipped == {}


def test_random_access_equals_stream_and_writer_is_deterministic(tmp_path):
    a = write_shards(_samples(), str(tmp_path / "a"), max_bytes=3000)
    b = write_shards(_samples(), str(tmp_path / "b"), max_bytes=3000)
    assert len(a) > 2
    assert [pathlib.Path(p).read_bytes() for p in a] == [pathlib.Path(p).read_bytes() for p in b]
    src = ShardSource(str(tmp_path / "a"))
    stream = list(src.iter_samples())
    assert stream == [src.read(i) for i in range(len(src))]
    assert src.keys() == [k for k, _ in _samples()]
    first = src.read(0)
    assert first.origin == f"{a[0]}:0"


def test_reading_a_sample_reads_its_span_not_a_buffer(tmp_path):
    """Random access reads one sample's members, not the read-ahead buffer a stream uses (a
    1 MiB buffered read for a 10 KB sample made shard reads 6x slower than files); counted by
    the kernel (/proc/self/io rchar), so no timing."""
    if not os.path.exists("/proc/self/io"):
        pytest.skip("needs Linux's /proc/self/io")
    rng = np.random.default_rng(0)
    samples = [(f"{i:04d}", {"bin": rng.bytes(10_000), "cls": b"1"}) for i in range(300)]
    (shard,) = write_shards(samples, str(tmp_path))
    src = ShardSource(shard)
    len(src)  # the index first: its scan reads the whole shard

    def bytes_read() -> int:
        with open("/proc/self/io") as f:
            return int(f.readline().split()[1])  # rchar (this read's own bytes included)

    for i in (7, 150, 299):
        before = bytes_read()
        assert src.read(i).members == dict(samples[i][1])
        assert bytes_read() - before < 16_000


def test_index_cache_beside(tmp_path):
    paths = write_shards(_samples(), str(tmp_path), max_count=10)
    src = ShardSource(str(tmp_path), index_cache="beside")
    want = [src.read(i) for i in range(len(src))]
    caches = sorted(n for n in os.listdir(tmp_path) if n.endswith(".fastmm-idx.json"))
    assert caches == [f".{os.path.basename(p)}.fastmm-idx.json" for p in paths]
    again = ShardSource(str(tmp_path), index_cache="beside")  # loads the cached index
    assert [again.read(i) for i in range(len(again))] == want


def test_long_indexing_reports_progress(tmp_path, monkeypatch, capsys):
    write_shards(_samples(), str(tmp_path), max_count=10)  # 3 shards
    assert len(ShardSource(str(tmp_path))) == 23 and capsys.readouterr().err == ""  # quick: quiet
    monkeypatch.setattr(ProgressLines, "EVERY_S", 0.0)  # as if each shard took 5 s
    lines = []
    assert len(ShardSource(str(tmp_path), progress=lines.append)) == 23
    assert [line.split(": ")[-1].split(" shards")[0] for line in lines] == ["0/3", "1/3", "2/3", "3/3"]
    assert lines[-1].startswith("fastmm: indexing shards: 3/3 shards (23 samples)")


@pytest.mark.parametrize("world_size,num_workers", [(1, 1), (2, 1), (1, 4), (2, 3), (3, 2)])
def test_shard_assignment_covers_each_sample_once(tmp_path, world_size, num_workers):
    write_shards(_samples(), str(tmp_path), max_count=3)  # 8 shards
    src = ShardSource(str(tmp_path))
    seen = []
    for rank in range(world_size):
        for worker in range(num_workers):
            mine = src.shards_for(rank, world_size, worker, num_workers)
            assert mine == [
                p
                for i, p in enumerate(src.shards)
                if slot_of(i, world_size, num_workers) == (rank, worker)
            ]
            seen += [s.key for s in src.iter_samples(rank, world_size, worker, num_workers)]
    assert sorted(seen) == sorted(src.keys())
    assert slot_of(5, 2, 3) == (1, 2)  # webdataset: node 5 % 2, then worker (5 // 2) % 3


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def test_truncated_shard_keeps_complete_samples(tmp_path):
    samples = [(f"s{i}", {"bin": bytes([i]) * 700, "txt": b"t%d" % i}) for i in range(6)]
    [path] = write_shards(samples, str(tmp_path))
    offset = ShardSource(path).read(3).origin.rsplit(":", 1)[1]
    _truncate(path, int(offset) + 512 + 300)  # cut inside s3's first member's data
    skip = ShardSource(path, on_error="skip")
    assert [(s.key, s.members) for s in skip.iter_samples()] == samples[:3]
    assert skip.skipped == {"truncated": 1}
    assert (skip.problems[0].key, skip.problems[0].origin) == ("s3", f"{path}:{offset}")
    indexed = ShardSource(path, on_error="skip")
    assert indexed.keys() == ["s0", "s1", "s2"]
    assert [indexed.read(i).members for i in range(3)] == [m for _, m in samples[:3]]
    assert indexed.skipped == {"truncated": 1}

    strict = ShardSource(path)
    assert strict.keys() == ["s0", "s1", "s2", "s3"]
    with pytest.raises(SourceError) as e:
        strict.read(3)
    assert (e.value.reason, e.value.key, e.value.origin) == ("truncated", "s3", f"{path}:{offset}")
    it = strict.iter_samples()
    assert [next(it).key for _ in range(3)] == ["s0", "s1", "s2"]
    with pytest.raises(SourceError, match="truncated"):
        next(it)


@pytest.mark.parametrize("cut", ["mid_header", "before_end_marker", "empty_file"])
def test_other_truncations_are_reported(tmp_path, cut):
    samples = [(f"s{i}", {"txt": b"x" * 10}) for i in range(3)]
    [path] = write_shards(samples, str(tmp_path))
    size = {"mid_header": 2048 + 200, "before_end_marker": 3 * 1024, "empty_file": 0}[cut]
    _truncate(path, size)
    src = ShardSource(path, on_error="skip")
    keys = [s.key for s in src.iter_samples()]
    # a cut may have taken members of the sample before it (one key per member), so that one is reported
    assert keys == {"mid_header": ["s0"], "before_end_marker": ["s0", "s1"], "empty_file": []}[cut]
    assert src.skipped == {"truncated": 1}


def test_a_shard_that_cannot_be_opened_is_reported(tmp_path):
    """A listed shard gone (or a staged copy that failed): counted as "unreadable" under its
    name, the other shards read, in the index and in the stream; under raise, one damaged entry
    stands for its samples in the index (so a dataset that owns the policy counts it once) and
    raises when read, and the stream raises when it reaches the shard."""
    paths = write_shards([(f"s{i}", {"txt": b"x"}) for i in range(6)], str(tmp_path), max_count=2)
    os.unlink(paths[1])
    name = os.path.basename(paths[1])
    src = ShardSource(paths, on_error="skip")
    assert src.keys() == ["s0", "s1", "s4", "s5"] and src.skipped == {"unreadable": 1}
    assert src.problems[0][:3] == ("unreadable", name, f"{paths[1]}:0")
    stream = ShardSource(paths, on_error="skip")
    assert [s.key for s in stream.iter_samples()] == ["s0", "s1", "s4", "s5"]
    assert stream.skipped == {"unreadable": 1}
    strict = ShardSource(paths)
    assert strict.keys() == ["s0", "s1", name, "s4", "s5"]
    assert [strict.damaged(i) for i in range(5)] == [False, False, True, False, False]
    with pytest.raises(SourceError, match="unreadable") as e:
        strict.read(2)
    assert (e.value.key, e.value.origin) == (name, f"{paths[1]}:0")
    with pytest.raises(SourceError, match="unreadable") as e:
        list(strict.iter_samples())
    assert e.value.origin == paths[1]


def test_a_shard_gone_after_it_was_indexed_is_reported_per_sample(tmp_path):
    """Random access after the index was built: each sample of a shard that went since is an
    "unreadable" bad sample (skipped and counted, or raised), not a bare FileNotFoundError."""
    paths = write_shards([(f"s{i}", {"txt": b"x"}) for i in range(6)], str(tmp_path), max_count=2)
    src, strict = ShardSource(paths, on_error="skip"), ShardSource(paths)
    assert len(src) == len(strict) == 6  # indexed while the shard was there
    os.unlink(paths[1])
    assert [src.read(i).members for i in range(6)] == [{"txt": b"x"}] * 2 + [{}] * 2 + [
        {"txt": b"x"}] * 2
    assert src.skipped == {"unreadable": 2}
    assert [p[:3] for p in src.problems] == [("unreadable", f"s{i}", f"{paths[1]}:{off}")
                                             for i, off in ((2, 0), (3, 1024))]
    with pytest.raises(SourceError, match="No such file") as e:
        strict.read(3)
    assert (e.value.reason, e.value.key) == ("unreadable", "s3")
    os.mkfifo(paths[1])  # a FIFO in its place: never waited on
    assert src.read(2).members == {} and src.skipped == {"unreadable": 3}
    assert "not a regular file" in src.problems[-1].message


def test_missing_member_and_zero_byte_member(tmp_path):
    samples = [
        ("a", {"jpg": b"", "txt": b"zero-byte jpg"}),
        ("b", {"jpg": b"j"}),
        ("c", {"jpg": b"j", "txt": b"t"}),
    ]
    write_shards(samples, str(tmp_path))
    src = ShardSource(str(tmp_path), required=("jpg", "txt"), on_error="skip")
    assert [(s.key, s.members) for s in src.iter_samples()] == [samples[0], samples[2]]
    assert src.skipped == {"missing_member": 1} and src.problems[0].key == "b"
    assert src.keys() == ["a", "c"] and src.read(0).members["jpg"] == b""
    with pytest.raises(SourceError, match="missing_member"):
        list(ShardSource(str(tmp_path), required=("txt",)).iter_samples())


def _hostile_tar(path, evil_target):
    """A tar with one good sample between members that must never be trusted."""

    def add(tar, name, kind=tarfile.REGTYPE, data=b"", **kw):
        info = tarfile.TarInfo(name)
        info.type, info.size = kind, len(data) if kind == tarfile.REGTYPE else 0
        for k, v in kw.items():
            setattr(info, k, v)
        tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        add(tar, "../evil.txt", data=b"dotdot")
        add(tar, evil_target + ".txt", data=b"absolute")
        add(tar, "good.jpg", data=b"good jpeg")
        add(tar, "good.txt", data=b"good caption")
        add(tar, "sym.jpg", tarfile.SYMTYPE, linkname="/etc/passwd")
        add(tar, "hard.jpg", tarfile.LNKTYPE, linkname="/etc/passwd")
        add(tar, "dev.jpg", tarfile.CHRTYPE, devmajor=1, devminor=3)
        add(tar, "fifo.jpg", tarfile.FIFOTYPE)
        add(tar, "lnkdir", tarfile.SYMTYPE, linkname="/tmp")
        add(tar, "lnkdir/escape.txt", data=b"through a link")
        add(tar, "later.txt", data=b"after the bad ones")


def test_hostile_members_are_counted_not_followed(tmp_path):
    path = str(tmp_path / "hostile.tar")
    _hostile_tar(path, str(tmp_path / "abs_evil"))
    src = ShardSource(path, on_error="skip")
    got = [(s.key, s.members) for s in src.iter_samples()]
    assert got == [
        ("good", {"jpg": b"good jpeg", "txt": b"good caption"}),
        ("lnkdir/escape", {"txt": b"through a link"}),
        ("later", {"txt": b"after the bad ones"}),
    ]
    assert src.skipped == {"unsafe_name": 2, "not_a_file": 5}
    assert [(s.key, s.members) for s in (src.read(i) for i in range(len(src)))] == got
    with pytest.raises(SourceError, match="unsafe_name"):
        ShardSource(path).read(0)


def test_garbage_headers_do_not_crash_or_hang(tmp_path):
    good = tarfile.TarInfo("a.txt")
    good.size = 3
    header = bytearray(good.tobuf(tarfile.USTAR_FORMAT))
    huge = bytearray(header)
    huge[0:5] = b"b.txt"
    huge[124:136] = b"\x80" + (1 << 60).to_bytes(11, "big")  # base-256 size: an exabyte
    huge[148:156] = b" " * 8
    huge[148:156] = b"%06o\0 " % (sum(huge))
    (tmp_path / "huge.tar").write_bytes(
        bytes(header) + b"abc".ljust(512, b"\0") + bytes(huge) + bytes(1024)
    )
    src = ShardSource(str(tmp_path / "huge.tar"), on_error="skip")
    assert [s.key for s in src.iter_samples()] == ["a"] and src.skipped == {"truncated": 1}

    bad = bytearray(header)
    bad[0] = ord("z")  # checksum no longer matches
    (tmp_path / "bad.tar").write_bytes(
        bytes(header) + b"abc".ljust(512, b"\0") + bytes(bad) + bytes(1024)
    )
    src = ShardSource(str(tmp_path / "bad.tar"), on_error="skip")
    assert src.keys() == [] and src.skipped == {
        "bad_header": 1
    }  # it damages the sample it interrupts

    big = [("s", {"bin": b"x" * 5000}), ("t", {"bin": b"y"})]
    write_shards(big, str(tmp_path / "big"))
    src = ShardSource(str(tmp_path / "big"), max_member_bytes=1000, on_error="skip")
    assert [s.key for s in src.iter_samples()] == ["t"] and src.skipped == {"too_large": 1}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pax", [{"size": "-1536"}, {"size": "12x"}, {"size": "\u00b2"}, "0 x=1\n",
                                 "99 path=a.txt\n"])
def test_bad_pax_headers_are_damage_not_a_hang(tmp_path, pax):
    """Found by fuzz/fuzz.py tar: a negative pax size walked the reader backwards forever, a
    record of length 0 never advanced."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        first = tarfile.TarInfo("a.txt")
        first.size = 3
        tar.addfile(first, io.BytesIO(b"abc"))
        info = tarfile.TarInfo("b.txt")
        info.size = 3
        info.pax_headers = pax if isinstance(pax, dict) else {"comment": "x"}
        tar.addfile(info, io.BytesIO(b"def"))
    raw = buf.getvalue()
    if isinstance(pax, str):  # a raw record tarfile would not write: patch it into the header
        at = raw.index(b"comment=x\n") - 3
        record = pax.encode().ljust(len(b"18 comment=x\n"), b"\n")
        raw = raw[:at] + record + raw[at + len(record):]
    path = tmp_path / "s.tar"
    path.write_bytes(raw)
    src = ShardSource(str(path), on_error="skip")
    # the garbled header damages the sample it interrupts (it may have had more members)
    assert src.keys() == [] and src.skipped == {"bad_header": 1}
    assert list(src.iter_samples()) == []


@pytest.mark.parametrize("cache", [b"1", b"[]", b"{}", b'{"stamp": 0, "entries": 0}', "past end",
                                   "deep", "too large", "hostile key"])
def test_a_damaged_index_cache_is_rebuilt(tmp_path, cache):
    """Found by fuzz/fuzz.py index: any bytes in the cache beside a shard either are a valid
    index of it or are ignored; a cache with the right stamp but impossible entries too, one
    nested too deep to parse, one larger than any index of the shard, and one that calls a
    sample with a name no scan would allow sound."""
    write_shards(_samples(5), str(tmp_path), max_count=10)
    truth = ShardSource(str(tmp_path), index_cache="beside")
    want = [(k, truth.read(i).members) for i, k in enumerate(truth.keys())]
    (name,) = [n for n in os.listdir(tmp_path) if n.endswith(".fastmm-idx.json")]
    saved = json.loads((tmp_path / name).read_text())
    shard_size = os.path.getsize(tmp_path / "shard-000000.tar")
    if cache == "past end":  # the right stamp, an entry pointing past the end of the shard
        saved["entries"][0][2][0][1] = 10**9
    elif cache == "too large":  # valid, one sample short: read, it would lose that sample
        saved["entries"].pop()
    elif cache == "hostile key":
        saved["entries"][0][0] = "../../etc/passwd"
    if cache == "deep":
        cache = b"[" * 100_000 + b"]" * 100_000
    elif cache == "too large":
        cache = json.dumps(saved).encode() + b" " * (shard_size + (1 << 20))
    elif isinstance(cache, str):
        cache = json.dumps(saved).encode()
    (tmp_path / name).write_bytes(cache)
    src = ShardSource(str(tmp_path), index_cache="beside", on_error="raise")
    assert [(k, src.read(i).members) for i, k in enumerate(src.keys())] == want


def test_open_source_registry(tmp_path):
    write_shards(_samples(4), str(tmp_path))
    assert isinstance(open_source("shards", str(tmp_path)), ShardSource)
    assert open_source("shards", str(tmp_path)).read(1) == Sample(
        *_samples(4)[1],
        f"{tmp_path}/shard-000000.tar:{ShardSource(str(tmp_path)).read(1).origin.rsplit(':', 1)[1]}",
    )


def test_sources_import_nothing_they_must_not():
    """Dependency rule: sources deal in bytes (no torch, decode, slabs, collate) and never unpickle."""
    root = pathlib.Path(__file__).resolve().parents[1] / "src" / "fastmm" / "sources"
    banned = (
        "torch",
        "fastmm.decode",
        "fastmm.slabs",
        "fastmm.collate",
        "pickle",
        "..decode",
        "..slabs",
        "..collate",
    )
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["." * node.level + (node.module or "")]
            for name in names:
                assert not any(
                    name == b or name.startswith(b + ".") for b in banned
                ), f"{path.name} imports {name}"


def _webdataset_pipeline(urls, batched: bool):
    pipe = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=None,
                           workersplitter=wds.split_by_worker)
            .decode("torchrgb").to_tuple("png", "cls")
            .map_tuple(lambda image: image[:, :8, :8], int))
    return pipe.batched(4) if batched else pipe


@pytest.mark.parametrize("batched", [False, True])
def test_a_webdataset_pipeline_gives_torchs_batches(tmp_path, transport, batched):
    """A webdataset pipeline (an IterableDataset splitting shards by worker through torch's
    get_worker_info) in fastmm's loader: the batches torch's loader gives."""
    from PIL import Image

    with wds.ShardWriter(str(tmp_path / "s-%06d.tar"), maxcount=10, verbose=0) as sink:
        for i in range(45):  # 5 shards for 2 workers; images of 3 sizes, cropped alike
            png = io.BytesIO()
            Image.fromarray(np.full((8 + i % 3, 9, 3), i, np.uint8)).save(png, "PNG")
            sink.write({"__key__": f"k{i:04d}", "png": png.getvalue(), "cls": str(i).encode()})
    urls = sorted(str(p) for p in tmp_path.glob("s-*.tar"))
    batches = {}
    for cls in (torch.utils.data.DataLoader, fastmm.DataLoader):
        loader = cls(_webdataset_pipeline(urls, batched), num_workers=2,
                     batch_size=None if batched else 4)
        batches[cls] = [(images.clone(), labels.tolist())
                        for images, labels in loader]
    ours, torchs = batches[fastmm.DataLoader], batches[torch.utils.data.DataLoader]
    assert len(ours) == len(torchs) > 10
    for (a, la), (b, lb) in zip(ours, torchs):
        assert torch.equal(a, b) and la == lb
    assert sorted(i for _, labels in ours for i in labels) == list(range(45))
