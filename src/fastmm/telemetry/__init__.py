"""Telemetry: one metric set (metrics.METRICS) for torch's DataLoader, untouched, and for
fastmm's. See docs/telemetry.md.

    tm = fastmm.telemetry.Telemetry()
    for batch in tm.watch(loader): ...
    print(tm.table())

Datasets may mark their stages with ``fastmm.telemetry.stage("read" | "decode" | "augment")``.
fastmm.DataLoader also turns it on by itself with FASTMM_TELEMETRY=summary|trace (exports go
to FASTMM_TELEMETRY_DIR at the end of every epoch).
"""

from .metrics import METRICS
from .recorder import STAGES, stage
from .session import Telemetry, Watched

__all__ = ["METRICS", "STAGES", "Telemetry", "Watched", "stage"]
