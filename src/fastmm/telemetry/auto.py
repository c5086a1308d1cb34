"""FASTMM_TELEMETRY=summary|trace: fastmm.DataLoader watches each epoch by itself and writes
the exports to FASTMM_TELEMETRY_DIR, one directory per loader (a training and a validation
loader, or the ranks of a job on one host, would overwrite each other's files)."""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import time
import warnings
import weakref

import torch

from ..config import TelemetryConfig
from .recorder import _Forwarding
from .session import Telemetry

_telemetry_loaders = itertools.count()


def epoch(loader, iterate):
    """The loader's next epoch: ``iterate()`` (torch's ``__iter__``) as it is with telemetry
    off, else watched by the loader's one session and exported."""
    config = TelemetryConfig.from_env()
    if config.mode == "off":
        return iterate()
    directory = config.made_directory()
    tm = loader.__dict__.get("_fastmm_telemetry")
    if tm is None:
        tm = loader.__dict__["_fastmm_telemetry"] = Telemetry(trace=config.mode == "trace")
        loader.__dict__["_fastmm_telemetry_name"] = _telemetry_name()
    directory = os.path.join(directory, loader.__dict__["_fastmm_telemetry_name"])
    return _ExportedEpoch(tm, iter(tm.watch(loader, _iterate=iterate)), directory)


def _telemetry_name() -> str:
    """``loader<k>`` (the k-th loader this process watched from the environment), after
    ``rank<r>-`` in a distributed job (torch.distributed's rank, else torchrun's RANK)."""
    rank = (torch.distributed.get_rank() if torch.distributed.is_available()
            and torch.distributed.is_initialized() else os.environ.get("RANK", "").strip())
    name = f"loader{next(_telemetry_loaders)}"
    return f"rank{rank}-{name}" if str(rank).isdigit() else name


_EXPORT_EVERY_S = 300.0


class _ExportedEpoch(_Forwarding):
    """The epoch's iterator (len() and attributes as the loader's own); the exports are written
    when it ends, however it ends (it runs out, the loop breaks out or lets go of it, the
    interpreter exits mid-epoch), the summary and time series also when a batch fails and every
    _EXPORT_EVERY_S meanwhile (a pretraining loop may stop by step count and never finish an
    epoch). A failed write is a warning: telemetry never stops the training."""

    _OWN = ("_epoch", "_tm", "_directory", "_due", "_closed")

    def __init__(self, tm: Telemetry, epoch, directory: str):
        self._epoch, self._tm, self._directory = epoch, tm, directory
        self._due = time.monotonic() + _EXPORT_EVERY_S
        self._closed = False
        _OPEN_EXPORTS.add(self)

    def __iter__(self):
        return self

    def __len__(self):
        return len(self._epoch)

    def __next__(self):
        try:
            batch = next(self._epoch)
        except StopIteration:
            self.close()
            raise
        except Exception:  # the loop may go on, or end here with the iterator in a traceback
            _export(self._tm, self._directory, trace=False)
            raise
        if time.monotonic() >= self._due:
            _export(self._tm, self._directory, trace=False)
            self._due = time.monotonic() + _EXPORT_EVERY_S
        return batch

    def close(self) -> None:
        if self._closed or sys.is_finalizing():  # (too late to write: modules are going)
            return
        self._closed = True
        _OPEN_EXPORTS.discard(self)
        self._epoch.close()  # the epoch's own bookkeeping first (sampler stopped, wall time)
        paths = _export(self._tm, self._directory, trace=True)
        if paths:
            print(f"fastmm telemetry: {', '.join(paths.values())}", file=sys.stderr)

    def __del__(self):
        self.close()


_OPEN_EXPORTS: weakref.WeakSet = weakref.WeakSet()
# an epoch still open at exit (a loop stopped by step count, a module-level iterator) is
# exported before the interpreter starts taking modules down
atexit.register(lambda: [epoch.close() for epoch in list(_OPEN_EXPORTS)])


def _export(tm: Telemetry, directory: str, trace: bool) -> dict[str, str] | None:
    try:
        return tm.export(directory, trace=trace)
    except OSError as e:
        warnings.warn(f"fastmm telemetry: could not write to {directory}: {e}", stacklevel=3)
        return None
