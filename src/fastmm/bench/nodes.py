"""Multi-node torchrun jobs on one machine: one ``torchrun --nnodes N --node_rank K`` launch per
"node", as a cluster scheduler starts them (one per host), meeting at 127.0.0.1. Each node can
have its own environment (a node-local staging directory), as hosts would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class NodeRun:
    node: int
    returncode: int  # -9: killed (the time limit, or another node failed)
    output: str


def free_port() -> int:
    """A TCP port nothing listens on at 127.0.0.1 (the rendezvous's, a local server's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nnodes: int, nproc_per_node: int, node_rank: int, port: int,
                     argv: list[str]) -> list[str]:
    """The command a scheduler runs on node ``node_rank``: static rendezvous at node 0
    (``--master_addr``), as in a Slurm batch script."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--nproc_per_node={nproc_per_node}", f"--node_rank={node_rank}",
            "--master_addr=127.0.0.1", f"--master_port={port}", *argv]


def launch_nodes(nnodes: int, nproc_per_node: int, argv: list[str], *, env: dict | None = None,
                 node_env: Callable[[int], dict] | None = None, timeout_s: float = 600,
                 grace_s: float = 30,
                 on_line: Callable[[int, str], None] | None = None) -> list[NodeRun]:
    """Run ``argv`` (a script and its arguments, or ``-m module ...``) on ``nnodes`` launches
    and wait for all of them; ``on_line(node, line)`` sees their output as it comes. A launch
    that fails gets the others ``grace_s`` to end before they are killed (they would wait for
    it at the next collective); the time limit kills them all."""
    port = free_port()
    procs, outputs, readers = [], [], []
    for node in range(nnodes):
        node_vars = {**(env if env is not None else os.environ),
                     **(node_env(node) if node_env else {})}
        p = subprocess.Popen(
            torchrun_command(nnodes, nproc_per_node, node, port, argv), env=node_vars,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        lines: list[str] = []
        reader = threading.Thread(target=_read, args=(p.stdout, node, lines, on_line),
                                  daemon=True)
        reader.start()
        procs.append(p)
        outputs.append(lines)
        readers.append(reader)
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace_s)
        if time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            break
        time.sleep(0.2)
    for reader in readers:
        reader.join(10)
    return [NodeRun(node, p.returncode, "".join(lines))
            for node, (p, lines) in enumerate(zip(procs, outputs))]


def _read(stream, node: int, lines: list[str], on_line) -> None:
    for line in stream:
        lines.append(line)
        if on_line is not None:
            on_line(node, line)
