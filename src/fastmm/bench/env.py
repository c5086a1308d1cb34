"""The environment a result was measured in, recorded next to it."""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import platform
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import psutil


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.rstrip("\n")


def git_state() -> dict:
    """Commit and local changes of the checkout fastmm is imported from (None outside git)."""
    import fastmm

    here = Path(fastmm.__file__).resolve().parent
    top = _git(here, "rev-parse", "--show-toplevel")
    if not top:
        return {"repo": None, "commit": None, "dirty": None, "changed_files": []}
    status = _git(Path(top), "status", "--porcelain", "--untracked-files=no") or ""
    changed = [line[3:] for line in status.splitlines() if line.strip()]  # "XY path"
    return {
        "repo": top,
        "commit": _git(Path(top), "rev-parse", "HEAD"),
        "dirty": bool(changed),
        "changed_files": changed,
    }


def shm_info(path: str) -> dict:
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return {"path": path, "total_bytes": None, "free_bytes": None}
    return {"path": path, "total_bytes": usage.total, "free_bytes": usage.free}


def capture(argv: list[str] | None = None) -> dict:
    import torch

    import fastmm
    from fastmm.config import TransportConfig

    argv = sys.argv if argv is None else argv
    transport = TransportConfig.from_env()
    memory = psutil.virtual_memory()
    # FASTMM_* settings change what is measured: they belong to the command that reproduces it.
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith("FASTMM_")}
    return {
        "timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([f"{k}={v}" for k, v in settings.items()] + list(argv)),
        "fastmm_env": settings,
        "argv": list(argv),
        "cwd": os.getcwd(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "kernel": platform.release(),
        "versions": {
            "fastmm": getattr(fastmm, "__version__", None),
            "torch": torch.__version__,
            "torchvision": _version("torchvision"),
            "numpy": _version("numpy"),
            "pillow": _version("pillow"),
            "psutil": _version("psutil"),
        },
        "fastmm_uses_cpp": fastmm.uses_cpp(),
        "fastmm_transport": dataclasses.asdict(transport),
        "cpu_model": cpu_model(),
        "cpu_count_logical": os.cpu_count(),
        "cpu_count_usable": usable_cores(),
        "ram_total_bytes": memory.total,
        "ram_available_bytes_at_start": memory.available,
        "dev_shm": shm_info("/dev/shm"),
        "slab_dir": shm_info(transport.shm_dir),
        "torch_num_threads": torch.get_num_threads(),
        "multiprocessing_start_method": multiprocessing.get_start_method(allow_none=True)
        or multiprocessing.get_context().get_start_method(),
        "loadavg_at_start": list(os.getloadavg()),
        "git": git_state(),
    }
