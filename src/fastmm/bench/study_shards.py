"""Study 3, sharded storage in distributed training: a file per sample against WebDataset tar
shards of several sizes (read by offset index), against the smallest shards in an S3 store (moto's
server on 127.0.0.1 behind a proxy with a latency per request and a bandwidth cap per
connection) read in place by ranged GETs, and against those objects staged to a node-local
directory first (the store holds each shard's offset index beside it, as a publisher uploads
it), under ``torchrun`` (gloo) at world size 2 and 4 on this machine, and at the
largest world size as two node launches (``--nnodes 2``, each node staging into its own
directory, its ranks sharing the copy). The one factor is the data layout; decode (torchvision
backend, fast path, 224 px), sampler (fastmm.DistributedSampler, seed 0), batch and workers are
the same. Every rank all-reduces each step, as training would.

Reported per layout and world size, over ``--reps`` repetitions run interleaved (every
configuration once per round): per-rank throughput (median over ranks) with its median and
interval over the repetitions (a 95% CI from 6 of them: ``stats``), its ratio to the
file-per-sample layout at the same world size (paired by round), the slowest rank against the
fastest, startup (opening the layout to its first batch), staging cost where staged (and
whether each node copied each object once), whether every rank yielded the same number of
batches, and whether the layout gave the same samples as a file per sample (``same_samples``:
the keys the loader delivered in each epoch, gathered over the ranks, each sample once; each
key's members read back through the layout, digested, equal to the files'). The call rests on
both. One torchrun job per configuration reads
every round's layouts in turn, the ranks starting each layout together; its processes' start
(imports and rendezvous, the same for every layout) is reported once. Run:
``python -m fastmm.bench.study_shards --out DIR`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time

from . import env, harness, options, plots, stats
from .corpus import default_cache_dir
from .mmcorpus import CorpusSpec
from .pipelines import SIZE, ensure_mmcorpus
from .report import busy_notes, save_study
from .s3server import LocalS3


def rank_job(plan: str, out: str, batch: int, workers: int, epochs: int, study: int) -> None:
    """One rank of a world size's job (run by torchrun): a warm-up, then every (round, layout)
    of ``plan`` in turn, the ranks starting each together; writes this rank's figures.
    ``study``: the study's own process, whose tree (every node's launch, the S3 store) is
    the experiment's CPU, not another process's."""
    import psutil
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ready = time.time() - psutil.Process().create_time()  # imports and the group's rendezvous
    figures = {"rank": rank, "world": world, "ready_s": ready, "runs": []}
    runs = json.load(open(plan))
    node = int(os.environ.get("GROUP_RANK", "0"))  # torchrun's node rank
    figures["node"] = node
    rep, name, path = runs[0]  # a warm-up, not recorded: the first layout read pays the imports
    read_layout(name, path, os.path.join(out, f"stage-warm-up-node{node}"), batch, workers, 1)
    for done, (rep, name, path) in enumerate(runs, 1):
        dist.barrier()
        with harness.OtherCores(root=study) as others:
            # one staging directory per node (its local disk): its ranks stage each object once
            figs = read_layout(name, path, os.path.join(out, f"stage-{rep}-node{node}"), batch,
                               workers, epochs)
        run = {"rep": rep, "layout": name, **figs, "other_processes_cpu_cores": others.cores}
        figures["runs"].append(run)
        if rank == 0:
            print(f"[shards] world {world}: {done}/{len(runs)} round {rep + 1} {name}: "
                  f"{run['epochs'][-1]['samples_per_s']:.1f} samples/s on rank 0",
                  file=sys.stderr, flush=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(figures, f)
    dist.destroy_process_group()


def sample_digest(sample) -> str:
    """A digest of a sample's key and members (extension and bytes, in extension order)."""
    h = hashlib.blake2b(sample.key.encode(), digest_size=16)
    for ext in sorted(sample.members):
        data = sample.members[ext]
        h.update(f"\0{ext}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def read_back(source, keys: set[str]) -> dict[str, str]:
    """key -> ``sample_digest`` of each of ``keys`` read again through ``source`` (after the
    timed epochs, so in no figure): the bytes the layout holds for each key the loader got."""
    where = {k: i for i, k in enumerate(source.keys()) if k in keys}
    ahead = source.read_ahead(list(where.values()))  # a store's GETs at once
    return {k: sample_digest(ahead[i].result() if i in ahead else source.read(i))
            for k, i in where.items()}


def same_samples(epochs: list[list[str]], digests: dict[str, str], files: dict[str, str],
                 samples: int, world: int) -> dict:
    """One run of a layout against the file-per-sample layout's run of the same round:
    ``epochs`` the keys delivered in each epoch over all ranks, ``digests`` key -> digest
    (``read_back``), ``samples`` the layout's length. Each epoch must hold every one of the
    ``samples`` once (plus DistributedSampler's padding to a multiple of ``world``), and every
    key's digest must be the files'."""
    padded = math.ceil(samples / world) * world
    once = all(len(set(keys)) == samples and len(keys) == padded for keys in epochs)
    differ = sorted(k for k in files.keys() | digests.keys() if files.get(k) != digests.get(k))
    return {"each_once": once, "differing": differ, "ok": once and not differ}


def read_layout(name: str, root: str, stage_dir: str, batch: int, workers: int,
                epochs: int) -> dict:
    """This rank's share of a layout, ``epochs`` times: its figures per epoch (the first
    batch's time counted from opening the layout) with the keys delivered, the staging cost
    where staged, and the digest of each key delivered (``read_back``)."""
    import torch
    import torch.distributed as dist

    import fastmm

    opened = time.perf_counter()
    kind = {"files": "posix", "staged": "staged"}.get(name, "shards")
    # in the store: the index published beside each shard, not a scan of every shard by every rank
    source_options = {"index_cache": "beside"} if name == "s3" else {}
    source = None
    if kind == "staged":  # the node's staging directory: its ranks stage each object once
        from ..sources import StagedSource

        source = StagedSource(root, stage_dir, inner="shards", progress=None)
    dataset = fastmm.MultimodalDataset(root if source is None else None, source=source or kind,
                                       decoder="torchvision", reduce=True, size=SIZE,
                                       modality="image", transform=lambda item: {
                                           "image": item["image"], "key": item["key"]},
                                       **source_options)
    sampler = fastmm.DistributedSampler(dataset, seed=0)
    loader = fastmm.DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers)
    figures = {"epochs": []}
    for epoch in range(epochs):
        t0, n, batches, first, keys = time.perf_counter(), 0, 0, None, []
        for got in loader:
            total = torch.ones(1)
            dist.all_reduce(total)
            if first is None:
                first = time.perf_counter() - (opened if epoch == 0 else t0)
            n += len(got["image"])
            keys += got["key"]
            batches += 1
        seconds = time.perf_counter() - t0
        figures["epochs"].append({"samples": n, "batches": batches, "seconds": seconds,
                                  "samples_per_s": n / seconds, "first_batch_s": first,
                                  "keys": keys})
    if source is not None:
        figures["staging_cost"] = source.staging_cost
    figures["samples_in_layout"] = len(dataset)
    figures["digests"] = read_back(dataset.source,
                                   {k for e in figures["epochs"] for k in e["keys"]})
    return figures


