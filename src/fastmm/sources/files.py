"""Samples from a directory tree (files ``<key>.<ext>`` sharing a key) or a JSON-lines manifest."""

from __future__ import annotations

import errno
import itertools
import json
import os
import stat
from typing import Callable, Iterator, Sequence

from .base import (
    NOT_SAMPLE_ERRNOS,
    OnReadError,
    Sample,
    Source,
    SourceError,
    check_split,
    name_problem,
    read_capped,
    slot_of,
    split_name,
)
from .s3 import S3Store, is_s3


class FileSource(Source):
    """A file per sample member: a directory tree or a manifest file, on a local file system or
    in an S3 store (source kind "posix"; ``PosixSource`` is its older name).

    Tree: every file ``<key>.<ext>`` below ``root`` (key = relative path up to the first dot of
    the file name, as webdataset splits) joins the sample ``key``; names starting with "." are
    ignored (they are lock, temp and index files); keys are sorted. Manifest (``root`` is a
    file): one JSON object per line, ``{"key": ..., "members": {"jpg": "rel/path.jpg", ...}}``,
    paths relative to the manifest's directory; samples keep the manifest's order.
    Either can be in an object store: ``s3://bucket/prefix/`` (the objects under it) or
    ``s3://bucket/path/manifest.jsonl``, each member one GET through ``store``.

    Args:
        root: the tree's directory or the manifest file, local or ``s3://``.
        on_error: "raise" or "skip" (see Source).
        required: extensions every sample must have, else it is reported as "missing_member".
        max_member_bytes: the most bytes one member may have; a larger one is "too_large".
        files: the tree's files (paths relative to ``root``), taken instead of listing it (a
            staged source's copies).
        before_open: called with each path (the manifest, a member) before it is opened: a
            staged source copies the file there first.
        keep_problems: how many of the latest problems ``problems`` keeps.
        store: the object store of an ``s3://`` root (default: an S3Store from the standard
            AWS configuration).
        rejected: (name, where, why) of files a listing named but nothing may read (a staged
            source's hostile names): each is a damaged sample "unsafe_name", raised or counted
            when reached, so a name is never lost without a count.
        _errors: the (skipped, problems) to count into, shared with a staged source; None:
            this source's own.
    """

    kind = "posix"

    def __init__(
        self,
        root: str,
        *,
        on_error: OnReadError = "raise",
        required: Sequence[str] = (),
        max_member_bytes: int = 1 << 31,
        files: Sequence[str] | None = None,
        before_open: Callable[[str], None] | None = None,
        keep_problems: int = 100,
        store: S3Store | None = None,
        rejected: Sequence[tuple[str, str, str]] = (),
        _errors=None,
    ):
        super().__init__(on_error=on_error, keep_problems=keep_problems, _errors=_errors)
        self._store = None
        if is_s3(root):
            self._store = store or S3Store()
            self._store.check(root)  # credentials, bucket, endpoint: a clear error now
            self._manifest = root.endswith((".jsonl", ".json"))
            self.root = root if self._manifest else root.rstrip("/")
            if self._manifest:
                self._store.head(self.root)  # FileNotFoundError for a typo
        else:
            self.root = os.path.abspath(root)
            if files is None and not os.path.exists(self.root):  # a typo, not an empty corpus
                raise FileNotFoundError(
                    errno.ENOENT, "no directory or manifest for the posix source", self.root)
            self._manifest = os.path.isfile(self.root) or self.root.endswith((".jsonl", ".json"))
        self.required = tuple(required)
        self.max_member_bytes = max_member_bytes
        self._files = None if files is None else list(files)
        self._rejected = list(rejected)
        self._before_open = before_open  # a staged source copies the file here first
        self._entries: list[tuple[str, dict[str, str], str, tuple[str, str] | None]] | None = None

    # -- index -------------------------------------------------------------------------------

    def _index(self):
        if self._entries is None:
            raw = self._scan_manifest() if self._manifest else self._scan_tree()
            entries = []
            raw = itertools.chain(raw, _rejected_entries(self._rejected))
            for key, members, origin, problem in raw:
                if problem is None:
                    missing = [e for e in self.required if e not in members]
                    if missing:
                        problem = ("missing_member", f"no {', '.join(missing)}")
                if problem is not None and self.on_error == "skip":
                    self.report(problem[0], key, origin, problem[1])
                    continue
                entries.append((key, members, origin, problem))
            self._entries = entries
        return self._entries

    def _scan_tree(self):
        unlisted: list[OSError] = []  # directories os.walk could not list
        rejected: list[tuple[str, str, str]] = []  # (key, its URL, why) from a store listing
        if self._files is not None:
            rels = sorted(self._files)
        elif self._store is not None:
            rels = []
            for rel, obj in self._store.files_under(self.root):
                why = name_problem(rel)
                if why is None:
                    rels.append(rel)
                else:
                    rejected.append((rel, obj.url, why))
        else:
            rels = []
            for dirpath, dirnames, filenames in os.walk(self.root, onerror=unlisted.append):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                rel_dir = os.path.relpath(dirpath, self.root)
                for name in filenames:
                    if not name.startswith("."):
                        rels.append(name if rel_dir == "." else f"{rel_dir}/{name}")
            rels.sort()
        groups: dict[str, tuple[dict[str, str], list]] = {}
        for rel in rels:
            key, ext = split_name(rel)
            if key is None or os.path.basename(rel).startswith("."):
                continue  # files without an extension are not sample members (README, LICENSE)
            members, dup = groups.setdefault(key, ({}, []))
            if ext in members:
                dup.append(rel)
            members[ext] = rel
        for key in sorted(groups):
            members, dup = groups[key]
            problem = ("duplicate_member", f"{dup[0]} repeats an extension") if dup else None
            yield key, members, os.path.join(self.root, key), problem
        yield from _rejected_entries(rejected)
        for e in unlisted:  # one damaged entry stands for a directory's unknown samples
            if e.errno in NOT_SAMPLE_ERRNOS:
                raise e
            rel = os.path.relpath(e.filename, self.root).replace(os.sep, "/")
            yield rel + "/", {}, e.filename, ("unreadable", f"directory not listed: {e.strerror}")

    def _scan_manifest(self):
        if self._before_open is not None:
            self._before_open(self.root)
        # bytes: a line that is not UTF-8 is one bad line
        with (self._store.open(self._store.head(self.root)) if self._store is not None
              else open(self.root, "rb")) as f:
            lines = read_capped(f, self.root).split(b"\n")
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            origin = f"{self.root}:{lineno}"
            try:
                obj = json.loads(line)
                key, members = obj["key"], obj["members"]
                ok = (
                    isinstance(key, str)
                    and isinstance(members, dict)
                    and all(
                        isinstance(k, str) and isinstance(v, str) for k, v in members.items()
                    )
                )
            except (ValueError, KeyError, TypeError, RecursionError):  # deep nesting
                ok, key, members = False, "", {}
            if not ok:
                yield (key if isinstance(key, str) else ""), {}, origin, (
                    "bad_manifest",
                    "not {key: str, members: {ext: path}}",
                )
                continue
            bad = [(p, why) for p in members.values() if (why := name_problem(p))]
            if bad:
                yield key, {}, origin, ("unsafe_name", f"member path {bad[0][0]!r}: {bad[0][1]}")
                continue
            yield key, {ext.lower(): p for ext, p in members.items()}, origin, None

    @property
    def _base(self) -> str:
        return os.path.dirname(self.root) if self._manifest else self.root

    # -- reading -----------------------------------------------------------------------------

    @property
    def reads_over_network(self) -> bool:
        return self._store is not None

    def keys(self) -> list[str]:
        return [e[0] for e in self._index()]

    def __len__(self) -> int:
        return len(self._index())

    def _load(self, index: int) -> tuple[Sample, tuple[str, str] | None]:
        key, members, origin, problem = self._index()[index]
        data: dict[str, bytes] = {}
        if problem is None:
            for ext, rel in members.items():
                path = os.path.join(self._base, rel)
                try:
                    if self._before_open is not None:
                        self._before_open(path)
                    blob, found = self._read_member(path, rel)
                    if found is None:
                        data[ext] = blob
                    else:
                        problem = found
                except SourceError as e:  # a staged copy that failed (staged source)
                    problem, origin = (e.reason, e.message), e.origin
                except OSError as e:
                    if e.errno in NOT_SAMPLE_ERRNOS:
                        raise
                    problem, origin = ("unreadable", f"{rel}: {e.strerror or e}"), path
        return Sample(key, data, origin), problem

    def _read_member(self, path: str, rel: str) -> tuple[bytes, tuple[str, str] | None]:
        """(the file's bytes, None), or (b"", the problem with it). Opened without blocking (a FIFO
        would wait for a writer forever) and read only if it is a regular file (a device never
        ends), never more than max_member_bytes of it (a file may grow after its size is
        taken, or say 0 on some file systems)."""
        cap = self.max_member_bytes
        if self._store is not None:  # no size asked first: one GET of at most cap + 1 bytes
            blob = self._store.read(path, 0, cap + 1)
            if len(blob) > cap:
                return b"", ("too_large", f"{rel} is over max_member_bytes")
            return blob, None
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return b"", ("not_a_file", f"{rel} is not a regular file")
            if st.st_size > cap:
                return b"", ("too_large", f"{rel} is {st.st_size} bytes, over max_member_bytes")
            parts = [f.read(st.st_size + 1)]  # one read, unless there is more than it said
            got = len(parts[0])
            while got > st.st_size and got <= cap and (more := f.read(1 << 20)):
                parts.append(more)
                got += len(more)
        if got > cap:
            return b"", ("too_large", f"{rel} grew past max_member_bytes while it was read")
        return b"".join(parts) if len(parts) > 1 else parts[0], None

    def extensions(self, index: int) -> tuple[str, ...]:
        return tuple(self._index()[index][1])

    def damaged(self, index: int) -> bool:
        return self._index()[index][3] is not None

    def read(self, index: int) -> Sample:
        """The sample at ``index``; with on_error="skip" a member that cannot be read is counted
        and left out (the sample cannot be skipped: the index is the caller's)."""
        sample, problem = self._load(index)
        if problem is not None:
            self.report(problem[0], sample.key, sample.origin, problem[1])
        return sample

    def iter_samples(
        self, rank: int = 0, world_size: int = 1, worker: int = 0, num_workers: int = 1
    ) -> Iterator[Sample]:
        """Samples in key order, split round-robin (see ``slot_of``); damaged ones are skipped
        and counted, or raise, as on_error says.

        Args:
            rank: the process's rank, from 0.
            world_size: ranks in the job.
            worker: the worker's id within its rank, from 0.
            num_workers: workers per rank.
        """
        check_split(rank, world_size, worker, num_workers)
        for i in range(len(self)):
            if slot_of(i, world_size, num_workers) == (rank, worker):
                sample, problem = self._load(i)
                if problem is None:
                    yield sample
                else:
                    self.report(problem[0], sample.key, sample.origin, problem[1])


def _rejected_entries(rejected):
    """Index entries for names nothing may read: damaged samples, never joined to a path."""
    for name, where, why in rejected:
        yield name, {}, where, ("unsafe_name", f"{name!r}: {why}")
