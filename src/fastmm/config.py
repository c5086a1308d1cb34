"""The only reader of FASTMM_* environment variables.

Precedence everywhere: an explicit argument, then the environment variable, then the default.
A bad value raises ConfigError naming the variable, the value and what is accepted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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
    return raw


@dataclass(frozen=True)
class TransportConfig:
    """How batches travel from workers to the main process."""

    pure_python: bool = False  # FASTMM_PURE_PYTHON: force the NumPy twin of fastmm._C
    shm_dir: str = "/dev/shm"  # FASTMM_SHM_DIR: tmpfs that holds the slabs

    @classmethod
    def from_env(cls) -> "TransportConfig":
        return cls(
            pure_python=_env_bool("FASTMM_PURE_PYTHON", False),
            shm_dir=_env_dir("FASTMM_SHM_DIR", "/dev/shm"),
        )