def layouts(root: str, work: str, shard_sizes: list[int], store) -> dict[str, str]:
    """layout name -> what MultimodalDataset opens: the file tree, shards of each size, and
    the smallest in the S3 ``store`` (a LocalS3), in place and staged. The smallest: moto's
    server reads a whole object to answer a ranged GET of it, a cost a real store does not
    have, and one that grows with the object."""
    from ..sources import ShardSource, open_source
    from ..sources.shards import write_shards

    out = {"files": os.path.join(root, "posix", "manifest.jsonl")}
    files = open_source("posix", out["files"])
    samples = [files.read(i) for i in range(len(files))]
    for size in shard_sizes:
        name = f"shards-{size // 1_000_000}MB" if size >= 1_000_000 else f"shards-{size // 1000}kB"
        directory = os.path.join(work, name)
        write_shards([(s.key, s.members) for s in samples], directory, max_bytes=size)
        out[name] = directory
        if size == min(shard_sizes):
            smallest = directory
    ShardSource(smallest, index_cache="beside", progress=None).keys()  # published with them
    store.upload_dir(smallest, "corpus", "shards/")
    out["s3"] = "s3://corpus/shards"  # the smallest shards, read in place from the store
    out["staged"] = out["s3"]  # the same objects, staged by each node first
    return out


