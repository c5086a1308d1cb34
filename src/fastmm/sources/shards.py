"""Tar shards in the WebDataset layout: members ``<key>.<ext>``, consecutive members with one key
form a sample (webdataset's own grouping, so both libraries read the same samples).

The tar headers are parsed here, not by ``tarfile``: we need the byte offsets for the index, we
must notice truncation (tarfile silently stops), and nothing is ever extracted or followed.
Nothing in a shard is unpickled; members stay raw bytes.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import stat
import struct
import tarfile
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Literal, Sequence

from .base import (
    NOT_SAMPLE_ERRNOS, OnReadError, ProgressLines, Sample, Source, SourceError, check_split,
    name_problem, slot_of, split_name, tar_member_path, to_stderr,
)
from .s3 import ObjectInfo, S3Store, is_s3

BLOCK = 512
_ZERO = bytes(BLOCK)
_MAX_EXT_HEADER = 1 << 20  # a pax or GNU long-name header larger than this is garbage


def index_cap(shard_size: int) -> int:
    """The most bytes an offset index of a shard of ``shard_size`` may take: each member costs
    the shard a 512-byte header and the index some 40 bytes and its name, so a larger one is
    not that shard's (it is ignored, and the shard scanned)."""
    return shard_size + (1 << 20)


@dataclass
class Member:
    """One tar header: ``kind`` is "file", "dir", "link" (sym/hard) or "special" (device, fifo)."""

    name: str | None
    kind: str
    header_offset: int
    data_offset: int
    size: int
    data: bytes | None = None
    problem: tuple[str, str] | None = None


def _num(field_: bytes) -> int:
    if field_[:1] in (b"\x80", b"\xff"):  # GNU base-256 for sizes over 8 GiB
        n = int.from_bytes(field_[1:], "big")
        return -n if field_[:1] == b"\xff" else n
    text = field_.split(b"\0", 1)[0].strip(b" \0")
    return int(text, 8) if text else 0


def _str(field_: bytes) -> str:
    return field_.split(b"\0", 1)[0].decode("utf-8", "replace")


