"""Which S3 client library fastmm's s3:// roots use: boto3, obstore (Rust object_store) and AWS's
s3torchconnector (CRT), measured on this workload against a real S3-protocol server on
127.0.0.1 (moto's server, no proxy): a data-loader worker's ranged GETs of one sample's span
(100 kB at random offsets in a shard), and streaming whole shards front to back.

Reported per client over ``--reps`` interleaved rounds (median and interval): milliseconds and
client CPU milliseconds per ranged GET, and MB/s streaming; plus whether a client made in the
parent still works in a forked child (a DataLoader worker), which a pick must survive. The
server's own time is in every figure alike. Run:
``python -m fastmm.bench.s3_clients --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

from . import env, options, stats
from .s3server import ACCESS_KEY, REGION, SECRET_KEY, LocalS3

BUCKET, KEY = "clients", "shard-000000.tar"


def _boto3(endpoint: str):
    import boto3

    client = boto3.session.Session().client("s3")

    def get(start: int | None, size: int | None) -> bytes:
        args = {} if start is None else {"Range": f"bytes={start}-{start + size - 1}"}
        return client.get_object(Bucket=BUCKET, Key=KEY, **args)["Body"].read()

    return get


def _obstore(endpoint: str):
    import obstore
    from obstore.store import S3Store

    store = S3Store(BUCKET, endpoint=endpoint, region=REGION, access_key_id=ACCESS_KEY,
                    secret_access_key=SECRET_KEY, client_options={"allow_http": True},
                    virtual_hosted_style_request=False)

    def get(start: int | None, size: int | None) -> bytes:
        if start is None:
            return bytes(obstore.get(store, KEY).bytes())
        return bytes(obstore.get_range(store, KEY, start=start, length=size))

    return get


def _s3torchconnector(endpoint: str):
    from s3torchconnector import S3ReaderConstructor
    from s3torchconnector._s3client import S3Client, S3ClientConfig

    client = S3Client(REGION, endpoint=endpoint,
                      s3client_config=S3ClientConfig(force_path_style=True))

    def get(start: int | None, size: int | None) -> bytes:
        if start is None:
            return client.get_object(BUCKET, KEY,
                                     reader_constructor=S3ReaderConstructor.sequential()).read()
        reader = client.get_object(BUCKET, KEY,
                                   reader_constructor=S3ReaderConstructor.range_based())
        reader.seek(start)
        return reader.read(size)

    return get


CLIENTS = {"boto3": _boto3, "obstore": _obstore, "s3torchconnector": _s3torchconnector}


def _round(get, data: bytes, args, rng: random.Random) -> dict:
    spans = [rng.randrange(0, len(data) - args.span_bytes) for _ in range(args.gets)]
    wall, cpu = time.perf_counter(), time.process_time()
    for start in spans:
        assert get(start, args.span_bytes) == data[start:start + args.span_bytes]
    ranged_ms = (time.perf_counter() - wall) * 1e3 / args.gets
    ranged_cpu_ms = (time.process_time() - cpu) * 1e3 / args.gets
    wall = time.perf_counter()
    for _ in range(args.streams):
        assert get(None, None) == data
    return {"ranged_ms": ranged_ms, "ranged_cpu_ms": ranged_cpu_ms,
            "stream_mb_per_s": args.streams * len(data) / 1e6 / (time.perf_counter() - wall)}


def _after_fork(make, endpoint: str, data: bytes, fresh: bool) -> str:
    """"ok", or what went wrong, when a client made and used in the parent is used in a forked
    child (as a DataLoader worker inherits it), or with ``fresh`` when the child makes its own
    (as fastmm's S3Store does in each process)."""
    get = make(endpoint)
    get(0, 100)
    pid = os.fork()
    if pid == 0:  # the child: exit code says what happened
        try:
            os._exit(0 if (make(endpoint) if fresh else get)(10, 100) == data[10:110] else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return {0: "ok", 1: "wrong bytes", 2: "raised"}.get(code, f"exit {code}")
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung (killed after 20 s)"


def run(args) -> dict:
    data = random.Random(args.seed).randbytes(args.object_bytes)
    rounds: dict[str, list[dict]] = {name: [] for name in args.clients}
    with LocalS3() as s3, s3.environ(direct=True), tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, KEY), "wb") as f:
            f.write(data)
        s3.upload_dir(tmp, BUCKET)
        endpoint = s3.direct_env["AWS_ENDPOINT_URL"]
        gets = {name: CLIENTS[name](endpoint) for name in args.clients}
        for name, get in gets.items():  # warm-up: connections, lazy imports
            _round(get, data, argparse.Namespace(**{**vars(args), "gets": 5, "streams": 1}),
                   random.Random(0))
        for rep in range(args.reps):
            for name in args.clients[rep % len(args.clients):] + \
                    args.clients[:rep % len(args.clients)]:
                rounds[name].append(_round(gets[name], data, args, random.Random(rep)))
            print(f"[clients] round {rep + 1}/{args.reps}: " + ", ".join(
                f"{n} {rounds[n][-1]['ranged_ms']:.2f} ms" for n in args.clients),
                file=sys.stderr, flush=True)
        forked = {name: {"inherited": _after_fork(CLIENTS[name], endpoint, data, False),
                         "made in the child": _after_fork(CLIENTS[name], endpoint, data, True)}
                  for name in args.clients}
    results = {name: {k: stats.summarize([r[k] for r in rs]) for k in rs[0]}
               for name, rs in rounds.items()}
    return {"environment": env.capture(env.module_argv(__spec__, __name__)),
            "workload": {"object_bytes": args.object_bytes, "span_bytes": args.span_bytes,
                         "gets_per_round": args.gets, "streams_per_round": args.streams,
                         "server": "moto's server on 127.0.0.1 (a Python process)"},
            "versions": {name: _version(name) for name in args.clients},
            "results": results, "after_fork": forked}


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def report(result: dict) -> str:
    w = result["workload"]
    lines = ["# S3 client libraries on fastmm's workload", "",
             f"{w['gets_per_round']} ranged GETs of {w['span_bytes'] // 1000} kB at random "
             f"offsets, and {w['streams_per_round']} whole reads of a "
             f"{w['object_bytes'] / 1e6:.0f} MB object, per round; server: {w['server']}. "
             f"Command: `{result['environment']['command']}`; fastmm commit "
             f"`{result['environment']['git']['commit']}`; {result['environment']['cpu_model']}"
             f", {result['environment']['cpu_count_usable']} cores. Intervals: {stats.CI_METHOD}.",
             "",
             "| client | ms per ranged GET | client CPU ms per GET | streaming MB/s | "
             "in a forked child: client inherited / made there |", "|---|---|---|---|---|"]
    for name, r in result["results"].items():
        lines.append(f"| {name} {result['versions'][name]} | {stats.interval(r['ranged_ms'], 2)} "
                     f"| {stats.interval(r['ranged_cpu_ms'], 2)} | "
                     f"{stats.interval(r['stream_mb_per_s'], 0)} | "
                     + " / ".join(result["after_fork"][name].values()) + " |")
    return "\n".join(lines) + "\n"


@options.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.s3_clients", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=options.directory, default=os.path.join("bench-out", "s3-clients"))
    p.add_argument("--clients", type=options.listed(str, tuple(CLIENTS)), default=list(CLIENTS))
    # moto's server reads the whole object for every ranged GET: a small object keeps its
    # time from drowning the clients' (a real store's does not grow with the object)
    p.add_argument("--object-bytes", type=options.whole(1 << 20), default=4 << 20)
    p.add_argument("--span-bytes", type=options.whole(1), default=100_000)
    p.add_argument("--gets", type=options.whole(1), default=200)
    p.add_argument("--streams", type=options.whole(1), default=3)
    p.add_argument("--reps", type=options.whole(1), default=6)
    p.add_argument("--seed", type=options.whole(0), default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 20 GETs, one whole read")
    args = options.parse(p, argv, {"gets": 20, "streams": 1})
    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "s3_clients.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = report(result)
    with open(os.path.join(args.out, "s3_clients.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
