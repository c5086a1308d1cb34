"""The tuner's readings, once a period, with its decisions held (2 workers, prefetch 2 and 4,
15 s each): is the workers' wait with every batch made a cue for a deeper prefetch?

Run (at 12c47fd, a clean worktree, after the benchmarks): PYTHONPATH=src python
benchmarks/results/2026-12-07-tuning/probe-readings.py transport,decode
Its output (the loader's "settled at" lines left out): probe-readings.txt beside it."""
import json
import sys

from fastmm import autotune
from fastmm.bench import tuning

log = []
def spy(self, at, wait, cpu, idle, idle_workers, rate, loop_cpu):
    log.append(dict(at=round(at,1), n=self.workers, p=self.prefetch, wait=round(wait,3), cpu=round(cpu,2),
                    idle=round(idle,2), idle_workers=round(idle_workers,3), rate=round(rate,1), loop=round(loop_cpu,2)))
    return []  # hold the setting: readings only
autotune.Tuner._decide = spy

for name in sys.argv[1].split(","):
    pipe = tuning._workload(name, type("a", (), {"images": 500})())
    for prefetch in (2, 4):
        log.clear()
        # auto workers with decisions suppressed: it stays at its first count (2)
        tuning.run(pipe, "auto", prefetch, 10, auto_seconds=15)
        rates = [x["rate"] for x in log[3:]]
        iw = [x["idle_workers"] for x in log[3:]]
        w = [x["wait"] for x in log[3:]]
        print(name, "prefetch", prefetch, "n", log[-1]["n"] if log else None, "rate", sum(rates)/len(rates),
              "idle_workers", sum(iw)/len(iw), "wait", sum(w)/len(w), flush=True)
        print(json.dumps(log[3:8]), flush=True)