def _pax(data: bytes) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(data):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        if not space - pos < length <= len(data) - pos:  # a record that goes nowhere or past the end
            raise ValueError(f"pax record length {length} at {pos}")
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        out[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        pos += length
    return out


def iter_members(f, *, read_data: bool, max_member_bytes: int = 1 << 31) -> Iterator[Member]:
    """Headers of a seekable tar file in order; stops at the end marker or the first damage.

    Damage is reported as a Member with ``problem`` set ("truncated", "bad_header") and is
    always the last one. Data is read only for regular files within ``max_member_bytes``."""
    file_size = f.seek(0, io.SEEK_END)
    pos, long_name, pax = 0, None, {}
    while True:
        f.seek(pos)
        block = f.read(BLOCK)
        if len(block) < BLOCK:  # every writer ends with zero blocks; their absence means a cut
            yield Member(
                None,
                "file",
                pos,
                pos,
                0,
                problem=("truncated", "archive ends without an end marker"),
            )
            return
        if block == _ZERO:
            return
        try:
            stored = _num(block[148:156])
            size = _num(block[124:136])
        except ValueError:
            stored, size = -1, 0
        typeflag = block[156:157]
        if "size" in pax and typeflag not in (b"x", b"g"):
            size = int(pax["size"]) if pax["size"].isascii() and pax["size"].isdigit() else -1
        if stored not in _checksums(block) or size < 0:
            why = "header checksum does not match" if size >= 0 else "negative or garbled size"
            yield Member(None, "file", pos, pos, 0, problem=("bad_header", why))
            return
        name = _str(block[:100])
        if block[257:263] == b"ustar\x00" and block[345:346] != b"\0":
            name = _str(block[345:500]) + "/" + name
        data_offset = pos + BLOCK
        pos = data_offset + (size + BLOCK - 1) // BLOCK * BLOCK
        if typeflag in (b"x", b"g", b"L", b"K"):  # extended headers describe the next member
            if size > _MAX_EXT_HEADER or data_offset + size > file_size:
                yield Member(
                    None,
                    "file",
                    data_offset - BLOCK,
                    data_offset,
                    size,
                    problem=("bad_header", "oversized or cut extended header"),
                )
                return
            f.seek(data_offset)
            ext = f.read(size)
            if typeflag == b"x":
                try:
                    pax = _pax(ext)
                except ValueError:
                    yield Member(
                        None,
                        "file",
                        data_offset - BLOCK,
                        data_offset,
                        size,
                        problem=("bad_header", "malformed pax header"),
                    )
                    return
            elif typeflag == b"L":
                long_name = _str(ext)
            continue
        name = pax.get("path", long_name or name)
        long_name, pax = None, {}
        kind = {
            b"0": "file",
            b"\0": "file",
            b"7": "file",
            b"5": "dir",
            b"1": "link",
            b"2": "link",
        }.get(typeflag, "special")
        m = Member(name, kind, data_offset - BLOCK, data_offset, size)
        if data_offset + size > file_size:
            m.problem = (
                "truncated",
                f"{name} needs {size} bytes, {max(0, file_size - data_offset)} left",
            )
            yield m
            return
        if kind == "file" and size > max_member_bytes:
            m.problem = (
                "too_large",
                f"{name} is {size} bytes, over max_member_bytes={max_member_bytes}",
            )
        elif read_data and kind == "file":
            f.seek(data_offset)
            m.data = f.read(size)
        yield m


@dataclass
class _Entry:
    key: str
    offset: int
    members: list = field(default_factory=list)  # (ext, data_offset, size, data or None)
    problem: tuple[str, str] | None = None


def _group(members: Iterable[Member]) -> Iterator[_Entry]:
    """Consecutive members sharing a key form one entry; a bad member marks its entry damaged."""
    cur: _Entry | None = None
    for m in members:
        if m.kind == "dir" and m.problem is None:
            continue
        key, ext = split_name(m.name) if m.name is not None else (None, None)
        problem = m.problem
        if problem is None:
            if m.kind != "file":
                problem = (
                    "not_a_file",
                    f"{m.name} is a {m.kind}; links and devices are not followed",
                )
            elif why := name_problem(tar_member_path(m.name)):
                problem = ("unsafe_name", f"member name {m.name!r}: {why}")
            elif key is None:
                problem = ("bad_name", f"{m.name!r} has no extension")
        if m.name is None and cur is not None:
            key = cur.key  # a cut or garbled header damages the sample it interrupts
        elif key is None:
            key = m.name or ""
        if cur is None or key != cur.key:
            if cur is not None:
                yield cur
            cur = _Entry(key, m.header_offset)
        if problem is not None:
            cur.problem = cur.problem or problem
        elif any(e == ext for e, *_ in cur.members):
            cur.problem = cur.problem or ("duplicate_member", f"{m.name} repeats an extension")
        else:
            cur.members.append((ext, m.data_offset, m.size, m.data))
    if cur is not None:
        yield cur


def _valid_index(entries, file_size: int) -> bool:
    """A cached index is used only if it could describe the shard: every member inside it, in
    order, after its sample's header, and every sample it calls sound named as a scan would
    allow (fuzz/fuzz.py index feeds it any bytes)."""

    def count(x) -> bool:
        return type(x) is int and x >= 0

    def member(m, after: int) -> bool:
        return (isinstance(m, list) and len(m) == 3 and isinstance(m[0], str)
                and count(m[1]) and count(m[2]) and after < m[1] and m[1] + m[2] <= file_size)

    if not isinstance(entries, list):
        return False
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
                and count(entry[1]) and isinstance(entry[2], list)):
            return False
        key, offset, members, problem = entry
        if not all(member(m, offset) for m in members):
            return False
        if problem is None and name_problem(tar_member_path(key)) is not None:
            return False
        if problem is not None and not (isinstance(problem, list) and len(problem) == 2
                                        and all(isinstance(p, str) for p in problem)):
            return False
    return True


