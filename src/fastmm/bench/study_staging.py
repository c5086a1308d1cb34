"""Study 1, NVMe staging: read the data in place from slow storage, or stage it to local disk
first and read it there. The one factor is data locality; decode, loader, workers, batch, order
and seeds are the same in both arms.

Slow storage is a real HTTP server on 127.0.0.1 whose bandwidth (shared by all connections) and
per-request latency are capped. Staging copies the tree with fastmm's staged source (verified,
atomic) and its cost is charged; the page cache of the staged copy is dropped before the timed
epoch (posix_fadvise DONTNEED), so "staged" means read from local disk, and a second, warm epoch
is reported apart. Reported: staging cost, epoch time of each arm, and the break-even number of
epochs, staging_s / (in_place_epoch_s - staged_epoch_s). Every epoch's batches are digested:
both arms must deliver the same bytes. Each repetition runs both arms, the one first that the
last ran second (``harness.rotated``); the servers run in a process of their own (a child of
the study: the busy meter counts their CPU as the study's, not as other processes').

The object-store arm does the same for tar shards in an S3 store (moto's server on 127.0.0.1
behind a proxy adding the same latency per request and the bandwidth cap per connection, as S3
caps each connection): ``fastmm.ShardStream`` reads the shards in place (one streaming GET per
shard; opening them reads the offset index published beside each shard), against staging the
objects to local disk first and streaming the copy the same way. Break-even there counts the one-time costs of
each arm: (staging + opening the copy - opening in place) / epoch time saved. Run:
``python -m fastmm.bench.study_staging --out DIR`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import zlib
from dataclasses import dataclass
from unittest import mock

import torch
from torch.utils.data import Dataset

from . import env, harness, options, plots, stats
from .corpus import default_cache_dir
from .harness import OtherCores
from .mmcorpus import CorpusSpec
from .pipelines import SIZE, ensure_mmcorpus
from .report import busy_notes, save_study


class _Bucket:
    """A token bucket shared by every connection: bytes per second, small bursts."""

    def __init__(self, rate: float):
        self.rate, self.lock = rate, threading.Lock()
        self.next_free = time.monotonic()

    def take(self, nbytes: int) -> None:
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + nbytes / self.rate
        time.sleep(max(0.0, self.next_free - now))


class ThrottledServer:
    """Serves ``root`` on 127.0.0.1 at ``bytes_per_s`` in total, ``latency_s`` per request."""

    def __init__(self, root: str, bytes_per_s: float, latency_s: float):
        bucket = _Bucket(bytes_per_s)

        class Handler(http.server.SimpleHTTPRequestHandler):
            def copyfile(self, source, outputfile):
                time.sleep(latency_s)
                while chunk := source.read(64 * 1024):
                    bucket.take(len(chunk))
                    outputfile.write(chunk)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(Handler, directory=root))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass(frozen=True)
class Serving:
    """What a server process sends the study once it listens: its URL, and the environment a
    client needs (a store's endpoint and keys; nothing for plain HTTP)."""

    url: str
    env: dict[str, str]


@contextlib.contextmanager
def files_server(root: str, bytes_per_s: float, latency_s: float):
    """The slow storage of the HTTP arm: ``root`` served by a ThrottledServer."""
    server = ThrottledServer(root, bytes_per_s, latency_s)
    try:
        yield Serving(server.url, {})
    finally:
        server.close()


@contextlib.contextmanager
def store_server(shard_dir: str, latency_s: float, bytes_per_s: float):
    """The object store of the S3 arm: ``shard_dir`` uploaded to s3://corpus/shards/ in a
    LocalS3 (moto's server behind the throttling proxy)."""
    from .s3server import LocalS3

    with LocalS3(latency_s=latency_s, bytes_per_s=bytes_per_s) as s3:
        s3.upload_dir(shard_dir, "corpus", "shards/")
        yield Serving(s3.env["AWS_ENDPOINT_URL"], s3.env)


def _serve(conn, make, *args) -> None:
    """A server process: start ``make(*args)``, say where it listens, and serve until the
    study closes its end of the pipe (or ends)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leave the with: moto's server too
    with make(*args) as serving:
        conn.send(serving)
        with contextlib.suppress(EOFError):
            conn.recv()


class ServerProcess:
    """``with ServerProcess(files_server, ...) as server:`` a server in a process of its own,
    ``server.serving`` where it listens. As threads of the measuring process the server would
    take the loop's GIL, and its CPU could not be told from the loop's; as a child process it
    counts as the study's own in the busy meter, and ``cpu_s`` gives it apart."""

    def __init__(self, make, *args):
        context = multiprocessing.get_context("spawn")  # no copy of a parent with threads
        self._conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs, make, *args), daemon=True)
        self.process.start()
        theirs.close()
        try:
            self.serving: Serving = self._conn.recv()
        except EOFError:
            self.close()
            raise RuntimeError(f"the {make.__name__} process ended (exit code "
                               f"{self.process.exitcode}) before it listened") from None

    def cpu_s(self) -> float:
        """CPU seconds the server's processes have used so far."""
        return harness.tree_cpu_s(self.process.pid)

    def close(self) -> None:
        self._conn.close()
        self.process.join(30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


ARMS = ("in place", "staged")  # a repetition runs both, in the order harness.rotated gives
EPOCHS = ("in_place", "staged_cold", "staged_warm")


def same_bytes(reps: list[dict]) -> bool:
    """Every epoch of both arms delivered the same batches, and some: epochs with no batch
    digest alike but compare nothing."""
    seen = {(x[k]["digest"], x[k]["samples"]) for x in reps for k in EPOCHS}
    return len(seen) == 1 and next(iter(seen))[1] > 0


class ImageFiles(Dataset):
    """Images read from ``base`` (a URL: in place; or a local directory: staged), decoded and
    cropped the same way in both arms (fastmm's pil path, RandomResizedCrop + flip)."""

    def __init__(self, base: str, paths: list[str]):
        from ..dataset import ResizedCrop
        from ..decode import get_decoder

        self.base, self.paths = base, paths
        self.decoder, self.crop = get_decoder("pil"), ResizedCrop(size=(SIZE, SIZE))

    def __len__(self):
        return len(self.paths)

    def _read(self, rel: str) -> bytes:
        if self.base.startswith("http"):
            with urllib.request.urlopen(f"{self.base}/{urllib.parse.quote(rel)}", timeout=60) as r:
                return r.read()
        with open(os.path.join(self.base, rel), "rb") as f:
            return f.read()

    def __getitem__(self, i):
        return self.decoder.decode_resized_crop(self._read(self.paths[i]), self.crop.plan)


def drop_page_cache(root: str) -> None:
    """Ask the kernel to drop the cached pages of every file under ``root`` (clean pages go;
    no root privileges needed), so the next read comes from the disk."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed_epoch(dataset, args, images=lambda batch: batch) -> dict:
    """One epoch of ``dataset`` through fastmm.DataLoader: seconds, samples/s and the digest
    of its batches' ``images``."""
    import fastmm

    loader = fastmm.DataLoader(dataset, batch_size=args.batch, num_workers=args.num_workers)
    digest, n = 0, 0
    t0 = time.perf_counter()
    for batch in loader:
        pixels = images(batch)
        digest = zlib.crc32(pixels.numpy().tobytes(), digest)
        n += len(pixels)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "samples_per_s": n / seconds, "samples": n,
            "digest": f"{digest:08x}"}


