"""Child processes and waiting, for tests that count workers or wait for something to end."""

from __future__ import annotations

import time

import psutil


def live_children() -> set[int]:
    """Pids of this process's descendants that are still running (zombies left out)."""
    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_until(predicate, timeout: float = 10.0) -> bool:
    """Whether ``predicate()`` came true within ``timeout`` seconds (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def wait_for_children_to_go(before: set[int], seconds: float = 5.0) -> set[int]:
    """The children not in ``before`` still running after up to ``seconds``."""
    wait_until(lambda: not live_children() - before, seconds)
    return live_children() - before
