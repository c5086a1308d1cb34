"""Study 3 (sharded storage under torchrun) on a tiny corpus, and its check that every layout
gives a file per sample's samples."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torchvision")


@pytest.mark.slow
def test_sharded_storage_study_under_torchrun(tmp_path):
    """Study 3, quick: every layout runs in a real 2-rank torchrun job, and in one of two node
    launches with a rank each, with equal batch counts and a file per sample's samples; each
    node stages each object once; its page shows the finding and both plots."""
    from _browser import render

    from fastmm.bench import stats, study_shards

    out = tmp_path / "out"
    assert study_shards.main(["--quick", "--out", str(out), "--cache-dir",
                              str(tmp_path / "cache"), "--work-dir", str(tmp_path)]) == 0
    result = json.loads((out / "shards.json").read_text())
    layouts = ("files", "shards-300kB", "shards-2MB", "s3", "staged")
    configs = ("world 2", "world 2, 2 nodes")
    assert list(result["results"]) == [f"{name} / {c}" for c in configs for name in layouts]
    for name, r in result["results"].items():
        assert r["equal_batches"], name
        assert r["same_samples"] == {"samples": 48, "each_once": True, "differing_keys": [],
                                     "differing_count": 0, "ok": True}, name
        assert r["reps"] == 2 and r["per_rank_samples_per_s"]["n"] == 2
        assert r["batches_per_epoch"] == 3  # 48 images over 2 ranks, batches of 8
        assert r["per_rank_samples_per_s"]["median"] > 0
        assert 0 < r["slowest_over_fastest"]["median"] <= 1
        assert r["vs_files"]["n"] == 2  # paired with files round by round
    files = result["results"]["files / world 2"]["vs_files"]
    assert files["min"] == files["max"] == 1.0
    for c in configs:
        staged = result["results"][f"staged / {c}"]
        assert staged["staging_s"]["median"] >= 0 and staged["staged_once_per_node"]
        assert result["process_ready_s"][c] > 0  # one job per configuration: started once
    table = (out / "shards.md").read_text()
    assert "vs files" in table and "1.00x [1.00-1.00] (range of 2)" in table
    assert table.count("| yes (48, each once) |") == 10 and "blake2b" in table
    assert " s at world 2, " in table and " s at world 2, 2 nodes from process start" in table
    assert "[95% CI]" not in table
    # the call: stats.decision's on the first shard layout at the largest world size; with
    # 2 repetitions there is no 95% CI, so it cannot be more than "undecided"
    finding, top = result["finding"], result["results"]["shards-300kB / world 2"]
    assert (finding["call"], finding["label"]) == (
        "undecided", "shards-300kB / world 2: " + stats.decision(top["vs_files"], ok=True)[1])
    assert stats.interval(top["vs_files"], 2, "x") in finding["label"]
    assert all(f"{k} {stats.interval(result['results'][f'{k} / {c}']['vs_files'], 2, 'x')}"
               in finding["text"] for k in layouts[1:] for c in configs)
    assert "Every layout gave a file per sample's samples in every run" in finding["text"]
    assert isinstance(result["busy"], list)
    seen = render(out / "report.html")
    assert seen["answer"][:2] == [finding["text"],
                                  f"Call: {finding['call']} ({finding['label']})."]
    assert seen["answer"][2:] == seen["alerts"] == result["busy"]
    assert list(seen["plots"]) == ["per-rank-rates", "vs-files"]
    assert all(w == 1000 and h > 150 for w, h in seen["plots"].values())
    assert seen["tables"] == [1 + 10] and seen["external"] == []


def _samples(tmp_path, n=6):
    from fastmm.bench.mmcorpus import CorpusSpec, write_corpus
    from fastmm.sources import open_source

    write_corpus(CorpusSpec(num_images=n, num_videos=0, seed=2), str(tmp_path / "c"))
    return open_source("posix", str(tmp_path / "c" / "posix" / "manifest.jsonl"))


def test_a_sample_digest_covers_its_key_and_every_member(tmp_path):
    from fastmm.bench.study_shards import sample_digest
    from fastmm.sources.base import Sample

    one = Sample("a/1", {"jpg": b"xy", "txt": b"z"}, "here")
    assert sample_digest(one) == sample_digest(Sample("a/1", {"txt": b"z", "jpg": b"xy"}, "there"))
    for other in (Sample("a/2", one.members, ""), Sample("a/1", {"jpg": b"xy", "txt": b"w"}, ""),
                  Sample("a/1", {"jpg": b"xy", "cls": b"z"}, ""), Sample("a/1", {"jpg": b"xy"}, ""),
                  Sample("a/1", {"jpg": b"x", "txt": b"yz"}, "")):
        assert sample_digest(other) != sample_digest(one), other


def test_shards_read_back_the_files_samples(tmp_path):
    """What the check compares: the same corpus as files and as tar shards reads back the
    same digests, key by key, for the keys asked; a damaged member shows."""
    from fastmm.bench.study_shards import read_back, sample_digest
    from fastmm.sources import ShardSource
    from fastmm.sources.shards import write_shards

    files = _samples(tmp_path)
    samples = [files.read(i) for i in range(len(files))]
    write_shards([(s.key, s.members) for s in samples], str(tmp_path / "s"), max_bytes=100_000)
    keys = set(files.keys()[:4])
    from_files = read_back(files, keys)
    assert from_files == {s.key: sample_digest(s) for s in samples if s.key in keys}
    assert read_back(ShardSource(str(tmp_path / "s"), progress=None), keys) == from_files
    damaged = samples[:]
    damaged[1] = type(samples[1])(samples[1].key, {**samples[1].members, "jpg": b"not it"}, "")
    write_shards([(s.key, s.members) for s in damaged], str(tmp_path / "d"))
    got = read_back(ShardSource(str(tmp_path / "d"), progress=None), keys)
    assert {k for k in keys if got[k] != from_files[k]} == {samples[1].key}


def test_same_samples_needs_each_sample_once_per_epoch_with_the_files_bytes():
    from fastmm.bench.study_shards import same_samples

    files = {"a": "1", "b": "2", "c": "3", "d": "4"}
    assert same_samples([["a", "b", "c", "d"], ["d", "c", "b", "a"]], dict(files), files, 4, 2) == {
        "each_once": True, "differing": [], "ok": True}
    # an epoch with "a" twice and "d" missing; the read-back has every key right
    assert same_samples([["a", "b", "c", "d"], ["a", "b", "c", "a"]], dict(files), files, 4, 2) == {
        "each_once": False, "differing": [], "ok": False}
    # every key delivered once, but "b" holds other bytes and "d" was never read back
    assert same_samples([["a", "b", "c", "d"]], {"a": "1", "b": "9", "c": "3"}, files, 4, 2) == {
        "each_once": True, "differing": ["b", "d"], "ok": False}
    # a layout with a sample fewer: its epochs are whole, but not the files'
    assert same_samples([["a", "b", "c"]], {"a": "1", "b": "2", "c": "3"}, files, 3, 3) == {
        "each_once": True, "differing": ["d"], "ok": False}
    # 5 samples over 4 ranks: DistributedSampler pads with 3 repeats to 8
    five = {**files, "e": "5"}
    padded = ["a", "b", "c", "d", "e", "a", "b", "c"]
    assert same_samples([padded], dict(five), five, 5, 4)["ok"]
    assert not same_samples([padded + ["d"]], dict(five), five, 5, 4)["ok"]
