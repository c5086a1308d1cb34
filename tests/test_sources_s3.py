"""s3:// roots against a real S3-protocol server on 127.0.0.1 (moto's server, its own process)
behind a proxy that injects latency, bandwidth caps and faults: tar shards read in place (index,
ranged reads, streams), manifests and trees of objects, staging to a local directory; faults
retried, resumed, counted or raised as the policy says, with nothing lost or duplicated."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import os
import tarfile
import time

import pytest
import torch

import fastmm
from fastmm.bench.mmcorpus import CorpusSpec, write_corpus
from fastmm.bench.s3server import Fault, LocalS3
from fastmm.sources import (
    FileSource, ShardSource, SourceError, StagedSource, write_file_manifest, write_shards,
)
from fastmm.sources.s3 import ObjectStoreError, S3Store

BUCKET = "corpus"


def _samples(n=30):
    return [(f"s{i:04d}", {"bin": hashlib.sha256(str(i).encode()).digest() * (50 + 40 * i),
                           "txt": f"caption {i}".encode()}) for i in range(n)]


@pytest.fixture(scope="module")
def store_server(tmp_path_factory):
    """One server for the module: shards, a tree and a manifest uploaded once."""
    root = tmp_path_factory.mktemp("s3")
    write_shards(_samples(), str(root / "shards"), max_count=7)
    tree = root / "tree"
    for key, members in _samples(9):
        for ext, data in members.items():
            (tree / key[:2]).mkdir(parents=True, exist_ok=True)
            (tree / key[:2] / f"{key}.{ext}").write_bytes(data)
    with open(root / "manifest.jsonl", "w") as f:
        for key, members in _samples(9):
            f.write(json.dumps({"key": key, "members": {e: f"tree/{key[:2]}/{key}.{e}"
                                                       for e in members}}) + "\n")
    with LocalS3() as s3:
        s3.upload_dir(str(root / "shards"), BUCKET, "shards/")
        s3.upload_dir(str(tree), BUCKET, "tree/")
        s3.client().upload_file(str(root / "manifest.jsonl"), BUCKET, "manifest.jsonl")
        s3.local = root
        yield s3


@pytest.fixture
def s3(store_server, monkeypatch):
    """The server, its faults and settings reset, and this process's (and its workers')
    environment pointing at it."""
    store_server.faults.clear()
    store_server.latency_s, store_server.bytes_per_s = 0.0, None
    store_server.allowed_key = "fastmm-test-key"
    for k, v in store_server.env.items():
        monkeypatch.setenv(k, v)
    yield store_server
    store_server.faults.clear()


def _gets(s3) -> int:
    return s3.requests.get("GET", 0)


def test_shards_in_place_read_as_the_local_copy(s3):
    local = ShardSource(str(s3.local / "shards"), progress=None)
    remote = ShardSource(f"s3://{BUCKET}/shards", progress=None)
    assert [os.path.basename(p) for p in remote.shards] == \
        [os.path.basename(p) for p in local.shards]
    assert remote.keys() == local.keys() == [k for k, _ in _samples()]
    for i in (0, 13, 29, 5):
        assert remote.read(i).members == local.read(i).members
    for worker in range(2):
        got = [(s.key, s.members) for s in remote.iter_samples(0, 1, worker, 2)]
        want = [(s.key, s.members) for s in local.iter_samples(0, 1, worker, 2)]
        assert got == want and got


def test_a_stream_through_a_shard_is_one_get_and_random_reads_one_each(s3):
    src = ShardSource(f"s3://{BUCKET}/shards/", progress=None)
    src.keys()  # index: each shard streamed once
    before = _gets(s3)
    in_first_shard = [i for i in range(len(src)) if src.shard_of(i) == 0]
    for i in in_first_shard:  # in file order, as ShardStream reads a shard
        src.read(i)
    assert _gets(s3) - before == 2  # the first sample's span, then one GET to the end
    before = _gets(s3)
    for i in (20, 3, 27, 11):
        src.read(i)
    assert _gets(s3) - before == 4


def test_a_published_index_opens_without_a_scan_and_headers_catch_a_changed_shard(s3, tmp_path):
    d = tmp_path / "pub"
    write_shards(_samples(12), str(d), max_count=4)
    local = ShardSource(str(d), index_cache="beside", progress=None)
    assert local.keys() and len(list(d.glob(".*.fastmm-idx.json"))) == 3  # published beside
    s3.upload_dir(str(d), BUCKET, "indexed/")
    before = _gets(s3)
    src = ShardSource(f"s3://{BUCKET}/indexed/", index_cache="beside", progress=None)
    assert src.keys() == local.keys()
    assert _gets(s3) - before == 2 + 3  # the listing (check, list), a small GET per shard
    assert [src.read(i).members for i in range(12)] == [m for _, m in _samples(12)]
    # the same size, another layout: sample 5's header no longer where the index says
    data = bytearray((d / "shard-000001.tar").read_bytes())
    at = src._index()[5][3][0][1] - 512
    data[at + 124:at + 136] = b"00000000001\0"  # its size field, checksum now wrong
    s3.client().put_object(Bucket=BUCKET, Key="indexed/shard-000001.tar", Body=bytes(data))
    stale = ShardSource(f"s3://{BUCKET}/indexed/", index_cache="beside", progress=None,
                        on_error="skip")
    assert stale.read(5).members == {} and stale.skipped == {"stale_index": 1}
    assert stale.read(4).members == _samples(12)[4][1]


@pytest.mark.slow  # (about 4 s: timed reads through a slowed store)
@pytest.mark.parametrize("root", ["shards/", "manifest.jsonl"])
def test_a_batch_from_the_store_is_fetched_at_once_and_each_sample_as_alone(s3, root):
    """MultimodalDataset.__getitems__ (torch's batched fetch) starts the batch's GETs together,
    over shards and over a manifest of objects; the items are those read one by one, and a
    missing object in the batch is counted under skip while the rest come."""
    from PIL import Image

    local = s3.local / "img"
    local.mkdir(exist_ok=True)
    lines = []
    for i in range(6):
        Image.new("RGB", (20 + i, 16), (40 * i, 0, 0)).save(local / f"k{i}.png")
        lines.append({"key": f"k{i}", "members": {"png": f"img/k{i}.png"}})
    lines.append({"key": "gone", "members": {"png": "img/none.png"}})
    s3.upload_dir(str(local), BUCKET, "img/")
    write_shards([(f"k{i}", {"png": (local / f"k{i}.png").read_bytes()}) for i in range(6)],
                 str(s3.local / "imgshards"), max_count=2)
    s3.upload_dir(str(s3.local / "imgshards"), BUCKET, "imgshards/")
    s3.client().put_object(Bucket=BUCKET, Key="imgs.jsonl",
                           Body="".join(json.dumps(x) + "\n" for x in lines).encode())
    url = f"s3://{BUCKET}/" + ("imgshards/" if root == "shards/" else "imgs.jsonl")
    kind = "shards" if root == "shards/" else "posix"

    def dataset():
        return fastmm.MultimodalDataset(url, source=kind, size=8, crop="center",
                                        on_error="skip")

    alone = [dataset()[i] for i in range(6)]
    s3.latency_s, s3.most_in_flight = 0.2, 0
    ds = dataset()
    len(ds)
    batch = ds.__getitems__([5, 0, 3, 1] + ([6] if kind == "posix" else []))
    assert s3.most_in_flight >= 4  # a batch's GETs together, not one after another
    assert [b["key"] for b in batch] == ["k5", "k0", "k3", "k1"]
    for b in batch:
        want = alone[int(b["key"][1:])]
        assert torch.equal(b["image"], want["image"])
    if kind == "posix":
        assert ds.skipped == {"unreadable": 1}


def test_manifest_and_tree_of_objects_read_as_local(s3):
    local = FileSource(str(s3.local / "manifest.jsonl"))
    remote = FileSource(f"s3://{BUCKET}/manifest.jsonl")
    tree = FileSource(f"s3://{BUCKET}/tree/")
    assert remote.keys() == local.keys() == [k for k, _ in _samples(9)]
    assert sorted(tree.keys()) == [f"s0/{k}" for k, _ in _samples(9)]
    for i in range(9):
        assert remote.read(i).members == local.read(i).members == tree.read(i).members


def test_staging_copies_each_object_once_and_reads_the_copy(s3, tmp_path):
    first = StagedSource(f"s3://{BUCKET}/shards", str(tmp_path), inner="shards", progress=None)
    assert first.staging_cost["files"] == 5
    assert first.staging_cost["bytes"] == sum(
        os.path.getsize(p) for p in (s3.local / "shards").glob("*.tar"))
    again = StagedSource(f"s3://{BUCKET}/shards", str(tmp_path), inner="shards", progress=None)
    assert again.staging_cost["files"] == 0
    assert [again.read(i).members for i in range(30)] == [m for _, m in _samples()]


def test_staging_checks_a_published_manifest(s3, tmp_path):
    d = tmp_path / "pub"
    write_shards(_samples(6), str(d), max_count=3)
    write_file_manifest(str(d))
    s3.upload_dir(str(d), BUCKET, "published/")
    staged = StagedSource(f"s3://{BUCKET}/published", str(tmp_path / "stage"), inner="shards",
                          progress=None)
    assert [staged.read(i).members for i in range(6)] == [m for _, m in _samples(6)]
    assert all(f.sha256 for f in staged.files)


@pytest.mark.slow  # (about 3.5 s: real backoff waits)
def test_throttling_and_5xx_are_retried_with_backoff(s3):
    src = ShardSource(f"s3://{BUCKET}/shards", progress=None)
    src.keys()
    s3.faults += [Fault(path="shard-000002", times=2, status=503, code="SlowDown"),
                  Fault(path="shard-000003", times=1, status=500, code="InternalError")]
    assert src.read(15).members == _samples()[15][1]
    assert src.read(22).members == _samples()[22][1]
    assert [f.hits for f in s3.faults] == [2, 1]


@pytest.mark.parametrize("fault", [Fault(path="shard-000001", drop_after=3000, times=2),
                                   Fault(path="shard-000001", stall_s=3.0)],
                         ids=["dropped", "stalled"])
def test_a_connection_lost_mid_object_resumes_with_nothing_lost_or_repeated(s3, fault):
    src = ShardSource(f"s3://{BUCKET}/shards", progress=None, store=S3Store(timeout_s=1.0))
    s3.faults.append(fault)
    got = [s.key for w in range(2) for s in src.iter_samples(0, 1, w, 2)]
    assert sorted(got) == [k for k, _ in _samples()] and fault.hits == fault.times


@pytest.mark.slow
def test_retries_run_out_into_the_error_policy_naming_the_object(s3):
    s3.faults.append(Fault(path="shard-000004", times=100, status=503))
    src = ShardSource(f"s3://{BUCKET}/shards", progress=None, on_error="skip",
                      store=S3Store(attempts=2))
    assert len(src) == 28  # shard 4's samples unknown: its one stand-in entry counted
    assert src.skipped == {"unreadable": 1}
    assert "shard-000004" in src.problems[0].origin
    t0 = time.monotonic()
    strict = ShardSource(f"s3://{BUCKET}/shards", progress=None, store=S3Store(attempts=2))
    assert strict.keys()[28:] == ["shard-000004.tar"]  # the stand-in raises when read
    with pytest.raises(SourceError, match="shard-000004"):
        strict.read(28)
    with pytest.raises(SourceError, match="shard-000004"):
        list(strict.iter_samples())
    assert time.monotonic() - t0 < 30


def test_a_missing_object_is_counted_with_its_key(s3, tmp_path):
    lines = [{"key": "here", "members": {"txt": "tree/s0/s0001.txt"}},
             {"key": "gone", "members": {"txt": "tree/s0/nothing.txt"}}]
    body = "".join(json.dumps(x) + "\n" for x in lines).encode()
    s3.client().put_object(Bucket=BUCKET, Key="holes.jsonl", Body=body)
    skip = FileSource(f"s3://{BUCKET}/holes.jsonl", on_error="skip")
    assert skip.read(0).members == {"txt": b"caption 1"}
    assert skip.read(1).members == {}
    assert skip.skipped == {"unreadable": 1} and skip.problems[0].key == "gone"
    with pytest.raises(SourceError, match="nothing.txt"):
        FileSource(f"s3://{BUCKET}/holes.jsonl").read(1)


def test_a_damaged_shard_object_is_counted_and_the_rest_read(s3, tmp_path):
    d = tmp_path / "cut"
    [path] = write_shards(_samples(5), str(d))
    data = open(path, "rb").read()
    s3.client().put_object(Bucket=BUCKET, Key="cut/shard-000000.tar", Body=data[:len(data) // 2])
    src = ShardSource(f"s3://{BUCKET}/cut/", progress=None, on_error="skip")
    streamed = [s.key for s in src.iter_samples()]
    assert streamed and streamed == src.keys()[: len(streamed)]
    assert src.skipped.get("truncated") >= 1


def test_an_object_changed_while_read_is_not_mixed(s3, tmp_path):
    s3.client().put_object(Bucket=BUCKET, Key="moving/a.tar", Body=b"x" * 4096)
    info = S3Store().head(f"s3://{BUCKET}/moving/a.tar")
    s3.client().put_object(Bucket=BUCKET, Key="moving/a.tar", Body=b"y" * 4096)
    with pytest.raises(OSError, match="changed"):
        S3Store().read(info.url, 0, 100, info.etag)


@pytest.mark.parametrize("kind", ["shards", "posix", "staged"])
def test_wrong_credentials_or_no_bucket_fail_at_start(s3, tmp_path, kind):
    def open_(root):
        if kind == "staged":
            return StagedSource(root, str(tmp_path), progress=None)
        return (ShardSource if kind == "shards" else FileSource)(root)

    with pytest.raises(ObjectStoreError, match="no such bucket"):
        open_("s3://no-such-bucket/shards/")
    s3.allowed_key = "another-key"
    with pytest.raises(ObjectStoreError, match="access key"):
        open_(f"s3://{BUCKET}/shards/")


def test_an_unreachable_endpoint_fails_at_start_within_its_bound(monkeypatch):
    from fastmm.bench.nodes import free_port

    for k, v in LocalS3()._env(free_port()).items():  # nothing listens there
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    with pytest.raises(ObjectStoreError, match="cannot be reached"):
        ShardSource("s3://corpus/shards/", store=S3Store(attempts=2, timeout_s=1.0))
    assert time.monotonic() - t0 < 20


def test_a_prefix_with_nothing_under_it_is_a_typo(s3):
    with pytest.raises(FileNotFoundError):
        ShardSource(f"s3://{BUCKET}/shardz/")
    with pytest.raises(FileNotFoundError):
        FileSource(f"s3://{BUCKET}/manifest-typo.jsonl")


@pytest.mark.slow
def test_loader_and_shard_stream_over_a_slow_faulty_store(s3, tmp_path):
    """fastmm.DataLoader with 2 workers over image shards in a store 5 ms away at 20 MB/s,
    throttled once and dropped once: each sample once; ShardStream on two ranks: the same
    number of batches on each, every sample between them."""
    write_corpus(CorpusSpec(num_images=24, num_videos=0, seed=5, png_fraction=0.0,
                            image_short_side=(40, 60), large_fraction=0.0, shard_bytes=9_000),
                 str(tmp_path))
    s3.upload_dir(str(tmp_path / "shards"), BUCKET, "images/")
    s3.latency_s, s3.bytes_per_s = 0.005, 20e6
    s3.faults += [Fault(path="images/shard-000000", times=1, status=503),
                  Fault(path="images/shard-000003", times=1, drop_after=5000)]

    def dataset():
        return fastmm.MultimodalDataset(f"s3://{BUCKET}/images", source="shards",
                                        decoder="pil", size=16, crop="center",
                                        modality="image")

    loader = fastmm.DataLoader(dataset(), batch_size=4, num_workers=2)
    got = collections.Counter(k for batch in loader for k in batch["key"])
    assert len(got) == 24 and set(got.values()) == {1}
    per_rank = []
    for rank in range(2):
        stream = fastmm.ShardStream(dataset(), rank=rank, world_size=2, seed=3)
        per_rank.append([b["key"] for b in fastmm.DataLoader(stream, batch_size=2,
                                                             num_workers=2)])
    assert len(per_rank[0]) == len(per_rank[1])
    assert {k for r in per_rank for b in r for k in b} == set(got)
    assert all(f.hits == 1 for f in s3.faults)


@pytest.mark.slow
def test_the_client_comparison_measures_and_checks_bytes(tmp_path):
    """python -m fastmm.bench.s3_clients on boto3 (the pick): every GET's bytes checked, the
    figures recorded, and the client working in a forked child both ways."""
    from fastmm.bench import s3_clients

    assert s3_clients.main(["--quick", "--reps", "2", "--clients", "boto3",
                            "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "s3_clients.json").read_text())
    r = result["results"]["boto3"]
    assert r["ranged_ms"]["n"] == 2 and 0 < r["ranged_cpu_ms"]["median"] <= r["ranged_ms"]["max"] * 2
    assert r["stream_mb_per_s"]["median"] > 0
    assert result["after_fork"]["boto3"] == {"inherited": "ok", "made in the child": "ok"}
    assert "| boto3 " in (tmp_path / "s3_clients.md").read_text()


def test_retry_and_wait_settings_come_from_arguments_then_the_environment(monkeypatch):
    monkeypatch.setenv("FASTMM_S3_ATTEMPTS", "3")
    monkeypatch.setenv("FASTMM_S3_TIMEOUT_S", "2.5")
    assert (S3Store().attempts, S3Store().timeout_s) == (3, 2.5)
    assert (S3Store(attempts=7).attempts, S3Store(timeout_s=9).timeout_s) == (7, 9)
    monkeypatch.setenv("FASTMM_S3_ATTEMPTS", "0")
    with pytest.raises(fastmm.ConfigError, match="FASTMM_S3_ATTEMPTS='0' must be at least 1"):
        S3Store()
    monkeypatch.setenv("FASTMM_S3_ATTEMPTS", "2")
    monkeypatch.setenv("FASTMM_S3_TIMEOUT_S", "soon")
    with pytest.raises(fastmm.ConfigError, match="FASTMM_S3_TIMEOUT_S='soon'"):
        S3Store()
    with pytest.raises(ValueError, match="attempts=0"):
        S3Store(attempts=0)


# -- hostile object keys: nothing written or deleted outside the staging directory, no other
# bucket read, each key named in an error or a count -------------------------------------------


def _hostile_prefix(s3, tmp_path) -> tuple[str, list[str], object]:
    """A prefix of the test's own with one good sample and keys an attacker could write:
    absolute after the prefix (a victim directory with a file in it, as a file and as a .tar to
    extract), ``..``, ``.``, an empty part, a backslash, and one that joined onto the base
    names another bucket."""
    victim = tmp_path / "victim"
    victim.mkdir(exist_ok=True)
    (victim / "keep.txt").write_bytes(b"mine")
    c = s3.client()
    with contextlib.suppress(c.exceptions.BucketAlreadyOwnedByYou):
        c.create_bucket(Bucket="other")
    c.put_object(Bucket="other", Key="secret.jpg", Body=b"SECRET")
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as t:
        info = tarfile.TarInfo("pwned.jpg")
        info.size = 5
        t.addfile(info, io.BytesIO(b"pwned"))
    hostile = {
        f"/{victim}/x.jpg": b"outside",  # absolute once the prefix is cut
        f"/{victim}.tar": tar.getvalue(),  # a directory that exists, + ".tar"
        "../up.jpg": b"up",
        "./dot.jpg": b"dot",
        "a//b.jpg": b"empty part",
        "b\\c.jpg": b"backslash",
        "/abc/other/secret.jpg": b"another bucket",  # s3://bkt/corpus + this -> s3://other/...
    }
    prefix = tmp_path.name
    c.put_object(Bucket=BUCKET, Key=f"{prefix}/good.jpg", Body=b"good")
    for rel, body in hostile.items():
        c.put_object(Bucket=BUCKET, Key=f"{prefix}/{rel}", Body=body)
    return f"s3://{BUCKET}/{prefix}", sorted(hostile), victim


def _outside_untouched(tmp_path, victim, stage):
    """Only the victim's own file outside the staging directory; the victim keeps it."""
    assert sorted(os.listdir(victim)) == ["keep.txt"]
    assert (victim / "keep.txt").read_bytes() == b"mine"
    outside = [os.path.join(w, n) for w, _, names in os.walk(tmp_path) for n in names
               if not os.path.join(w, n).startswith(str(stage) + os.sep)]
    assert outside == [str(victim / "keep.txt")]


@pytest.mark.parametrize("extract", [False, True])
def test_hostile_keys_are_never_staged_and_each_is_counted(s3, tmp_path, extract):
    url, hostile, victim = _hostile_prefix(s3, tmp_path)
    stage = tmp_path / "stage"
    src = StagedSource(url, str(stage), extract=extract,
                       on_error="skip", progress=None)
    assert [f.path for f in src.files] == ["good.jpg"]
    assert src.skipped == {"unsafe_name": len(hostile)}
    assert sorted(p.key for p in src.problems) == hostile
    assert src.keys() == ["good"] and src.read(0).members == {"jpg": b"good"}
    _outside_untouched(tmp_path, victim, stage)


def test_a_hostile_key_raises_naming_it_when_the_policy_raises(s3, tmp_path):
    url, hostile, victim = _hostile_prefix(s3, tmp_path)
    with pytest.raises(SourceError) as e:
        StagedSource(url, str(tmp_path / "stage"), extract=True,
                     progress=None)
    assert e.value.reason == "unsafe_name" and e.value.key == hostile[0]
    _outside_untouched(tmp_path, victim, tmp_path / "stage")


def test_hostile_keys_reach_a_dataset_that_skips_as_counted_bad_samples(s3, tmp_path):
    from PIL import Image

    url, hostile, victim = _hostile_prefix(s3, tmp_path)
    photo = io.BytesIO()
    Image.new("RGB", (12, 10), (200, 10, 10)).save(photo, "JPEG")
    s3.client().put_object(Bucket=BUCKET, Key=f"{tmp_path.name}/good.jpg", Body=photo.getvalue())
    stage = tmp_path / "stage"
    ds = fastmm.MultimodalDataset(url, source="staged",
                                  stage_dir=str(stage), on_error="skip", progress=None,
                                  size=8, crop="center")
    assert sorted(ds.source.keys()) == sorted(["good"] + hostile)
    assert [b["key"] for b in ds.__getitems__(list(range(len(ds))))] == ["good"]
    assert ds.skipped == {"unsafe_name": len(hostile)}
    _outside_untouched(tmp_path, victim, stage)


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_hostile_keys_read_in_place_never_reach_a_path_or_another_bucket(s3, tmp_path, on_error):
    url, hostile, victim = _hostile_prefix(s3, tmp_path)
    other = Fault(path="/other/", times=1000, status=403, code="AccessDenied")
    s3.faults.append(other)
    src = FileSource(url, on_error=on_error)
    if on_error == "skip":
        assert src.keys() == ["good"] and src.read(0).members == {"jpg": b"good"}
        assert src.skipped == {"unsafe_name": len(hostile)}
        assert sorted(p.key for p in src.problems) == hostile
    else:  # listed as damaged samples, each raising with its key when read
        bad = [i for i in range(len(src)) if src.damaged(i)]
        assert sorted(src.keys()[i] for i in bad) == hostile
        for i in bad:
            with pytest.raises(SourceError, match="unsafe_name") as e:
                src.read(i)
            assert e.value.key == src.keys()[i]
    assert other.hits == 0  # the other bucket was never asked for anything
    _outside_untouched(tmp_path, victim, tmp_path / "none")


@pytest.mark.parametrize("published", ["deep", "too large"])
def test_a_published_index_too_deep_or_too_large_is_ignored_and_the_shard_scanned(s3, tmp_path,
                                                                                 published):
    d = tmp_path / "pub"
    write_shards(_samples(6), str(d), max_count=6)
    (cache,) = d.glob(".*.fastmm-idx.json") if ShardSource(
        str(d), index_cache="beside", progress=None).keys() else ()
    saved = json.loads(cache.read_text())
    saved["entries"].pop()  # were it read, the last sample would be lost
    cache.write_bytes(b"[" * 100_000 + b"]" * 100_000 if published == "deep" else
                      json.dumps(saved).encode() + b" " * (2 << 20))
    s3.upload_dir(str(d), BUCKET, f"{tmp_path.name}/")
    src = ShardSource(f"s3://{BUCKET}/{tmp_path.name}/", index_cache="beside", progress=None)
    assert [src.read(i).members for i in range(len(src))] == [m for _, m in _samples(6)]
