"""What every storage source shares: the Sample, the error type, the bad-input policy, splitting.

Sources deal in bytes only: they never import torch or the decode/slabs/collate modules, so a
source can be tested, pickled into workers and reused without a tensor library.
"""

from __future__ import annotations

import errno
import os
import re
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, NamedTuple

from ..errors import SampleError

OnReadError = Literal["raise", "skip"]

# read errors that are the process's, not the file's (out of descriptors or memory): they
# propagate, where counting them as bad samples could skip the rest of the corpus
NOT_SAMPLE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)

# A member name splits at the first dot of its last path component, as webdataset's
# base_plus_ext does ("a/b.seg.png" -> key "a/b", ext "seg.png"), so both group alike.
_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
# A manifest or file listing over this is refused whole (1 GiB: some 15 million samples).
MAX_MANIFEST_BYTES = 1 << 30


@dataclass(frozen=True)
class Sample:
    """One sample: ``members`` maps an extension ("jpg", "txt", ...) to raw bytes.

    ``origin`` says where it came from: a path, or ``"<shard path>:<byte offset>"``."""

    key: str
    members: dict[str, bytes]
    origin: str


class SourceError(SampleError):
    """Bad input met by a source; ``reason`` is the counter name used by on_error="skip"."""


class Problem(NamedTuple):
    reason: str
    key: str
    origin: str
    message: str


def split_name(name: str) -> tuple[str, str] | tuple[None, None]:
    """Key and lower-cased extension of a member name, or (None, None) if it has no extension."""
    m = _NAME.match(name)
    if not m:
        return None, None
    return m.group(1), m.group(2).lower()


def name_problem(name) -> str | None:
    """Why ``name`` (from a store listing, a manifest line, a tar member or an index entry)
    must not be joined to a local path or a URL, or None where it may. One check for every
    name from outside: joined to a root it stays under that root, names one thing only (no
    ``a//b`` or ``a/./b`` beside ``a/b``), and never turns into another bucket."""
    if not isinstance(name, str):
        return "not a string"
    if not name:
        return "empty name"
    if "\0" in name:
        return "NUL in name"
    if "\\" in name:
        return "backslash in name"
    if name.startswith("/"):
        return "absolute name"
    parts = name.split("/")
    if "" in parts:
        return "empty path part ('//' or a trailing '/')"
    if "." in parts or ".." in parts:
        return "'.' or '..' path part"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid UTF-8 (a lone surrogate)"
    return None


def tar_member_path(name: str) -> str:
    """A tar member's name as a relative path: without tar's own leading ``./`` (what ``tar -C
    dir -cf x.tar .`` writes), to be checked with ``name_problem``."""
    while name.startswith("./"):
        name = name[2:]
    return name


def read_capped(f, origin: str) -> bytes:
    """All of ``f`` (a manifest or a listing from outside), or SourceError "too_large" naming
    ``origin`` when it is over MAX_MANIFEST_BYTES: a hostile or runaway file never fills memory."""
    cap = MAX_MANIFEST_BYTES
    parts, got = [], 0
    while got <= cap and (chunk := f.read(min(1 << 20, cap + 1 - got))):
        parts.append(chunk)
        got += len(chunk)
    if got > cap:
        raise SourceError("too_large", "", origin, f"over {cap:,} bytes (MAX_MANIFEST_BYTES); "
                          "split the corpus into several manifests, or write it as tar shards")
    return b"".join(parts)


def check_split(rank: int, world_size: int, worker: int, num_workers: int) -> None:
    """ValueError unless (rank, worker) is one of the split's slots.

    Args:
        rank: the process's rank, from 0.
        world_size: ranks in the job.
        worker: the worker's id within its rank, from 0.
        num_workers: workers per rank.
    """
    if (
        world_size < 1
        or num_workers < 1
        or not 0 <= rank < world_size
        or not 0 <= worker < num_workers
    ):
        raise ValueError(
            f"need 0 <= rank < world_size and 0 <= worker < num_workers; got rank={rank}, "
            f"world_size={world_size}, worker={worker}, num_workers={num_workers}"
        )


