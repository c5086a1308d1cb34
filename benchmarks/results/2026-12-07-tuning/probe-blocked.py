"""The tuner's readings, once a period, with its decisions held (2 workers, 10 s from the
constructor), `blocked` among them: are transport's and decode's workers blocked, or ready for a
core, when no core is idle? And a dataset that sleeps 4 ms a sample (a remote read)?

Run (the tree of 68a44a0, before the benchmarks of d7961b7): PYTHONPATH=src python
benchmarks/results/2026-12-07-tuning/probe-blocked.py transport 2,3,4,5; ... decode 2,4;
... sleep. Its output (the loader's "settled at" lines left out): probe-blocked.txt beside it."""
import json
import sys
import time

import torch

import fastmm
from fastmm import autotune
from fastmm.bench import tuning

log = []


def spy(self, at, period):
    log.append(dict(at=round(at, 1), n=self.workers, p=self.prefetch,
                    **{k: round(v, 3) for k, v in period._asdict().items()}))
    return []  # hold the setting: readings only


autotune.Tuner._decide = spy


class Sleepy(torch.utils.data.Dataset):
    """4 ms asleep and a little compute a sample: a worker blocked most of its time."""

    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        time.sleep(0.004)
        x = torch.randn(64, 64)
        return x @ x


name = sys.argv[1]
if name == "sleep":
    loader = fastmm.DataLoader(Sleepy(), batch_size=8, num_workers="auto",
                               persistent_workers=True)
    began = time.time()
    for _ in loader:
        if time.time() - began > 7:
            break
    print(json.dumps(log[2:]), flush=True)
else:
    pipe = tuning._workload(name, type("a", (), {"images": 500})())
    for prefetch in map(int, sys.argv[2].split(",")):
        log.clear()
        tuning.run(pipe, "auto", prefetch, 10, auto_seconds=10)
        rows = log[3:]
        keys = ["wait", "cpu", "idle", "idle_workers", "blocked", "rate", "loop_cpu"]
        print(name, "n", rows[-1]["n"], "p", prefetch,
              {k: round(sum(r[k] for r in rows) / len(rows), 3) for k in keys}, flush=True)
