"""The environment a result was measured in, recorded next to it."""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import psutil

from ..doctor import cgroup_cpu_quota, usable_cores


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


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.rstrip("\n")


def git_state(path: str | Path | None = None) -> dict:
    """Commit and local changes of the git checkout holding ``path`` (default: the one fastmm
    is imported from); None fields outside git."""
    if path is None:
        import fastmm

        path = Path(fastmm.__file__).resolve().parent
    top = _git(Path(path), "rev-parse", "--show-toplevel")
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


def library_versions() -> dict:
    """Versions of everything that decodes, loads or measures, None where absent."""
    versions = {name: _version(dist) for name, dist in (
        ("torch", "torch"), ("torchvision", "torchvision"), ("torchcodec", "torchcodec"),
        ("dali", "nvidia-dali-cuda130"), ("webdataset", "webdataset"), ("spdl", "spdl-io"),
        ("mosaicml_streaming", "mosaicml-streaming"), ("av", "av"),
        ("numpy", "numpy"), ("pillow", "pillow"), ("scikit_image", "scikit-image"),
        ("psutil", "psutil"), ("nvidia_ml_py", "nvidia-ml-py"))}
    import torch

    versions["torch"] = torch.__version__
    versions["cuda"] = torch.version.cuda
    try:
        from PIL import features

        versions["libjpeg_turbo"] = features.version("libjpeg_turbo")
    except Exception:
        versions["libjpeg_turbo"] = None
    versions["ffmpeg"] = _first_line(["ffmpeg", "-version"])
    return versions


def _first_line(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.splitlines()[0] if out.stdout else None


def numa_nodes() -> dict[str, str]:
    """NUMA node -> its CPU list (empty where the kernel shows none)."""
    nodes = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        try:
            nodes[node.name] = (node / "cpulist").read_text().strip()
        except OSError:
            pass
    return nodes


def gpus() -> dict:
    """GPU models, memory and driver (NVML, else torch.cuda) and nvidia-smi's topology matrix."""
    devices, driver = [], None
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            devices.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                            "memory_bytes": pynvml.nvmlDeviceGetMemoryInfo(handle).total})
    except Exception:  # no nvidia-ml-py or no driver: ask torch
        import torch

        if torch.cuda.is_available():
            devices = [{"index": i, "name": torch.cuda.get_device_name(i),
                        "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
                       for i in range(torch.cuda.device_count())]
    topology = None
    if devices and shutil.which("nvidia-smi"):
        try:
            topology = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True,
                                      text=True, timeout=20).stdout or None
            if topology:  # nvidia-smi underlines the header with terminal escapes even so
                topology = re.sub(r"\x1b\[[0-9;]*m", "", topology)
        except (OSError, subprocess.SubprocessError):
            pass
    return {"devices": devices, "driver": driver, "topology": topology}


def storage(paths) -> dict:
    """For each path: the mount it lives on (device, filesystem, options) and its space."""
    mounts = sorted(psutil.disk_partitions(all=True), key=lambda m: len(m.mountpoint),
                    reverse=True)
    out = {}
    for path in map(str, paths):
        real = os.path.realpath(path)
        mount = next((m for m in mounts if real == m.mountpoint
                      or real.startswith(m.mountpoint.rstrip("/") + "/")), None)
        entry = {"mountpoint": mount.mountpoint if mount else None,
                 "device": mount.device if mount else None,
                 "fstype": mount.fstype if mount else None,
                 "options": mount.opts if mount else None}
        try:
            usage = shutil.disk_usage(real)
            entry.update(total_bytes=usage.total, free_bytes=usage.free)
        except OSError:
            entry.update(total_bytes=None, free_bytes=None)
        out[path] = entry
    return out


def network() -> dict:
    """Network interfaces: up, link speed (Mb/s; 0 when the driver does not say), MTU."""
    try:
        stats = psutil.net_if_stats()
    except OSError:
        return {}
    return {name: {"up": s.isup, "speed_mbps": s.speed, "mtu": s.mtu}
            for name, s in sorted(stats.items())}


def shm_info(path: str) -> dict:
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return {"path": path, "total_bytes": None, "free_bytes": None}
    return {"path": path, "total_bytes": usage.total, "free_bytes": usage.free}


def module_argv(spec, name: str) -> list[str]:
    """The command line of a module run with ``python -m`` (its ``__name__`` is "__main__"
    then; its ``__spec__`` knows the real name)."""
    return ["python", "-m", spec.name if spec is not None else name, *sys.argv[1:]]


def capture(argv: list[str] | None = None, *, loader_config: dict | None = None,
            paths=()) -> dict:
    """Everything a result depends on, before measuring: commands, commits (fastmm's and the
    training code's, i.e. the working directory's), versions, CPU/NUMA/RAM, GPUs, /dev/shm,
    storage of ``paths`` (data, cache), network, and the loader's configuration."""
    import fastmm
    from fastmm.config import TransportConfig

    argv = sys.argv if argv is None else argv
    transport = TransportConfig.from_env()
    memory = psutil.virtual_memory()
    # FASTMM_* settings change what is measured: they belong to the command that reproduces it.
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith("FASTMM_")}
    import torch

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
        "versions": {"fastmm": getattr(fastmm, "__version__", None), **library_versions()},
        "fastmm_uses_cpp": fastmm.uses_cpp(),
        "fastmm_transport": dataclasses.asdict(transport),
        "cpu_model": cpu_model(),
        "cpu_count_logical": os.cpu_count(),
        "cpu_count_usable": usable_cores(),  # affinity, capped by a cgroup CPU quota
        "cgroup_cpu_quota_cores": cgroup_cpu_quota(),
        "numa_nodes": numa_nodes(),
        "ram_total_bytes": memory.total,
        "ram_available_bytes_at_start": memory.available,
        "dev_shm": shm_info("/dev/shm"),
        "slab_dir": shm_info(transport.shm_dir),
        "gpus": gpus(),
        "storage": storage(["/dev/shm", os.getcwd(), *paths]),
        "network": network(),
        "loader_config": loader_config,
        "torch_num_threads": torch.get_num_threads(),
        "multiprocessing_start_method": multiprocessing.get_start_method(allow_none=True)
        or multiprocessing.get_context().get_start_method(),
        "loadavg_at_start": list(os.getloadavg()),
        "git": git_state(),
        "training_code_git": git_state(os.getcwd()),
    }