def configurations(worlds: list[int], nodes: list[int]) -> list[tuple[str, int, int]]:
    """(label, nodes, ranks per node): each world size on one node, then the largest one
    split over each node count that divides it."""
    top = max(worlds)
    return ([(f"world {w}", 1, w) for w in worlds]
            + [(f"world {top}, {n} nodes", n, top // n) for n in nodes
               if n > 1 and top % n == 0])


def run_job(plan: list, config: tuple[str, int, int], work: str, args, env: dict) -> dict:
    """One torchrun job of a configuration (one launch per node, see ``bench.nodes``) that
    reads every (round, layout) of ``plan`` in turn: {(round, layout): its figures condensed
    over the ranks}, or {"error": ...}. One job, not one per layout and round: starting torch
    in every rank costs more than reading this corpus (the process start, the same for every
    layout, is reported once)."""
    from .nodes import launch_nodes

    label, nnodes, per_node = config
    world = nnodes * per_node
    out = os.path.join(work, label.replace(" ", "-").replace(",", ""))
    os.makedirs(out)
    with open(os.path.join(out, "plan.json"), "w") as f:
        json.dump(plan, f)

    def echo(node: int, line: str) -> None:  # rank 0's progress
        if line.startswith("[shards]"):
            print(line, end="", file=sys.stderr, flush=True)

    runs = launch_nodes(nnodes, per_node, [
        "-m", "fastmm.bench.study_shards", "--rank-job", os.path.join(out, "plan.json"), out,
        str(args.batch), str(args.num_workers), str(args.epochs), str(os.getpid())],
        env={**env, "OMP_NUM_THREADS": "1"}, timeout_s=args.job_timeout_s, on_line=echo)
    failed = [r for r in runs if r.returncode != 0]
    if failed:
        lines = [x for x in failed[0].output.splitlines(True) if not x.startswith("[shards]")]
        return {"error": f"node {failed[0].node}: " + "".join(lines)[-2000:]}
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    figures = {"ready_s": stats.summarize([r["ready_s"] for r in ranks])["median"]}
    keys, digests = {}, {}  # (round, layout) -> keys per epoch over the ranks; key -> digest
    for i, (rep, name, _) in enumerate(plan):
        runs = [r["runs"][i] for r in ranks]
        keys[rep, name] = [[k for r in runs for k in r["epochs"][e]["keys"]]
                           for e in range(len(runs[0]["epochs"]))]
        digests[rep, name] = {k: d for r in runs for k, d in r["digests"].items()}
        rates = [r["epochs"][-1]["samples_per_s"] for r in runs]
        figures[rep, name] = {
            "rate": stats.summarize(rates)["median"],
            "slowest_over_fastest": min(rates) / max(rates),
            "startup_s": stats.summarize([r["epochs"][0]["first_batch_s"] for r in runs])["median"],
            "equal_batches": len({e["batches"] for r in runs for e in r["epochs"]}) == 1,
            "batches_per_epoch": runs[0]["epochs"][-1]["batches"],
            "other_processes_cpu_cores": runs[0]["other_processes_cpu_cores"],  # rank 0's view
        }
        if "staging_cost" in runs[0]:
            figures[rep, name]["staging_s"] = max(r["staging_cost"]["seconds"] for r in runs)
            copied = collections.Counter()
            for rank, r in zip(ranks, runs):
                copied[rank["node"]] += r["staging_cost"]["files"]
            figures[rep, name]["staged_once_per_node"] = (
                len(copied) == nnodes and len(set(copied.values())) == 1)
        figures[rep, name]["samples_in_layout"] = runs[0]["samples_in_layout"]
    for rep, name in keys:
        figures[rep, name]["content"] = same_samples(
            keys[rep, name], digests[rep, name], digests[rep, "files"],
            figures[rep, name]["samples_in_layout"], world)
    return figures


def summarize_runs(key: str, figs: list[dict], runs: dict[str, list]) -> dict:
    """A configuration over its repetitions; its throughput against files at the same world
    size, paired by round."""
    ok = [f for f in figs if "error" not in f]
    if len(ok) < len(figs):
        return {"error": next(f["error"] for f in figs if "error" in f)}
    baseline = runs.get("files / " + key.split(" / ", 1)[1], [])
    differ = sorted({k for f in ok for k in f["content"]["differing"]})
    entry = {
        "reps": len(ok),
        "per_rank_samples_per_s": stats.summarize([f["rate"] for f in ok]),
        "vs_files": stats.summarize(stats.paired_ratios(
            [f["rate"] for f in ok], [b.get("rate") for b in baseline])),
        "slowest_over_fastest": stats.summarize([f["slowest_over_fastest"] for f in ok]),
        "startup_s": stats.summarize([f["startup_s"] for f in ok]),
        "equal_batches": all(f["equal_batches"] for f in ok),
        "batches_per_epoch": ok[0]["batches_per_epoch"],
        "same_samples": {"samples": ok[0]["samples_in_layout"],
                         "each_once": all(f["content"]["each_once"] for f in ok),
                         "differing_keys": differ[:5], "differing_count": len(differ),
                         "ok": all(f["content"]["ok"] for f in ok)},
    }
    if "staging_s" in ok[0]:
        entry["staging_s"] = stats.summarize([f["staging_s"] for f in ok])
        entry["staged_once_per_node"] = all(f["staged_once_per_node"] for f in ok)
    return entry


def run(args) -> dict:
    root = ensure_mmcorpus(CorpusSpec(num_images=args.images, num_videos=0, seed=args.seed),
                           args.cache_dir)
    work = options.temporary_directory("fastmm-shards-", args.work_dir)
    runs: dict[str, list] = {}
    ready: dict[str, float] = {}
    try:
        with LocalS3(latency_s=args.store_latency_ms / 1e3,
                     bytes_per_s=args.store_mb_per_s * 1e6) as store:
            where = layouts(root, work, args.shard_bytes, store)
            names = list(where)
            # interleaved: every layout once per round, each round starting one layout later
            plan = [(rep, name, where[name]) for rep in range(args.reps)
                    for name in harness.rotated(names, rep)]
            for config in configurations(args.worlds, args.nodes):
                figures = run_job(plan, config, work, args, {**os.environ, **store.env})
                if "ready_s" in figures:
                    ready[config[0]] = figures["ready_s"]
                for name in names:
                    runs[f"{name} / {config[0]}"] = [figures.get((rep, name), figures)
                                                     for rep in range(args.reps)]
                if "error" in figures:
                    print(f"[shards] {config[0]}: FAILED", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {key: summarize_runs(key, figs, runs) for key, figs in runs.items()}
    result = {"environment": env.capture(env.module_argv(__spec__, __name__),
                                         loader_config={"batch_size": args.batch,
                                                        "num_workers": args.num_workers},
                                         paths=[args.work_dir or tempfile.gettempdir()]),
              "images": args.images, "epochs": args.epochs, "reps": args.reps,
              "store": {"kind": "S3 protocol (moto's server) on 127.0.0.1, through a proxy",
                        "mb_per_s_per_connection": args.store_mb_per_s,
                        "latency_ms": args.store_latency_ms},
              "process_ready_s": ready, "results": results,
              "busy": busy_notes("shards", [f.get("other_processes_cpu_cores")
                                            for figs in runs.values() for f in figs
                                            if "error" not in f])}
    result["finding"] = finding(result)
    return result


def finding(result: dict) -> dict:
    """Each layout's per-rank rate against a file per sample, in every configuration; the call
    is ``stats.decision``'s on the first shard layout at the largest one-node world size,
    rolled back if its ranks did not all yield the same number of batches or its samples were
    not a file per sample's (``same_samples``)."""
    ok = {k: r for k, r in result["results"].items() if "error" not in r}
    configs = list(dict.fromkeys(k.split(" / ", 1)[1] for k in ok))  # in the order run
    if not configs:
        return {"text": "Every torchrun job failed: nothing measured.", "call": "undecided",
                "label": "not measured: the jobs failed"}
    sentences = []
    for c in configs:
        rows = [(k.split(" / ")[0], r) for k, r in ok.items()
                if k.endswith(f" / {c}") and not k.startswith("files ")]
        sentences.append(f"at {c}, " + "; ".join(
            f"{layout} {stats.interval(r['vs_files'], 2, 'x')}" for layout, r in rows))
    text = ("Per-rank samples/s against a file per sample (torchrun, every rank on this "
            "machine's cores): " + "; ".join(sentences) + ".")
    differ = [f"{k} ({_samples(r['same_samples'])})" for k, r in ok.items()
              if not r["same_samples"]["ok"]]
    text += (" Samples NOT a file per sample's in: " + "; ".join(differ) + "." if differ else
             " Every layout gave a file per sample's samples in every run: each once per "
             "epoch, the same keys with the same bytes.")
    once = [k for k, r in ok.items() if r.get("staged_once_per_node") is False]
    if once:
        text += f" Staging copied an object more than once on a node in: {', '.join(once)}."
    single = [c for c in configs if "nodes" not in c]
    at = max(single, key=lambda c: int(c.split()[1])) if single else configs[-1]
    top = next((k for k in ok if k.startswith("shards-") and k.endswith(f" / {at}")), None)
    if top is None:
        return {"text": text, "call": "undecided", "label": "no shard layout measured"}
    call, label = stats.decision(ok[top]["vs_files"],
                                 ok=ok[top]["equal_batches"] and ok[top]["same_samples"]["ok"])
    return {"text": text, "call": call, "label": f"{top}: {label}"}


def _samples(same: dict) -> str:
    """``same_samples`` of a configuration in words."""
    if same["ok"]:
        return f"yes ({same['samples']}, each once)"
    wrong = [] if same["each_once"] else ["a sample missing or repeated in an epoch"]
    if same["differing_count"]:
        wrong.append(f"{same['differing_count']} keys differ or are missing, e.g. "
                     + ", ".join(same["differing_keys"]))
    return "NO: " + "; ".join(wrong)


def figures(result: dict) -> list[tuple]:
    """(name, Figure, caption): per-rank rates per layout and world size, and their ratio to a
    file per sample."""
    ok = [(k, r) for k, r in result["results"].items() if "error" not in r]
    return [
        ("per-rank-rates", plots.rates([(k, r["per_rank_samples_per_s"]) for k, r in ok],
                                       "samples/s per rank (median over ranks)"),
         "Per-rank samples/s of each layout at each world size: median and interval over the "
         "repetitions (" + stats.CI_METHOD + ")."),
        ("vs-files", plots.rates([(k, r["vs_files"]) for k, r in ok if not k.startswith("files ")],
                                 "per-rank samples/s, ratio to a file per sample", ref=1.0),
         "Each layout's per-rank rate over a file per sample's at the same world size, paired "
         "by round; the dotted line is parity."),
    ]


def _setup(result: dict) -> list[str]:
    e = result["environment"]
    return [
        f"Command: `{e['command']}`; fastmm commit `{e['git']['commit']}`; {e['cpu_model']}, "
        f"{e['cpu_count_usable']} cores (every rank of every world size shares them).",
        f"{result['images']} images; figures from the last of {result['epochs']} epochs "
        f"(startup from the first); {result.get('reps', 1)} repetitions, interleaved. "
        f"Intervals: {stats.CI_METHOD}. Startup: opening the layout to its first batch; before "
        "that, each world size's ranks took "
        + (", ".join(f"{s:.1f} s at {w}" for w, s in result.get("process_ready_s", {}).items())
           or "-")
        + " from process start to a ready process group (imports, rendezvous).",
        f"Layouts \"s3\" and \"staged\": the smallest shards in an "
        f"{result['store']['kind']}, {result['store']['mb_per_s_per_connection']:g} MB/s per "
        f"connection, {result['store']['latency_ms']:g} ms per request; \"s3\" reads them in "
        "place (a batch's ranged GETs at once; moto's server reads a whole object to answer "
        "one, so the smallest shards), \"staged\" first copies them into the node's "
        "own staging directory (its ranks sharing the copy). \"N nodes\": "
        "N torchrun launches (--nnodes N --node_rank K) meeting at 127.0.0.1, as a cluster "
        "scheduler starts one per host; all on this machine's cores, the store too (its CPU "
        "and every node's count as the study's own, not as other processes').",
        "Same samples: in every run, the keys each epoch delivered, gathered over the ranks, "
        "must hold each of the layout's samples once (DistributedSampler pads to a multiple of "
        "the world size), and after the timed epochs each rank reads its keys back through the "
        "layout (in no figure) and digests key and members (blake2b); every key's digest must "
        "be the file-per-sample layout's in the same round. The call needs it and equal "
        "batches.",
    ]


TITLE = "Study 3: sharded storage in distributed training"
HEADER = ["layout / world", "samples/s per rank", "vs files", "slowest / fastest", "startup s",
          "staging s", "equal batches", "same samples"]


def _rows(result: dict) -> list[list[str]]:
    rows = []
    for name, r in result["results"].items():
        if "error" in r:
            rows.append([name, "FAILED", "", "", "", "", "", ""])
            continue
        rows.append([name, stats.interval(r["per_rank_samples_per_s"], 1),
                     stats.interval(r["vs_files"], 2, "x"),
                     stats.interval(r["slowest_over_fastest"], 2),
                     stats.interval(r["startup_s"], 2),
                     stats.interval(r.get("staging_s"), 2)
                     + ("" if r.get("staged_once_per_node", True) else " (copied twice)"),
                     "yes" if r["equal_batches"] else "NO", _samples(r["same_samples"])])
    return rows


@options.command
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rank-job":
        plan, out, batch, workers, epochs, study = argv[1:7]
        rank_job(plan, out, int(batch), int(workers), int(epochs), int(study))
        return 0
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.study_shards", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=options.directory, default=os.path.join("bench-out", "study-shards"))
    p.add_argument("--images", type=options.whole(1), default=400)
    p.add_argument("--shard-bytes", type=options.listed(options.whole(1)),
                   default="1000000,8000000,64000000")
    p.add_argument("--worlds", type=options.listed(options.whole(1)), default="2,4")
    p.add_argument("--batch", type=options.whole(1), default=16)
    p.add_argument("--num-workers", type=options.whole(1), default=1)
    p.add_argument("--epochs", type=options.whole(1), default=2)
    p.add_argument("--reps", type=options.whole(1), default=6,
                   help="repetitions, interleaved (default 6, the fewest that give a 95%% CI)")
    p.add_argument("--nodes", type=options.listed(options.whole(1)), default="2",
                   help="also run the largest world size as this many node launches")
    p.add_argument("--store-mb-per-s", type=options.number(0), default=100.0,
                   help="the S3 store's bandwidth per connection")
    p.add_argument("--store-latency-ms", type=options.number(0, above=False), default=5.0,
                   help="the S3 store's latency per request")
    p.add_argument("--job-timeout-s", type=options.number(0), default=3600.0,
                   help="a torchrun job still running then is killed and reported FAILED")
    p.add_argument("--seed", type=options.whole(0), default=0)
    p.add_argument("--cache-dir", type=options.directory, default=str(default_cache_dir()))
    p.add_argument("--work-dir", type=options.directory, default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: 48 images, world 2")
    args = options.parse(p, argv, {"images": 48, "worlds": [2], "shard_bytes": [300_000, 2_000_000],
                                   "batch": 8, "reps": 2})
    result = run(args)
    save_study(args.out, "shards", result, TITLE, HEADER, _rows(result), _setup(result),
               figures(result))
    return 0 if all("error" not in r for r in result["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
