"""The only reader of FASTMM_* environment variables.

Precedence everywhere: an explicit argument, then the environment variable, then the default.
A bad value raises ConfigError naming the variable, the value and what is accepted.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from typing import Literal

from .errors import FastmmWarning


class ConfigError(ValueError):
    """A FASTMM_* environment variable holds a value fastmm cannot use."""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use one of {_TRUE + _FALSE[:-1]}")


def _env_dir(name: str, default: str) -> str:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if not os.path.isdir(raw):
        raise ConfigError(f"{name}={raw!r} is not an existing directory")
    if not os.access(raw, os.W_OK | os.X_OK):
        raise ConfigError(f"{name}={raw!r} is not writable; use a directory this user can write")
    return raw


_shm_dirs_checked: dict[tuple[str, int], str] = {}  # (path, st_dev) -> its filesystem type


def _env_shm_dir(name: str, default: str) -> str:
    """A directory that can hold slabs: one it names is tried (an unnamed file, a page
    reserved), so that a /proc or /sys is refused here rather than the slabs silently going
    elsewhere; one on a disk is taken with a warning that the slabs will be files on disk."""
    raw = _env_dir(name, default)
    if os.environ.get(name) in (None, ""):
        return raw  # the default: where O_TMPFILE is refused, memfd holds the slabs instead
    key = (os.path.realpath(raw), os.stat(raw).st_dev)
    if key in _shm_dirs_checked:
        return raw
    fstype = filesystem_type(raw)
    try:
        fd = os.open(raw, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, 4096)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError(
            f"{name}={raw!r} cannot hold shared-memory slabs (a {fstype} directory: "
            f"{exc.strerror}); use a tmpfs such as /dev/shm") from None
    _shm_dirs_checked[key] = fstype
    if fstype not in ("tmpfs", "ramfs", "devtmpfs"):
        warnings.warn(
            f"{name}={raw!r} is on {fstype}, not a tmpfs: the slabs will be files on that disk "
            "(in the page cache while memory lasts, written back to the disk under pressure), "
            "slower than shared memory; /dev/shm or another tmpfs is what it is meant for",
            FastmmWarning, stacklevel=4)
    return raw


def filesystem_type(path: str) -> str:
    """The type of the filesystem ``path`` lies on (``tmpfs``, ``ext4``, ``proc``, ...), from
    /proc/self/mountinfo; "unknown" where that cannot tell."""
    target = os.path.realpath(path)
    best, fstype = "", "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
                sep = fields.index("-")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, fstype = mount, fields[sep + 1]
    except (OSError, ValueError, IndexError):
        pass
    return fstype


@dataclass(frozen=True)
class TransportConfig:
    """How worker processes run and hand their batches to the main process."""

    pure_python: bool = False  # FASTMM_PURE_PYTHON: force the NumPy twin of fastmm._C
    shm_dir: str = "/dev/shm"  # FASTMM_SHM_DIR: tmpfs that holds the slabs
    # FASTMM_SLAB_MEMORY: "auto" unmaps idle slabs when the loop leaves time to map them back;
    # "lean" unmaps every batch once read or sent, so batches waiting in the queue count in no
    # process (as torch's do), at the price of faulting every batch in twice.
    slab_memory: Literal["auto", "lean"] = "auto"
    # FASTMM_WORKER_MALLOC: "reuse" has glibc keep memory a worker frees for its next samples
    # (no fresh pages per decoded image); "system" leaves glibc's defaults, as torch's workers.
    worker_malloc: Literal["reuse", "system"] = "reuse"
    # FASTMM_SHARE_DATASET: the dataset's large lists, tuples and dicts shared with the workers,
    # read in place, instead of copied into each worker as it reads them (shared.py)
    share_dataset: bool = True

    @classmethod
    def from_env(cls) -> "TransportConfig":
        return cls(
            pure_python=_env_bool("FASTMM_PURE_PYTHON", False),
            shm_dir=_env_shm_dir("FASTMM_SHM_DIR", "/dev/shm"),
            slab_memory=_env_choice("FASTMM_SLAB_MEMORY", "auto", SLAB_MEMORY_MODES),
            worker_malloc=_env_choice("FASTMM_WORKER_MALLOC", "reuse", WORKER_MALLOC_MODES),
            share_dataset=_env_bool("FASTMM_SHARE_DATASET", True),
        )


SLAB_MEMORY_MODES = ("auto", "lean")
WORKER_MALLOC_MODES = ("reuse", "system")
TELEMETRY_MODES = ("off", "summary", "trace")


@dataclass(frozen=True)
class TelemetryConfig:
    """Telemetry fastmm.DataLoader turns on by itself (fastmm.telemetry.Telemetry otherwise)."""

    mode: Literal["off", "summary", "trace"] = "off"  # FASTMM_TELEMETRY
    directory: str = "fastmm-telemetry"  # FASTMM_TELEMETRY_DIR: where each epoch's exports go

    @classmethod
    def from_env(cls) -> "TelemetryConfig":
        directory = os.environ.get("FASTMM_TELEMETRY_DIR", "").strip() or cls.directory
        return cls(mode=_env_choice("FASTMM_TELEMETRY", "off", TELEMETRY_MODES),
                   directory=directory)

    def made_directory(self) -> str:
        """The export directory, made now: a bad FASTMM_TELEMETRY_DIR stops the run before its
        first epoch, not when that epoch's exports are written."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            if not os.access(self.directory, os.W_OK | os.X_OK):
                raise PermissionError(13, "not writable")
        except OSError as e:
            raise ConfigError(
                f"FASTMM_TELEMETRY_DIR={self.directory!r} cannot hold the telemetry exports "
                f"({e.strerror}); use a writable directory (default {type(self).directory!r})"
            ) from None
        return self.directory


