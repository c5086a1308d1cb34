"""A short bounded run of each atheris target in fuzz/fuzz.py (the longer runs' figures are in
docs/faults.md): the tar reader, the shard index cache, fastmm._C.gather and planes against the
twin, the slab layout tables, a damaged loader state, the MP4 sample tables the video decoder
slims, and hostile name lists staged. A crash or hang fails with the input that caused it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("atheris")

HARNESS = os.path.join(os.path.dirname(__file__), "..", "fuzz", "fuzz.py")
SECONDS = int(os.environ.get("FASTMM_FUZZ_SECONDS", "12"))


@pytest.mark.slow
@pytest.mark.timeout(SECONDS + 120)
@pytest.mark.parametrize("target", ["tar", "index", "gather", "planes", "layout", "state", "mp4",
                                    "keys"])
def test_fuzz_target_finds_nothing_in_a_short_run(target, tmp_path):
    corpus = tmp_path / "corpus"
    run = subprocess.run(
        [sys.executable, HARNESS, target, f"-max_total_time={SECONDS}", "-timeout=10",
         f"-artifact_prefix={tmp_path}/", str(corpus)],
        capture_output=True, text=True, timeout=SECONDS + 100, cwd=tmp_path,
    )
    out = run.stdout + run.stderr
    found = [n for n in os.listdir(tmp_path) if n.startswith(("crash-", "timeout-", "oom-"))]
    assert run.returncode == 0 and not found, f"{found}\n{out[-4000:]}"
    runs = int(re.search(r"Done (\d+) runs", out).group(1))
    coverage = [int(c) for c in re.findall(r"cov: (\d+)", out)]
    # it really ran the target: many inputs, and coverage grew past the seeds' own
    least = 300 if target == "keys" else 1000  # keys lays a sandbox and stages it per input
    assert runs > least and coverage and max(coverage) > min(coverage), out[-2000:]