def slot_of(i: int, world_size: int, num_workers: int) -> tuple[int, int]:
    """(rank, worker) that item ``i`` (a shard, or a posix sample) goes to.

    Same order as webdataset's split_by_node then split_by_worker: rank ``i % world_size``,
    then worker ``(i // world_size) % num_workers``; every item goes to exactly one pair."""
    return i % world_size, (i // world_size) % num_workers


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class ProgressLines:
    """Lines about a long pass over ``total`` units to ``say``: none in its first ``EVERY_S``
    seconds (a quick pass stays quiet), then one every ``EVERY_S`` and one when it ends.

    Args:
        say: takes each line (a source's ``progress``); None: no lines.
        what: what the pass does, as the lines name it ("indexing shards").
        total: units in the whole pass, which ``update(done)`` counts towards.
        unit: what a unit is ("shards", "MB"), for the lines.
    """

    EVERY_S = 5.0

    def __init__(self, say: Callable[[str], None] | None, what: str, total: float, unit: str):
        self.say, self.what, self.total, self.unit = say, what, total, unit
        self.start = self.last = time.monotonic()

    def update(self, done: float, detail: str = "") -> None:
        now = time.monotonic()
        ended = done >= self.total
        if self.say is None or not (now - self.last >= self.EVERY_S or (ended and self.last > self.start)):
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        left = "" if ended else f", about {(self.total - done) / max(rate, 1e-9):.0f} s left"
        self.say(f"fastmm: {self.what}: {done:,.0f}/{self.total:,.0f} {self.unit}{detail}, "
                 f"{now - self.start:.0f} s{left}")


class Source:
    """Base of all sources: random access by index and streaming, with one bad-input policy.

    on_error="raise": bad input raises SourceError when the damaged sample is read or reached.
    on_error="skip": damaged samples are left out of ``keys()`` and the stream, and counted in
    ``skipped`` (reason -> count, per process); ``problems`` keeps the last ``keep_problems``
    as (reason, key, origin, message)."""

    kind = "base"
    READ_AHEAD_THREADS = 16  # a batch's GETs in flight at once (boto3's connection pool holds 16)

    def __init__(self, *, on_error: OnReadError = "raise", keep_problems: int = 100, _errors=None):
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r}; use 'raise' or 'skip'")
        self.on_error = on_error
        if _errors is None:  # a staged source shares its counters with the source it wraps
            _errors = ({}, deque(maxlen=keep_problems))
        self.skipped: dict[str, int]
        self.problems: deque[Problem]
        self.skipped, self.problems = _errors
        self._read_ahead: tuple[int, ThreadPoolExecutor] | None = None  # (pid, threads)

    def report(self, reason: str, key: str, origin: str, message: str) -> None:
        """Raise or count one problem, as on_error says.

        Args:
            reason: a short counter name (SourceError's ``reason``).
            key: the sample's key.
            origin: where it is (the file, or ``shard.tar:offset``).
            message: what is wrong with it, in one line.
        """
        if self.on_error == "raise":
            raise SourceError(reason, key, origin, message)
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.problems.append(Problem(reason, key, origin, message))

    @property
    def reads_over_network(self) -> bool:
        """Whether reads wait on a network (an object store): then ``read_ahead`` overlaps
        them."""
        return False

    def read_ahead(self, indices: list[int]) -> dict[int, Future]:
        """Start reading ``indices`` at once, for a remote source ({} for a local one, where
        reads are quick): index -> a Future of what ``read`` would return or raise. A batch's
        reads then wait on the store's latency once, not once per sample."""
        if not self.reads_over_network or len(indices) < 2:
            return {}
        if self._read_ahead is None or self._read_ahead[0] != os.getpid():  # not after a fork
            self._read_ahead = (os.getpid(),
                                ThreadPoolExecutor(self.READ_AHEAD_THREADS, "fastmm-read"))
        pool = self._read_ahead[1]
        return {i: pool.submit(self.read_apart, i) for i in dict.fromkeys(indices)}

    def read_apart(self, index: int) -> Sample:
        """``read`` for a thread of its own: a source that keeps state between reads (a stream
        through a shard) reads here without it."""
        return self.read(index)

    def __getstate__(self):  # a read-ahead pool stays in the process that made it
        return {**self.__dict__, "_read_ahead": None}

    def keys(self) -> list[str]:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.keys())

    def read(self, index: int) -> Sample:
        raise NotImplementedError

    def extensions(self, index: int) -> tuple[str, ...]:
        """The member extensions of sample ``index``, from the index alone (nothing is read)."""
        raise NotImplementedError

    def shard_of(self, index: int) -> int | None:
        """Which tar shard sample ``index`` is in (their order in the source), or None."""
        return None

    def damaged(self, index: int) -> bool:
        """Known from the index alone to be damaged (reading it reports how)."""
        return False

    def iter_samples(
        self, rank: int = 0, world_size: int = 1, worker: int = 0, num_workers: int = 1
    ) -> Iterator[Sample]:
        """The samples of one (rank, worker) slot, read front to back; every sample goes to
        exactly one slot.

        Args:
            rank: the process's rank, from 0.
            world_size: ranks in the job.
            worker: the worker's id within its rank, from 0.
            num_workers: workers per rank.
        """
        raise NotImplementedError