def epoch(base: str, paths: list[str], args) -> dict:
    """One epoch of the image files under ``base`` (random crops, seeded alike in both arms)."""
    torch.manual_seed(args.seed)
    return timed_epoch(ImageFiles(base, paths), args)


def shard_epoch(stream, args) -> dict:
    """One epoch of a ShardStream's items."""
    return timed_epoch(stream, args, images=lambda batch: batch["image"])


def object_store_arm(root: str, work: str, args) -> dict:
    """Shards in a local S3 store read in place against staged first (see the module's
    docstring): per repetition, the open (index) and epoch times of both arms and staging."""
    import fastmm
    from ..sources import ShardSource, open_source, write_shards

    files = open_source("posix", os.path.join(root, "posix", "manifest.jsonl"))
    samples = [files.read(i) for i in range(len(files))]
    total = sum(len(b) for s in samples for b in s.members.values())
    shard_dir = os.path.join(work, "s3-shards")
    shards = write_shards(samples, shard_dir, max_bytes=max(total // (4 * args.num_workers), 1))
    # the index published beside each shard, as a corpus's publisher would upload it: opening
    # in place reads it instead of scanning every shard (staging copies the shards only)
    ShardSource(shard_dir, index_cache="beside", progress=None).keys()

    def stream(**source):
        t0 = time.perf_counter()
        ds = fastmm.MultimodalDataset("s3://corpus/shards", decoder="pil", size=SIZE,
                                      crop="center", modality="image", **source)
        opened = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = fastmm.ShardStream(ds, seed=args.seed)  # indexes the shards
        return ds, out, opened, time.perf_counter() - t0

    def in_place() -> dict:
        _, remote, listed_s, index_s = stream(source="shards", index_cache="beside")
        return {"in_place": shard_epoch(remote, args), "in_place_open_s": listed_s + index_s}

    def staged(stage_dir: str) -> dict:
        ds, local, staging_s, staged_index_s = stream(source="staged", inner="shards",
                                                      stage_dir=stage_dir)
        drop_page_cache(ds.source.stage_dir)
        return {"staged_cold": shard_epoch(local, args), "staged_warm": shard_epoch(local, args),
                "staging_s": staging_s, "staged_open_s": staged_index_s,
                "staging_cost": ds.source.staging_cost}

    reps = []
    with ServerProcess(store_server, shard_dir, args.latency_ms / 1e3,
                       args.mb_per_s * 1e6) as store, mock.patch.dict(os.environ, store.serving.env):
        for r in range(args.reps):
            stage_dir = os.path.join(work, f"s3-stage-{r}")
            rep = _repetition(r, store, in_place, lambda: staged(stage_dir))
            reps.append(rep)
            shutil.rmtree(stage_dir)
            print(f"[staging] object store rep {r + 1}/{args.reps} ({' first, '.join(rep['order'])}"
                  f" second): in place {rep['in_place_open_s']:.2f} s open + "
                  f"{rep['in_place']['seconds']:.2f} s epoch, staging {rep['staging_s']:.2f} s, "
                  f"staged epoch {rep['staged_cold']['seconds']:.2f} s cold / "
                  f"{rep['staged_warm']['seconds']:.2f} s warm", file=sys.stderr, flush=True)
    inp = [x["in_place"]["seconds"] for x in reps]
    cold = [x["staged_cold"]["seconds"] for x in reps]
    once = [x["staging_s"] + x["staged_open_s"] - x["in_place_open_s"] for x in reps]
    return {
        "store": {"kind": "S3 protocol (moto's server) on 127.0.0.1, through a proxy",
                  "mb_per_s_per_connection": args.mb_per_s, "latency_ms": args.latency_ms},
        "data": {"shards": len(shards), "samples": len(samples),
                 "bytes": sum(os.path.getsize(p) for p in shards)},
        "in_place_open_s": stats.summarize([x["in_place_open_s"] for x in reps]),
        "in_place_epoch_s": stats.summarize(inp),
        "staging_s": stats.summarize([x["staging_s"] for x in reps]),
        "staged_open_s": stats.summarize([x["staged_open_s"] for x in reps]),
        "staged_epoch_s_cold": stats.summarize(cold),
        "staged_epoch_s_warm": stats.summarize([x["staged_warm"]["seconds"] for x in reps]),
        "staged_over_in_place_throughput": stats.summarize(stats.paired_ratios(inp, cold)),
        "break_even_epochs": stats.summarize(
            [max(o, 0.0) / (i - c) if i > c else None for o, i, c in zip(once, inp, cold)]),
        "correctness": {"check": "every epoch of both arms delivers byte-identical batches",
                        "ok": same_bytes(reps)},
        "other_processes_cpu_cores": [x["other_processes_cpu_cores"] for x in reps],
        "server_cpu_s": stats.summarize([x["server_cpu_s"] for x in reps]),
        "reps": reps,
    }


def _repetition(index: int, server: ServerProcess, in_place, staged) -> dict:
    """One repetition: both arms, in the order ``harness.rotated`` gives for it, with the cores
    other processes used and the CPU the server used meanwhile."""
    order = harness.rotated(list(ARMS), index)
    rep = {"order": order}
    with OtherCores() as others:
        cpu0 = server.cpu_s()
        for arm in order:
            rep.update(in_place() if arm == "in place" else staged())
        rep["server_cpu_s"] = server.cpu_s() - cpu0
    rep["other_processes_cpu_cores"] = others.cores
    return rep


def run(args) -> dict:
    from ..sources.staged import StagedSource, write_file_manifest

    root = ensure_mmcorpus(CorpusSpec(num_images=args.images, num_videos=0, seed=args.seed),
                           args.cache_dir)
    work = options.temporary_directory("fastmm-staging-", args.work_dir)
    try:
        remote = os.path.join(work, "remote")  # what the slow server publishes: the images
        shutil.copytree(os.path.join(root, "posix", "image"), os.path.join(remote, "image"))
        write_file_manifest(remote)
        paths = sorted(os.path.relpath(os.path.join(d, f), remote).replace(os.sep, "/")
                       for d, _, fs in os.walk(os.path.join(remote, "image")) for f in fs
                       if f.endswith((".jpg", ".png")))  # not the captions and labels
        total = sum(os.path.getsize(os.path.join(remote, p)) for p in paths)

        def in_place() -> dict:
            return {"in_place": epoch(server.serving.url, paths, args)}

        def staged(stage_dir: str) -> dict:
            t0 = time.perf_counter()
            source = StagedSource(server.serving.url, stage_dir, mode="before")
            staging_s = time.perf_counter() - t0
            drop_page_cache(source.stage_dir)
            return {"staged_cold": epoch(source.stage_dir, paths, args),
                    "staged_warm": epoch(source.stage_dir, paths, args),
                    "staging_s": staging_s, "staging_cost": source.staging_cost}

        reps = []
        with ServerProcess(files_server, remote, args.mb_per_s * 1e6,
                           args.latency_ms / 1e3) as server:
            for r in range(args.reps):
                stage_dir = os.path.join(work, f"stage-{r}")
                rep = _repetition(r, server, in_place, lambda: staged(stage_dir))
                reps.append(rep)
                shutil.rmtree(stage_dir)
                print(f"[staging] rep {r + 1}/{args.reps} ({' first, '.join(rep['order'])} "
                      f"second): in place {rep['in_place']['seconds']:.2f} s, staging "
                      f"{rep['staging_s']:.2f} s, staged epoch {rep['staged_cold']['seconds']:.2f}"
                      f" s cold / {rep['staged_warm']['seconds']:.2f} s warm",
                      file=sys.stderr, flush=True)
        s3_arm = None if args.no_object_store else object_store_arm(root, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    inp = [x["in_place"]["seconds"] for x in reps]
    cold = [x["staged_cold"]["seconds"] for x in reps]
    staging = [x["staging_s"] for x in reps]
    break_even = [s / (i - c) if i > c else None for s, i, c in zip(staging, inp, cold)]
    result = {
        "environment": env.capture(env.module_argv(__spec__, __name__),
                                   loader_config={"batch_size": args.batch,
                                                  "num_workers": args.num_workers},
                                   paths=[args.work_dir or tempfile.gettempdir()]),
        "slow_storage": {"kind": "HTTP on 127.0.0.1", "mb_per_s": args.mb_per_s,
                         "latency_ms": args.latency_ms},
        "data": {"images": len(paths), "bytes": total},
        "in_place_epoch_s": stats.summarize(inp),
        "staging_s": stats.summarize(staging),
        "staged_epoch_s_cold": stats.summarize(cold),
        "staged_epoch_s_warm": stats.summarize([x["staged_warm"]["seconds"] for x in reps]),
        "staged_over_in_place_throughput": stats.summarize(stats.paired_ratios(inp, cold)),
        "break_even_epochs": stats.summarize(break_even),
        "correctness": {"check": "every epoch of both arms delivers byte-identical batches",
                        "ok": same_bytes(reps)},
        "server_cpu_s": stats.summarize([x["server_cpu_s"] for x in reps]),
        "busy": busy_notes("staging", [x["other_processes_cpu_cores"] for x in reps]),
        "reps": reps,
    }
    if s3_arm is not None:
        result["object_store"] = s3_arm
        result["busy"] += busy_notes("object-store arm", s3_arm["other_processes_cpu_cores"])
    result["finding"] = finding(result)
    return result


def finding(result: dict) -> dict:
    """The answer in two sentences and its call: staging is rolled out when the staged copy's
    epochs are surely faster (``stats.decision`` on the paired throughput ratio) and every
    epoch delivered the same bytes; the break-even says for which jobs it pays."""
    ratio, be, s = (result["staged_over_in_place_throughput"], result["break_even_epochs"],
                    result["slow_storage"])
    call, label = stats.decision(ratio, ok=result["correctness"]["ok"])
    text = (f"Epochs read from the staged local copy ran {stats.interval(ratio, 2, 'x')} as fast "
            f"as reading in place from {s['mb_per_s']:g} MB/s storage with {s['latency_ms']:g} "
            f"ms a request ({result['in_place_epoch_s']['median']:.1f} s against "
            f"{result['staged_epoch_s_cold']['median']:.1f} s an epoch). ")
    text += pays_for_itself(ratio, be, result["staging_s"])
    if "object_store" in result:
        text += " " + object_store_finding(result["object_store"])
    return {"text": text, "call": call, "label": label}


def object_store_finding(arm: dict) -> str:
    """The object-store arm in two sentences (its own figures; the call stays the HTTP arm's)."""
    ratio, be, s = arm["staged_over_in_place_throughput"], arm["break_even_epochs"], arm["store"]
    text = (f"For tar shards in an S3 store ({s['mb_per_s_per_connection']:g} MB/s a "
            f"connection, {s['latency_ms']:g} ms a request), epochs streamed from the staged "
            f"copy ran {stats.interval(ratio, 2, 'x')} as fast as streaming the objects in "
            f"place ({arm['in_place_epoch_s']['median']:.1f} s against "
            f"{arm['staged_epoch_s_cold']['median']:.1f} s; opening in place, the listing and "
            f"published indexes, took {arm['in_place_open_s']['median']:.1f} s). ")
    if not arm["correctness"]["ok"]:
        return text + "The epochs did not all deliver the same batches (or none): not comparable."
    return text + pays_for_itself(ratio, be, arm["staging_s"])


def pays_for_itself(ratio: dict, be: dict | None, staging: dict) -> str:
    """What the repetitions showed about the break-even, no more: it exists only in the
    repetitions where the staged copy was read faster (``be`` counts those)."""
    n, faster = ratio["n"], be["n"] if be else 0
    if faster == n:
        return (f"Staging took {stats.interval(staging, 1, ' s')}, so it pays for itself after "
                f"{stats.interval(be, 1, ' epochs')}.")
    if not faster:
        return (f"The staged copy was read no faster in any of the {n} repetitions: staging did "
                "not pay for itself in them.")
    return (f"The staged copy was read faster in {faster} of the {n} repetitions only, so "
            f"whether staging pays for itself is not shown (in those {faster}: after "
            f"{stats.interval(be, 1, ' epochs')}).")


def figures(result: dict) -> list[tuple]:
    """(name, Figure, caption): the break-even, and each arm's epoch time with its interval."""
    med = {k: result[k]["median"] for k in ("in_place_epoch_s", "staging_s",
                                              "staged_epoch_s_cold")}
    return [
        ("break-even", plots.break_even(med["in_place_epoch_s"], med["staging_s"],
                                        med["staged_epoch_s_cold"]),
         "Cumulative time against epochs, medians of the repetitions: reading in place from "
         "the slow storage, and staging first then reading the local copy (page cache "
         "dropped). Where the lines cross, staging has paid for itself."),
        ("epoch-times", plots.rates([
            ("epoch, in place", result["in_place_epoch_s"]),
            ("staging (copy + verify)", result["staging_s"]),
            ("epoch, staged copy, cold", result["staged_epoch_s_cold"]),
            ("epoch, staged copy, warm", result["staged_epoch_s_warm"])], "seconds"),
         "Seconds per epoch of each arm and of staging: median and interval over the "
         "repetitions (" + stats.CI_METHOD + ")."),
    ] + ([] if "object_store" not in result else [object_store_figure(result["object_store"])])


def object_store_figure(arm: dict) -> tuple:
    med = {k: arm[k]["median"] for k in ("in_place_epoch_s", "in_place_open_s", "staging_s",
                                           "staged_open_s", "staged_epoch_s_cold")}
    return ("break-even-object-store",
            plots.break_even(med["in_place_epoch_s"], med["staging_s"] + med["staged_open_s"],
                             med["staged_epoch_s_cold"], med["in_place_open_s"]),
            "Tar shards in an S3 store: cumulative time against epochs, streaming the objects "
            "in place after opening them there (listing, published indexes), and staging them "
            "first (copy, verify, local index scan) then streaming the local copy (page cache "
            "dropped). Medians of the repetitions.")


HEADER = ["figure", "median [interval]"]
ROWS = (("epoch reading in place", "in_place_epoch_s", " s", 2),
        ("staging (copy + verify)", "staging_s", " s", 2),
        ("epoch from the staged copy, page cache dropped", "staged_epoch_s_cold", " s", 2),
        ("epoch from the staged copy, warm", "staged_epoch_s_warm", " s", 2),
        ("per-epoch throughput, staged / in place", "staged_over_in_place_throughput", "x", 2),
        ("break-even epochs (staging / epoch time saved)", "break_even_epochs", " epochs", 1))


S3_ROWS = (("object store: opening in place (listing + published indexes)", "in_place_open_s",
            " s", 2),
           ("object store: epoch streaming in place", "in_place_epoch_s", " s", 2),
           ("object store: staging (copy + verify)", "staging_s", " s", 2),
           ("object store: opening the staged copy (index scan)", "staged_open_s", " s", 2),
           ("object store: epoch from the staged copy, page cache dropped",
            "staged_epoch_s_cold", " s", 2),
           ("object store: epoch from the staged copy, warm", "staged_epoch_s_warm", " s", 2),
           ("object store: per-epoch throughput, staged / in place",
            "staged_over_in_place_throughput", "x", 2),
           ("object store: break-even epochs", "break_even_epochs", " epochs", 1))


def _rows(result: dict) -> list[list[str]]:
    rows = [[label, stats.interval(result[key], digits, unit)]
            for label, key, unit, digits in ROWS]
    if "object_store" in result:
        rows += [[label, stats.interval(result["object_store"][key], digits, unit)]
                 for label, key, unit, digits in S3_ROWS]
    return rows


def _setup(result: dict) -> list[str]:
    s, d, e = result["slow_storage"], result["data"], result["environment"]
    return [
        f"Command: `{e['command']}`; fastmm commit `{e['git']['commit']}`; {e['cpu_model']}, "
        f"{e['cpu_count_usable']} cores; staging directory on "
        + ", ".join(f"{p}: {m['device']} ({m['fstype']})" for p, m in e["storage"].items()),
        f"Slow storage: {s['kind']}, {s['mb_per_s']} MB/s shared, {s['latency_ms']} ms per "
        f"request. Data: {d['images']} images, {d['bytes'] / 1e6:.1f} MB. One factor: where the "
        "bytes are read from; the same loader, decode, crops, order and seeds in both arms, "
        "each repetition starting with the arm the last one ran second. The server runs in a "
        "process of its own on this machine's cores "
        f"({stats.interval(result['server_cpu_s'], 1, ' s')} of CPU a repetition, counted as the "
        f"study's own, not as other processes'). Intervals: {stats.CI_METHOD}.",
        f"Correctness: {result['correctness']['check']}: "
        f"{'ok' if result['correctness']['ok'] else 'FAILED'}.",
    ] + ([] if "object_store" not in result else [_s3_setup(result["object_store"])])


def _s3_setup(arm: dict) -> str:
    s, d = arm["store"], arm["data"]
    return (f"Object-store arm: {s['kind']}, {s['mb_per_s_per_connection']} MB/s per "
            f"connection, {s['latency_ms']} ms per request; {d['samples']} images in "
            f"{d['shards']} tar shards, {d['bytes'] / 1e6:.1f} MB; both arms read with "
            "fastmm.ShardStream (the same shard order, seed and center crops), decode on the "
            "same pil path. The store runs in a process of its own on this machine's cores too "
            f"({stats.interval(arm['server_cpu_s'], 1, ' s')} of CPU a repetition). Correctness: "
            f"{arm['correctness']['check']}: {'ok' if arm['correctness']['ok'] else 'FAILED'}.")


TITLE = "Study 1: NVMe staging against reading in place"
READING = ("Reading: staging pays for itself after the break-even number of epochs; below it, "
           "read in place. The figure scales with the storage's bandwidth and latency (options "
           "--mb-per-s, --latency-ms) and with how decode-bound the epoch is.")


@options.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.study_staging", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=options.directory, default=os.path.join("bench-out", "study-staging"))
    p.add_argument("--images", type=options.whole(1), default=400)
    p.add_argument("--mb-per-s", type=options.number(0), default=20.0, help="slow storage bandwidth")
    p.add_argument("--latency-ms", type=options.number(0, above=False), default=5.0, help="per request")
    p.add_argument("--batch", type=options.whole(1), default=32)
    p.add_argument("--num-workers", type=options.whole(1), default=2)
    p.add_argument("--reps", type=options.whole(1), default=6,
                   help="repetitions (default 6, the fewest that give a 95%% CI)")
    p.add_argument("--seed", type=options.whole(0), default=0)
    p.add_argument("--cache-dir", type=options.directory, default=str(default_cache_dir()))
    p.add_argument("--work-dir", type=options.directory, default=None, help="where the staging copies go (local disk)")
    p.add_argument("--no-object-store", action="store_true",
                   help="leave out the object-store arm (tar shards in a local S3 store)")
    p.add_argument("--quick", action="store_true", help="smoke run: 48 images, 6 short reps")
    args = options.parse(p, argv, {"images": 48, "mb_per_s": 40.0})
    result = run(args)
    save_study(args.out, "staging", result, TITLE, HEADER, _rows(result),
               _setup(result) + [READING], figures(result))
    return 0



if __name__ == "__main__":
    sys.exit(main())