SOURCE_KINDS = ("posix", "staged", "shards")


def _env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ConfigError(f"{name}={raw!r} is not a valid choice; use one of {choices}")
    return value


def _env_new_dir(name: str) -> str | None:
    """A directory fastmm may create and write in: it exists, or its parent does."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    there = raw if os.path.exists(raw) else os.path.dirname(os.path.abspath(raw))
    if not os.path.isdir(there):
        raise ConfigError(
            f"{name}={raw!r} is neither an existing directory nor inside one; use a directory path"
        )
    if not os.access(there, os.W_OK | os.X_OK):
        raise ConfigError(f"{name}={raw!r} is not writable; use a directory this user can write")
    return raw


@dataclass(frozen=True)
class SourceConfig:
    """Which storage source to open and where the staged source keeps its local copy."""

    kind: Literal["posix", "staged", "shards"] = "posix"  # FASTMM_SOURCE: one of SOURCE_KINDS
    stage_dir: str | None = None  # FASTMM_STAGE_DIR: local (NVMe) directory for staged copies

    @classmethod
    def from_env(cls) -> "SourceConfig":
        return cls(
            kind=_env_choice("FASTMM_SOURCE", "posix", SOURCE_KINDS),
            stage_dir=_env_new_dir("FASTMM_STAGE_DIR"),
        )

    @classmethod
    def resolve(cls, *, kind: str | None = None, stage_dir: str | None = None) -> "SourceConfig":
        """Explicit arguments win; the environment is read only for what is not given."""
        if kind is not None and kind not in SOURCE_KINDS:
            raise ValueError(f"unknown source kind {kind!r}; use one of {SOURCE_KINDS}")
        return cls(
            kind=kind if kind is not None else _env_choice("FASTMM_SOURCE", "posix", SOURCE_KINDS),
            stage_dir=stage_dir if stage_dir is not None else _env_new_dir("FASTMM_STAGE_DIR"),
        )


DECODE_BACKENDS = ("pil", "torchvision", "torchcodec", "dali")  # fastmm.decode.DECODERS, same order
_DEVICE = re.compile(r"^(cpu|cuda(:[0-9]+)?)$")


def _check_device(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if not _DEVICE.match(value):
        raise ConfigError(f"{name}={raw!r} is not a valid device; use 'cpu', 'cuda' or 'cuda:N'")
    return value


@dataclass(frozen=True)
class DecodeConfig:
    """Which decoder backend turns bytes into tensors, and on which device it decodes."""

    backend: Literal["pil", "torchvision", "torchcodec", "dali"] = "pil"  # FASTMM_DECODE
    device: str = "cpu"  # FASTMM_DEVICE: "cpu", "cuda" or "cuda:N"

    @classmethod
    def from_env(cls) -> "DecodeConfig":
        return cls.resolve()

    @classmethod
    def resolve(cls, *, backend: str | None = None, device: str | None = None) -> "DecodeConfig":
        """Explicit arguments win; the environment is read only for what is not given."""
        if backend is not None and backend not in DECODE_BACKENDS:
            raise ValueError(f"unknown decoder {backend!r}; use one of {DECODE_BACKENDS}")
        if backend is None:
            backend = _env_choice("FASTMM_DECODE", "pil", DECODE_BACKENDS)
        if device is not None:
            if not _DEVICE.match(str(device)):
                raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'")
            device = str(device)
        else:
            raw = os.environ.get("FASTMM_DEVICE")
            device = "cpu" if raw is None or raw.strip() == "" else _check_device("FASTMM_DEVICE", raw)
        return cls(backend=backend, device=device)


def decode_deadline(value: float | None) -> float | None:
    """Seconds one sample may take (read, decode, transform): the argument, then
    FASTMM_DECODE_DEADLINE, then none; 0 means none."""
    name = "FASTMM_DECODE_DEADLINE"
    if value is None:
        raw = os.environ.get(name, "").strip()
        try:
            value = float(raw) if raw else 0.0
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
        if not value >= 0 or value == float("inf"):
            raise ConfigError(f"{name}={raw!r} must be a finite number of seconds >= 0")
    elif not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
        raise ValueError(f"decode_deadline={value!r}; give seconds >= 0 (0 or None: none)")
    return float(value) or None


@dataclass(frozen=True)
class DistConfig:
    """This process's place in a distributed job: the arguments, else torch.distributed when it
    is initialised, else what torchrun exports (RANK, WORLD_SIZE), else one process."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def resolve(cls, *, rank: int | None = None, world_size: int | None = None) -> "DistConfig":
        """Arguments win; what they leave out comes from torch.distributed, then the torchrun
        environment (read only then: a stray RANK does not break explicit arguments)."""
        if rank is None or world_size is None:
            found = cls._from_process_group() or cls.from_env()
            rank = found.rank if rank is None else rank
            world_size = found.world_size if world_size is None else world_size
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
        return cls(rank, world_size)

    @staticmethod
    def _from_process_group() -> "DistConfig | None":
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        return DistConfig(dist.get_rank(), dist.get_world_size())

    @classmethod
    def from_env(cls) -> "DistConfig":
        world = _env_int("WORLD_SIZE", 1, low=1)
        rank = _env_int("RANK", 0, low=0)
        if rank >= world:
            raise ConfigError(f"RANK={rank} is not below WORLD_SIZE={world}")
        return cls(rank, world)


def _env_int(name: str, default: int, *, low: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < low:
        raise ConfigError(f"{name}={raw!r} must be at least {low}")
    return value


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise ConfigError(f"{name}={raw!r} must be a finite number of seconds above 0")
    return value


@dataclass(frozen=True)
class ObjectStoreConfig:
    """How s3:// reads retry and wait (endpoint, region and credentials come from the AWS
    chain: AWS_* variables, ~/.aws/config and ~/.aws/credentials)."""

    attempts: int = 5  # FASTMM_S3_ATTEMPTS: tries per request and per resumed read
    timeout_s: float = 30.0  # FASTMM_S3_TIMEOUT_S: connect and per-read socket wait

    @classmethod
    def resolve(cls, *, attempts: int | None = None,
                timeout_s: float | None = None) -> "ObjectStoreConfig":
        """Explicit arguments win; the environment is read only for what is not given."""
        return cls(
            attempts=attempts if attempts is not None else _env_int("FASTMM_S3_ATTEMPTS", 5,
                                                                    low=1),
            timeout_s=timeout_s if timeout_s is not None else _env_seconds(
                "FASTMM_S3_TIMEOUT_S", 30.0))
