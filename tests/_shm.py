"""A private, size-limited tmpfs for tests that watch shared-memory use (needs root)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile

import pytest


@contextlib.contextmanager
def private_tmpfs(size: str, options: str = ""):
    """Mount a tmpfs of ``size`` (e.g. "64m"; more mount ``options`` such as "ro") and yield its
    path; skip where mounting is denied."""
    path = tempfile.mkdtemp(prefix="fastmm-shm-")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(filter(None, [f"size={size}", options])), "tmpfs",
         path], capture_output=True
    )
    if done.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); CI runs as root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)
        os.rmdir(path)


def used_bytes(path: str) -> int:
    return shutil.disk_usage(path).used