class ShardSource(Source):
    """WebDataset-layout tar shards, on a file system or in an object store (read in place).

    Random access (``keys``/``read``) uses an offset index built by one header scan per shard,
    kept in memory (or also beside the shard: ``index_cache``). Over S3 a scan streams the
    shard front to back, unless ``index_cache="beside"`` finds that index published beside the
    shard (uploaded with it) for a shard of its size: then opening costs one small GET per
    shard, and every read checks its sample's tar header against the index ("stale_index"
    where they differ). ``read`` is one ranged GET per sample. ``iter_samples`` reads shards
    sequentially without the index; whole shards go round-robin to (rank, worker) pairs in
    webdataset's order (see ``slot_of``).

    Args:
        root: a directory (its ``*.tar``, sorted), one ``.tar`` file, or a list of them; or
            the same in an object store: ``s3://bucket/prefix`` (the ``.tar`` objects under
            it), ``s3://bucket/one.tar``, or a list of such URLs.
        on_error: "raise" or "skip" (see Source).
        required: extensions every sample must have, else it is reported as "missing_member".
        max_member_bytes: the most bytes one member may have; a larger one is "too_large".
        index_cache: "memory" keeps each shard's index in memory only; "beside" also in
            ``.<shard>.fastmm-idx.json`` next to the shard (reused while the shard's size and
            mtime match).
        before_open: called with a local shard's path before it is opened: a staged source
            copies the shard there first.
        keep_problems: how many of the latest problems ``problems`` keeps.
        progress: takes a line every 5 s, and one when it ends, from indexing that runs over
            5 s (default: stderr; None for none).
        store: the object store of ``s3://`` shards (default: an S3Store from the standard AWS
            configuration).
        rejected: (name, where, why) of shards a listing named but nothing may open (a staged
            source's hostile names): each comes after the others as a shard that cannot be
            opened, its samples one damaged entry, raised or counted when reached.
        _errors: the (skipped, problems) to count into, shared with a staged source; None:
            this source's own.
    """

    kind = "shards"

    def __init__(
        self,
        root: str | Sequence[str],
        *,
        on_error: OnReadError = "raise",
        required: Sequence[str] = (),
        max_member_bytes: int = 1 << 31,
        index_cache: Literal["memory", "beside"] = "memory",
        before_open: Callable[[str], None] | None = None,
        keep_problems: int = 100,
        progress: Callable[[str], None] | None = to_stderr,
        store: S3Store | None = None,
        rejected: Sequence[tuple[str, str, str]] = (),
        _errors=None,
    ):
        super().__init__(on_error=on_error, keep_problems=keep_problems, _errors=_errors)
        self._progress = progress
        self._store, self._objects = None, {}
        listed = list(root) if isinstance(root, (list, tuple)) else [root]
        if any(is_s3(p) for p in listed):
            self._store = store or S3Store()
            self._store.check(listed[0])  # credentials, bucket, endpoint: a clear error now
            if isinstance(root, (list, tuple)):
                self.shards = list(root)
            elif root.endswith(".tar"):
                self._objects = {root: self._store.head(root)}
                self.shards = [root]
            else:  # a "directory": the .tar objects directly under it, as os.listdir sees
                self._objects = {o.url: o for rel, o in self._store.files_under(root)
                                 if rel.endswith(".tar") and "/" not in rel}
                self.shards = list(self._objects)
        elif isinstance(root, (list, tuple)):
            self.shards = [os.path.abspath(p) for p in root]
        elif os.path.isdir(root):
            self.shards = sorted(
                os.path.join(os.path.abspath(root), n)
                for n in os.listdir(root)
                if n.endswith(".tar") and not n.startswith(".")
            )
        elif os.path.exists(root):
            self.shards = [os.path.abspath(root)]
        else:  # a typo, not an empty corpus
            raise FileNotFoundError(errno.ENOENT, "no shard directory or shard", root)
        self._refused = {where: ("unsafe_name", f"{name!r}: {why}") for name, where, why in rejected}
        self.shards += list(self._refused)
        if index_cache not in ("memory", "beside"):
            raise ValueError(f"index_cache={index_cache!r}; use 'memory' or 'beside'")
        self.required = tuple(required)
        self.max_member_bytes = max_member_bytes
        self.index_cache = index_cache
        self._before_open = before_open
        self._cursor = (-1, None, -1)  # (shard, open stream or None, where the last read ended)
        self._entries: list[tuple[int, str, int, list, tuple | None]] | None = None

    def _damage(self, entry: _Entry) -> tuple[str, str] | None:
        if entry.problem is None:
            missing = [e for e in self.required if not any(x == e for x, *_ in entry.members)]
            if missing:
                return ("missing_member", f"no {', '.join(missing)}")
        return entry.problem

    def _open(self, shard: str, buffering: int = 1 << 20):
        """The shard, buffered for reading through (scans, streams); ``buffering=0`` for one
        sample's span, which a buffered read would round up to a whole buffer (1 MiB read
        for a 100 KB image: 105 us against 17 us here)."""
        if self._store is not None:
            return self._store.open(self._object(shard), buffering or 1 << 20)
        if self._before_open is not None:
            self._before_open(shard)
        fd = os.open(shard, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO: no wait
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file", shard)
        return open(fd, "rb", buffering=buffering)

    def _object(self, shard: str) -> ObjectInfo:
        """Size and ETag of a shard in the store (listed, or asked once)."""
        if shard not in self._objects:
            self._objects[shard] = self._store.head(shard)
        return self._objects[shard]

    def _open_or_problem(self, shard: str, buffering: int = 1 << 20):
        """(the shard open, None), or (None, (reason, message)) for a shard that cannot be
        opened: gone, unreadable, refused, or a staged copy that failed."""
        if shard in self._refused:
            return None, self._refused[shard]
        try:
            return self._open(shard, buffering), None
        except SourceError as e:  # from staging on first touch
            return None, (e.reason, f"{e.message} ({e.origin})")
        except OSError as e:
            if e.errno in NOT_SAMPLE_ERRNOS:
                raise
            return None, ("unreadable", str(e))

    def _opened(self, shard: str):
        """The shard open, or None once a shard that cannot be opened is reported (raised or
        counted, as on_error says)."""
        f, problem = self._open_or_problem(shard)
        if problem is not None:
            self.report(problem[0], os.path.basename(shard), shard, problem[1])
        return f

    def _published_index(self, shard: str, cache: str) -> list | None:
        """The index published beside a shard in the store, if it is for an object of this
        size and could describe it (the mtime it was made with is the publisher's, not the
        object's: reads check headers instead), else None."""
        try:
            size = self._object(shard).size
            blob = self._store.read(cache, 0, index_cap(size) + 1)
            if len(blob) > index_cap(size):
                return None
            saved = json.loads(blob)
            if (saved["stamp"][0] == size and saved["stamp"][2] == self.max_member_bytes
                    and _valid_index(saved["entries"], size)):
                return saved["entries"]
        except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError):
            pass  # none published, or not usable (too large, too deep): the shard is scanned
        return None

    def _scan(self, shard: str) -> list:
        cache = os.path.join(os.path.dirname(shard), f".{os.path.basename(shard)}.fastmm-idx.json")
        if self._store is not None and self.index_cache == "beside":
            entries = self._published_index(shard, cache)
            if entries is not None:
                return entries
        f, problem = self._open_or_problem(shard)
        if problem is not None:  # one damaged entry stands for the shard's unknown samples
            return [[os.path.basename(shard), 0, [], list(problem)]]
        with f:
            if self.index_cache == "beside" and self._store is None:
                st = os.fstat(f.fileno())
                stamp = [st.st_size, st.st_mtime_ns, self.max_member_bytes]
                try:
                    with open(cache, encoding="utf-8") as c:
                        if os.fstat(c.fileno()).st_size > index_cap(st.st_size):
                            raise ValueError("larger than any index of this shard")
                        saved = json.load(c)
                    if saved["stamp"] == stamp and _valid_index(saved["entries"], st.st_size):
                        return saved["entries"]
                except (OSError, ValueError, KeyError, TypeError, RecursionError):
                    pass  # scanned again (too large, too deep, stale or garbled), and rewritten
            entries = []
            try:
                for e in _group(
                    iter_members(f, read_data=False, max_member_bytes=self.max_member_bytes)
                ):
                    entries.append([e.key, e.offset, [m[:3] for m in e.members], e.problem])
            except OSError as e:  # a read failing mid-scan (the store, past its retries)
                if e.errno in NOT_SAMPLE_ERRNOS:
                    raise
                # one damaged entry stands for the samples after the last one indexed
                return entries + [[os.path.basename(shard), 0, [], ["unreadable", str(e)]]]
        if self.index_cache == "beside" and self._store is None:
            tmp = f"{cache}.{os.getpid()}.tmp"
            try:  # a read-only shard directory just means the index stays in memory
                with open(tmp, "w", encoding="utf-8") as c:
                    json.dump({"stamp": stamp, "entries": entries}, c)
                os.replace(tmp, cache)
            except OSError:
                with contextlib.suppress(OSError):  # (a full disk: half of it was written)
                    os.unlink(tmp)
        return entries

    def _index(self):
        if self._entries is None:
            out = []
            meter = ProgressLines(self._progress, "indexing shards", len(self.shards), "shards")
            for s, shard in enumerate(self.shards):
                meter.update(s)
                for key, offset, members, problem in self._scan(shard):
                    problem = self._damage(
                        _Entry(key, offset, members, tuple(problem) if problem else None)
                    )
                    if problem is not None and self.on_error == "skip":
                        self.report(problem[0], key, f"{shard}:{offset}", problem[1])
                        continue
                    out.append((s, key, offset, members, problem))
            meter.update(len(self.shards), f" ({len(out):,} samples)")
            self._entries = out
        return self._entries

    def keys(self) -> list[str]:
        return [e[1] for e in self._index()]

    def __len__(self) -> int:
        return len(self._index())

    def extensions(self, index: int) -> tuple[str, ...]:
        return tuple(ext for ext, *_ in self._index()[index][3])

    def shard_of(self, index: int) -> int:
        return self._index()[index][0]

    def damaged(self, index: int) -> bool:
        return self._index()[index][4] is not None

    @property
    def reads_over_network(self) -> bool:
        return self._store is not None

    def read(self, index: int) -> Sample:
        """One sample by index: one seek and one read spanning its members."""
        return self._read(index, stream=True)

    def read_apart(self, index: int) -> Sample:
        return self._read(index, stream=False)

    def _read(self, index: int, stream: bool) -> Sample:
        s, key, offset, members, problem = self._index()[index]
        origin = f"{self.shards[s]}:{offset}"
        if problem is not None:
            self.report(problem[0], key, origin, problem[1])
            return Sample(key, {}, origin)
        if not members:
            return Sample(key, {}, origin)
        start = members[0][1]
        end = max(off + size for _, off, size in members)
        if self._store is not None:  # from the first member's header, to check it
            try:
                blob = (self._read_object_span(s, start - BLOCK, end) if stream else
                        self._store.read(self.shards[s], start - BLOCK, end - start + BLOCK,
                                         self._object(self.shards[s]).etag))
            except OSError as e:  # gone, changed, or the store failing past its retries
                self.report("unreadable", key, origin, str(e))
                return Sample(key, {}, origin)
            if len(blob) >= BLOCK and not _header_says(blob[:BLOCK], members[0][2]):
                self.report("stale_index", key, origin, "the shard's tar header there does "
                            "not match its index (the object changed since it was indexed)")
                return Sample(key, {}, origin)
            blob = blob[BLOCK:]
        else:
            f, problem = self._open_or_problem(self.shards[s], buffering=0)
            if problem is not None:  # gone or unreadable since it was indexed
                self.report(problem[0], key, origin, problem[1])
                return Sample(key, {}, origin)
            with f:
                blob = _read_span(f.fileno(), start, end - start)
        if len(blob) < end - start:
            self.report("truncated", key, origin, "shard is shorter than when it was indexed")
            return Sample(key, {}, origin)
        return Sample(
            key, {ext: blob[off - start : off - start + size] for ext, off, size in members}, origin
        )

    def _read_object_span(self, s: int, start: int, end: int) -> bytes:
        """Bytes ``start``..``end`` of shard ``s`` in the store. A read that goes on from where
        the last one in the same shard ended (a stream through the shard, as ShardStream reads)
        goes on along one GET read front to back; any other is one ranged GET of its span."""
        _, stream, last_end = self._cursor if self._cursor[0] == s else (s, None, -1)
        if last_end < 0 or not 0 <= start - last_end <= 1 << 20:
            self._close_cursor()
            blob = self._store.read(self.shards[s], start, end - start,
                                    self._object(self.shards[s]).etag)
            self._cursor = (s, None, end)
            return blob
        if stream is None:
            stream = self._store.open(self._object(self.shards[s]))
        stream.seek(start)
        blob = stream.read(end - start)
        self._cursor = (s, stream, end)
        return blob

    def _close_cursor(self) -> None:
        if self._cursor[1] is not None:
            self._cursor[1].close()
        self._cursor = (-1, None, -1)

    def __getstate__(self):  # an open stream stays in the process that opened it
        state = super().__getstate__()
        state["_cursor"] = (-1, None, -1)
        return state

    def shards_for(
        self, rank: int = 0, world_size: int = 1, worker: int = 0, num_workers: int = 1
    ) -> list[str]:
        """The shards (rank, worker) streams: shard ``i`` goes to ``slot_of(i, ...)``.

        Args:
            rank: the process's rank, from 0.
            world_size: ranks in the job.
            worker: the worker's id within its rank, from 0.
            num_workers: workers per rank.
        """
        check_split(rank, world_size, worker, num_workers)
        return [
            p
            for i, p in enumerate(self.shards)
            if slot_of(i, world_size, num_workers) == (rank, worker)
        ]

    def iter_samples(
        self, rank: int = 0, world_size: int = 1, worker: int = 0, num_workers: int = 1
    ) -> Iterator[Sample]:
        """Sequential read of this pair's shards; damaged samples are skipped and counted, or
        raise when reached, as on_error says. Samples before a truncation still come out.

        Args:
            rank: the process's rank, from 0.
            world_size: ranks in the job.
            worker: the worker's id within its rank, from 0.
            num_workers: workers per rank.
        """
        for shard in self.shards_for(rank, world_size, worker, num_workers):
            f = self._opened(shard)
            if f is None:
                continue
            with f:
                try:
                    for entry in _group(
                        iter_members(f, read_data=True, max_member_bytes=self.max_member_bytes)
                    ):
                        origin = f"{shard}:{entry.offset}"
                        problem = self._damage(entry)
                        if problem is None:
                            yield Sample(
                                entry.key, {ext: data for ext, _, _, data in entry.members},
                                origin)
                        else:
                            self.report(problem[0], entry.key, origin, problem[1])
                except OSError as e:  # a read failing mid-shard (the store, past its retries)
                    if e.errno in NOT_SAMPLE_ERRNOS:
                        raise
                    self.report("unreadable", os.path.basename(shard), shard, str(e))


def _header_says(block: bytes, size: int) -> bool:
    """Whether ``block`` is a tar header with a valid checksum for a member of ``size`` bytes
    (a pax size record is not visible here: a member over 8 GiB is taken on trust)."""
    try:
        stored, said = _num(block[148:156]), _num(block[124:136])
    except ValueError:
        return False
    return stored in _checksums(block) and (said == size or size >= 8 << 30)


def _checksums(block: bytes) -> tuple[int, int]:
    """The header checksum over unsigned bytes, and over signed ones (some old writers)."""
    return (sum(block[:148]) + 256 + sum(block[156:]),
            sum(struct.unpack("148b8x356b", block)) + 256)


def _read_span(fd: int, start: int, size: int) -> bytes:
    """``size`` bytes from ``start``, fewer only where the file ends first (a read may return
    less than asked: network and FUSE file systems, reads past 2 GiB)."""
    parts, got = [], 0
    while got < size:
        part = os.pread(fd, size - got, start + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def write_shards(
    samples: Iterable[Sample | tuple[str, dict[str, bytes]]],
    out_dir: str,
    *,
    max_bytes: int | None = None,
    max_count: int | None = None,
    prefix: str = "shard",
) -> list[str]:
    """Write samples as WebDataset tar shards ``<prefix>-000000.tar``, ... and return their paths.

    Deterministic (members sorted by extension, mtime 0, owner root, mode 0444), so the same
    samples give the same bytes. Each shard appears atomically (temp name, rename).

    Args:
        samples: Samples, or (key, {extension: bytes}) pairs.
        out_dir: where the shards go (made if missing).
        max_bytes: a new shard starts when the next sample would pass this many bytes of tar
            data; None: no cap.
        max_count: a new shard starts when the next sample would pass this many samples;
            None: no cap.
        prefix: the shards' file names' start.
    """
    os.makedirs(out_dir, exist_ok=True)
    paths: list[str] = []
    state: dict = {}

    def close():
        if state.get("tar") is not None:
            state["tar"].close()
            state["file"].close()
            os.replace(state["tmp"], paths[-1])
            state["tar"] = None

    def start():
        paths.append(os.path.join(out_dir, f"{prefix}-{len(paths):06d}.tar"))
        state["tmp"] = os.path.join(out_dir, f".{os.path.basename(paths[-1])}.tmp")
        state["file"] = open(state["tmp"], "wb")
        state["tar"] = tarfile.open(fileobj=state["file"], mode="w", format=tarfile.PAX_FORMAT)
        state["count"], state["bytes"] = 0, 0

    for item in samples:
        key, members = (item.key, item.members) if isinstance(item, Sample) else item
        if split_name(f"{key}.x") != (key, "x") or name_problem(key):
            raise ValueError(
                f"key {key!r} cannot be a shard key (no dot in its last part, no '..', not absolute)"
            )
        if not members or any(not e or "/" in e for e in members):
            raise ValueError(f"sample {key!r} needs members with non-empty extensions without '/'")
        size = sum(BLOCK + (len(v) + BLOCK - 1) // BLOCK * BLOCK for v in members.values())
        if (
            state.get("tar") is None
            or (max_count and state["count"] >= max_count)
            or (max_bytes and state["count"] and state["bytes"] + size > max_bytes)
        ):
            close()
            start()
        for ext in sorted(members):
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(members[ext]), 0, 0o444
            state["tar"].addfile(info, io.BytesIO(bytes(members[ext])))
        state["count"] += 1
        state["bytes"] += size
    close()
    return paths
