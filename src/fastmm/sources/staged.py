"""Copy a slow source (a mount, an HTTP URL, or an S3 prefix) to a local staging directory, then read it there.

Every file lands atomically (temporary name, verified size and sha256, then ``os.replace``), so a
reader never sees half a file; ``fcntl.flock`` locks in the staging directory let several ranks of
a node stage at once and copy each file once (the others wait); the time and bytes spent are kept
in ``staging_cost`` so studies can charge them.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import hashlib
import http.client
import json
import os
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator, Literal

from ..config import SourceConfig
from .base import (
    OnReadError, ProgressLines, Sample, Source, SourceError, name_problem,
    read_capped, tar_member_path, to_stderr,
)
from .files import FileSource
from .s3 import ObjectInfo, S3Store, is_s3
from .shards import ShardSource, iter_members

MANIFEST = ".fastmm-files.jsonl"  # {"path", "size", "sha256"} per line; needed for HTTP roots
META = ".fastmm-stage"  # locks, records and temporary files inside the staging directory
_CHUNK = 1 << 20
_LOCKS = 64  # files hash to this many lock files: parallel enough, and no lock file per file


def corpus_dir_name(remote: str) -> str:
    """The directory under the stage directory that holds the copy of ``remote``: its last path
    part (readable) and a hash of the whole (two corpora named "val" stay apart)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", remote.rstrip("/").rsplit("/", 1)[-1]) or "root"
    return f"{name[:64]}-{hashlib.sha1(remote.encode()).hexdigest()[:12]}"


class StagingError(RuntimeError):
    """The staging directory cannot take a copy (full, over quota, or not writable): the run's
    problem, not a sample's, so no on_error policy counts it; it stops the loop with the
    remedy."""


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None = None
    mtime_ns: int | None = None
    etag: str | None = None


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _parents(path: str) -> list[str]:
    """The directories ``path`` lies in: "a/b/c" -> ["a/b", "a"]."""
    return [path.rsplit("/", n)[0] for n in range(1, path.count("/") + 1)]


def _raise(error: OSError):
    raise error


def _walk(root: str) -> Iterator[str]:
    """Relative paths of regular files, sorted; dot names and symlinks are left out (not
    followed). A directory that cannot be listed raises: what it holds would not be staged."""
    for dirpath, dirnames, filenames in os.walk(root, onerror=_raise):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if not name.startswith(".") and not os.path.islink(full) and os.path.isfile(full):
                yield os.path.relpath(full, root).replace(os.sep, "/")


def write_file_manifest(root: str) -> str:
    """Write ``root/.fastmm-files.jsonl`` (path, size, sha256 of every file) and return its path.

    With it, staging checks each copy against the publisher's checksum, and an HTTP root can
    be listed at all."""
    lines = [
        json.dumps(
            {
                "path": rel,
                "size": os.path.getsize(os.path.join(root, rel)),
                "sha256": _sha256_file(os.path.join(root, rel)),
            }
        )
        for rel in _walk(root)
    ]
    out = os.path.join(root, MANIFEST)
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    os.replace(out + ".tmp", out)
    return out


class StagedSource(Source):
    """Stage ``root`` into a directory of its own under ``stage_dir``, then read it with the
    ``inner`` source from there.

    Names in the listing that cannot be staged safely (see ``_listing``) are never copied: with
    on_error="raise" they raise SourceError "unsafe_name" when the source opens; with "skip"
    they are counted; with ``defer_failures`` and "raise" they reach the inner source as
    damaged samples (posix) or shards (shards), raised when read, so a dataset's own policy
    counts them (``rejected`` keeps them, with where they were listed and why).
    ``staging_cost``: this process's seconds (copying, verifying and waiting for other stagers),
    bytes and files it copied itself, and bytes/s.

    Args:
        root: what to stage: a directory, an ``http(s)://`` URL or an ``s3://bucket/prefix``.
        stage_dir: the local directory the copy goes under, in a directory of its own
            (``self.stage_dir``: ``<root's name>-<hash of root>``); default FASTMM_STAGE_DIR.
        inner: the source that reads the staged copy, "posix" or "shards".
        mode: "before" copies everything when opened; "on_touch" copies a file when it is
            first read.
        max_bytes: caps the staged size (checked before copying; a clear SourceError
            "stage_cap"); None: no cap.
        max_member_bytes: the most bytes one member may have (the inner source's cap, and
            ``extract``'s).
        extract: True (mode "before", inner "posix") unpacks staged ``.tar`` files into
            ``<name>/``: member names are validated, links and devices never created, sizes
            capped, and nothing is written outside the staging directory.
        entry: the path inside the staged tree the inner source opens (e.g. a posix manifest).
        on_error: "raise" or "skip" (see Source).
        defer_failures: a file that fails to stage in mode "before" (unreadable, wrong size or
            checksum) raises there, unless this is set: then it is tried again when its
            samples are read, where a failure is those samples', raised or counted as on_error
            says (a ``.tar`` to extract still raises: its samples are unknown until it is
            unpacked). Default: on_error == "skip"; MultimodalDataset sets it when its own
            policy skips or replaces.
        timeout_s: seconds an ``http(s)://`` request may wait.
        keep_problems: how many of the latest problems ``problems`` keeps.
        progress: a staging pass that runs over 5 s sends a line here every 5 s and when it
            ends (default: stderr; None for none).
        **inner_options: go to the inner source; but ``store``, an S3Store, is the one an
            ``s3://`` root is staged through.
    """

    kind = "staged"

    def __init__(
        self,
        root: str,
        stage_dir: str | None = None,
        *,
        inner: Literal["posix", "shards"] = "posix",
        mode: Literal["before", "on_touch"] = "before",
        max_bytes: int | None = None,
        max_member_bytes: int = 1 << 31,
        extract: bool = False,
        entry: str = "",
        on_error: OnReadError = "raise",
        defer_failures: bool | None = None,
        timeout_s: float = 60.0,
        keep_problems: int = 100,
        progress: Callable[[str], None] | None = to_stderr,
        **inner_options,
    ):
        super().__init__(on_error=on_error, keep_problems=keep_problems)
        stage_dir = SourceConfig.resolve(kind="staged", stage_dir=stage_dir).stage_dir
        if stage_dir is None:
            raise ValueError(
                "the staged source needs stage_dir= or FASTMM_STAGE_DIR (a local directory)"
            )
        if inner not in ("posix", "shards") or mode not in ("before", "on_touch"):
            raise ValueError(
                f"inner={inner!r} (use 'posix' or 'shards'), mode={mode!r} (use 'before' or 'on_touch')"
            )
        if extract and (mode != "before" or inner != "posix"):
            raise ValueError("extract=True needs mode='before' and inner='posix'")
        if entry and name_problem(entry):
            raise ValueError(f"entry={entry!r} must be a relative path inside the staged tree")
        url = root.startswith(("http://", "https://")) or is_s3(root)
        self.remote = root.rstrip("/") if url else os.path.abspath(root)
        self._url = root.startswith(("http://", "https://"))
        self._s3 = None
        if is_s3(root):
            self._s3 = inner_options.pop("store", None) or S3Store()
            self._s3.check(self.remote + "/")  # credentials, bucket, endpoint: a clear error now
        # each corpus in a directory of its own: a training and a validation set staged under
        # one FASTMM_STAGE_DIR share file names (shard-000000.tar), and must not share copies
        self.stage_dir = os.path.join(os.path.abspath(stage_dir), corpus_dir_name(self.remote))
        self.mode, self.extract, self.timeout_s = mode, extract, timeout_s
        self.defer_failures = on_error == "skip" if defer_failures is None else defer_failures
        self.max_bytes, self.max_member_bytes = max_bytes, max_member_bytes
        try:
            for sub in ("locks", "records", "tmp"):
                os.makedirs(os.path.join(self.stage_dir, META, sub), exist_ok=True)
        except OSError as e:
            raise self._staging_error(f"staging {self.remote}", e) from e
        for bucket in self._buckets_in_tmp():  # before the space check: a dead stager's copies
            with self._lock(bucket, wait=False) as held:
                if held:
                    self._remove_stale(bucket)
        self.staging_cost = {"seconds": 0.0, "bytes": 0, "bytes_per_s": 0.0, "files": 0}
        self.staging_failed: list[str] = []  # mode "before", deferred: tried again when read
        self._by_path: dict[str, RemoteFile] = {}
        self.rejected: list[tuple[str, str, str]] = []  # (name, where listed, why): not staged
        self.files = self._listing()
        self._by_path = {f.path: f for f in self.files}
        self._done: set[str] = set()
        total = sum(f.size for f in self.files)
        if max_bytes is not None and total > max_bytes:
            raise SourceError(
                "stage_cap",
                "",
                self.remote,
                f"staging needs {total} bytes, over max_bytes={max_bytes}",
            )
        if mode == "before":
            need = sum(f.size for f in self.files if not self._is_staged(f))
            free = shutil.disk_usage(self.stage_dir).free
            if need > free:
                raise StagingError(
                    f"staging needs {need:,} more bytes in {self.stage_dir}, which has {free:,} "
                    "free; free space there, or stage to a larger disk (stage_dir= or "
                    "FASTMM_STAGE_DIR)")
            self._stage_all(progress)
        # mode "before" keeps the hook only for files it could not stage: they are tried again
        # when read, where a failure is that sample's, raised or counted as on_error says
        hook = self._touch if mode == "on_touch" or self.staging_failed else None
        errors = (self.skipped, self.problems)
        if inner == "posix":
            prefix = entry.rstrip("/") + "/" if entry else ""  # entry: a manifest, or a subtree
            staged = [path for f in self.files for path in self._copied_paths(f)]
            files = [path[len(prefix) :] for path in staged if path.startswith(prefix)]
            self.inner: Source = FileSource(
                os.path.join(self.stage_dir, entry),
                files=files,
                rejected=self.rejected,
                before_open=hook,
                on_error=on_error,
                max_member_bytes=max_member_bytes,
                _errors=errors,
                **inner_options,
            )
        else:
            shards = (
                [os.path.join(self.stage_dir, entry)]
                if entry
                else [
                    os.path.join(self.stage_dir, f.path)
                    for f in self.files
                    if f.path.endswith(".tar")
                ]
            )
            inner_options.setdefault(
                "index_cache", "beside"
            )  # the staging directory is ours to write
            unread = [r for r in self.rejected if not r[0].endswith(".tar")]
            if unread and progress is not None:  # no shard reader would reach them: named here
                progress(f"not staged: {len(unread)} listed names that cannot be staged safely, "
                         f"e.g. {unread[0][0]!r} ({unread[0][2]})")
            self.inner = ShardSource(
                shards,
                rejected=[r for r in self.rejected if r[0].endswith(".tar")],
                before_open=hook,
                progress=progress,
                on_error=on_error,
                max_member_bytes=max_member_bytes,
                _errors=errors,
                **inner_options,
            )

    # -- the source interface: all reading happens in the staged copy ------------------------

    def keys(self) -> list[str]:
        return self.inner.keys()

    def __len__(self) -> int:
        return len(self.inner)

    def read(self, index: int) -> Sample:
        return self.inner.read(index)

    def extensions(self, index: int) -> tuple[str, ...]:
        return self.inner.extensions(index)

    def shard_of(self, index: int) -> int | None:
        return self.inner.shard_of(index)

    def damaged(self, index: int) -> bool:
        return self.inner.damaged(index)

    def iter_samples(
        self, rank: int = 0, world_size: int = 1, worker: int = 0, num_workers: int = 1
    ) -> Iterator[Sample]:
        """The inner source's samples of one (rank, worker) slot, read from the staged copy.

        Args:
            rank: the process's rank, from 0.
            world_size: ranks in the job.
            worker: the worker's id within its rank, from 0.
            num_workers: workers per rank.
        """
        return self.inner.iter_samples(rank, world_size, worker, num_workers)

    # -- staging -----------------------------------------------------------------------------

    def _open_remote(self, rel: str):
        if self._s3 is not None:
            f = self._by_path.get(rel)
            url = f"{self.remote}/{rel}"
            info = ObjectInfo(url, f.size, f.etag) if f and f.etag else self._s3.head(url)
            return self._s3.open(info)
        if self._url:
            return urllib.request.urlopen(
                self.remote.rstrip("/") + "/" + urllib.parse.quote(rel), timeout=self.timeout_s
            )
        fd = os.open(os.path.join(self.remote, rel), os.O_RDONLY | os.O_NOFOLLOW)
        return os.fdopen(fd, "rb")

    def _listing(self) -> list[RemoteFile]:
        """The remote's files whose copies can land in the staging directory. Each other one is
        raised or counted ("unsafe_name", as on_error says) with its name: a name that fails
        ``name_problem``, one that names the staging directory's own records, or one whose
        copy would land on another's (a file and a directory of one name, a ``.tar`` unpacked
        over another file), which would overwrite or delete it."""
        listed = self._remote_files()
        finals = collections.Counter(self._final(f.path) for f, _, why in listed if why is None)
        dirs = {parent for final in finals for parent in _parents(final)}
        out = []
        for f, where, why in listed:
            final = self._final(f.path)
            if why is None:
                if name_problem(final) or final.split("/")[0] == META:
                    why = f"its copy would be {final!r}, which the staging directory keeps for itself"
                elif (finals[final] > 1 or final in dirs
                      or any(parent in finals for parent in _parents(final))):
                    why = (f"its copy {final!r} would land on another listed file's (a file and a "
                           "directory of one name, or a .tar unpacked over another file)")
            if why is None:
                out.append(f)
            elif self.defer_failures and self.on_error == "raise":
                self.rejected.append((f.path, where, why))  # the inner source's damaged ones
            else:
                self.report("unsafe_name", f.path, where, why)  # raised now, or counted
        return out

    def _remote_files(self) -> list[tuple[RemoteFile, str, str | None]]:
        """(file, where it was listed, ``name_problem`` of its path) for each file the remote's
        manifest lists, else the objects under an S3 prefix, else a local walk."""
        manifest = f"{self.remote}/{MANIFEST}"
        try:
            with self._open_remote(MANIFEST) as f:  # a bad line fails as that line
                text = read_capped(f, manifest).decode("utf-8", "replace")
        except (OSError, urllib.error.URLError) as e:
            if self._s3 is not None and isinstance(e, FileNotFoundError):  # no manifest: list
                return [(RemoteFile(rel, o.size, etag=o.etag), o.url, name_problem(rel))
                        for rel, o in self._s3.files_under(self.remote)]
            if self._url or self._s3 is not None:
                raise SourceError(
                    "no_listing",
                    "",
                    self.remote,
                    f"{MANIFEST} could not be read ({e}); an HTTP root needs one (see "
                    "write_file_manifest)",
                ) from e
            out = []
            for rel in _walk(self.remote):
                st = os.stat(os.path.join(self.remote, rel))
                out.append((RemoteFile(rel, st.st_size, None, st.st_mtime_ns),
                            os.path.join(self.remote, rel), None))
            return out
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                rf = RemoteFile(obj["path"], int(obj["size"]), obj.get("sha256"))
                if not isinstance(rf.path, str) or rf.size < 0:
                    raise ValueError(f"path {rf.path!r} is not a string, or size {rf.size} < 0")
            except (ValueError, KeyError, TypeError, RecursionError) as e:  # deep nesting
                raise SourceError("bad_manifest", "", f"{manifest}:{n}", str(e)[:300]) from e
            out.append((rf, f"{manifest}:{n}", name_problem(rf.path)))
        return out

    def _final(self, path: str) -> str:
        """Where ``path``'s copy lands in the staging directory: a ``.tar`` to extract becomes
        the directory it unpacks to."""
        return path[: -len(".tar")] if self.extract and path.endswith(".tar") else path

    def _stamp(self, f: RemoteFile) -> dict:
        if f.sha256:
            return {"size": f.size, "sha256": f.sha256}
        if f.etag:
            return {"size": f.size, "etag": f.etag}
        return {"size": f.size, "mtime_ns": f.mtime_ns}

    def _record(self, f: RemoteFile) -> str:
        return os.path.join(
            self.stage_dir, META, "records", hashlib.sha1(f.path.encode()).hexdigest() + ".json"
        )

    def _is_staged(self, f: RemoteFile) -> bool:
        try:
            with open(self._record(f), encoding="utf-8") as r:
                rec = json.load(r)
            if rec["path"] != f.path or rec["source"] != self._stamp(f):
                return False
            final = os.path.join(self.stage_dir, rec["final"])
            return os.path.isdir(final) if rec["extracted"] else os.path.getsize(final) == f.size
        except (OSError, ValueError, KeyError):
            return False

    def _stage_all(self, progress: Callable[[str], None] | None) -> None:
        total = sum(f.size for f in self.files)
        meter = ProgressLines(progress, f"staging {self.remote} -> {self.stage_dir}",
                              total / 1e6, "MB")
        done = 0
        for n, f in enumerate(self.files, 1):
            try:
                self._ensure(f)
            except SourceError as e:
                # an extracted tar's samples are not known until it is unpacked: nothing to count
                if not self.defer_failures or (self.extract and f.path.endswith(".tar")):
                    raise
                self.staging_failed.append(f.path)
                if progress is not None:
                    progress(f"staging {f.path} failed ({e}); its samples are tried again, "
                             "and counted if they fail, when read")
            done += f.size
            meter.update(done / 1e6, f" ({n}/{len(self.files)} files)")

    def _touch(self, path: str) -> None:
        rel = os.path.relpath(path, self.stage_dir).replace(os.sep, "/")
        if rel not in self._done and rel in self._by_path:
            self._ensure(self._by_path[rel])

    @contextlib.contextmanager
    def _lock(self, bucket: int, wait: bool = True):
        """Hold a bucket's lock (yields True), or, with wait=False, yield False if another
        process holds it. flock is released when the file closes, also if the process dies."""
        try:
            lock = open(os.path.join(self.stage_dir, META, "locks", f"{bucket:02d}.lock"), "a+")
        except OSError as e:  # (a full disk with no inode left for a first lock file, say)
            raise self._staging_error("opening a lock file", e) from e
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True

    def _buckets_in_tmp(self) -> set[int]:
        names = os.listdir(os.path.join(self.stage_dir, META, "tmp"))
        return {int(n[:2]) for n in names if n[:2].isdigit() and n[2:3] == "-"}

    def _remove_stale(self, bucket: int) -> None:
        """Remove the bucket's temporary files. Only a copy under the bucket's lock writes them,
        so with the lock held any that remain were left by a stager that died mid-copy."""
        tmp = os.path.join(self.stage_dir, META, "tmp")
        for name in os.listdir(tmp):
            if name.startswith(f"{bucket:02d}-"):
                path = os.path.join(tmp, name)
                if os.path.isdir(path):  # an extraction's .d
                    shutil.rmtree(path)
                else:
                    os.unlink(path)

    def _ensure(self, f: RemoteFile) -> None:
        """Stage one file unless it already is; under its lock, so concurrent stagers copy once."""
        t0 = time.perf_counter()
        bucket = int(hashlib.sha1(f.path.encode()).hexdigest(), 16) % _LOCKS
        with self._lock(bucket):
            if not self._is_staged(f):
                self._remove_stale(bucket)
                self._copy(f, bucket)
                self.staging_cost["bytes"] += f.size
                self.staging_cost["files"] += 1
        self._done.add(f.path)
        cost = self.staging_cost
        cost["seconds"] += time.perf_counter() - t0
        cost["bytes_per_s"] = cost["bytes"] / cost["seconds"] if cost["seconds"] > 0 else 0.0

    def _copy(self, f: RemoteFile, bucket: int) -> None:
        tmp = os.path.join(self.stage_dir, META, "tmp", f"{bucket:02d}-{uuid.uuid4().hex}")
        origin = f"{self.remote}/{f.path}"
        try:
            h, n = hashlib.sha256(), 0
            with self._open_remote(f.path) as src, open(tmp, "wb") as dst:
                while n <= f.size and (chunk := src.read(min(_CHUNK, f.size + 1 - n))):
                    n += len(chunk)
                    h.update(chunk)
                    dst.write(chunk)
            if n != f.size:
                raise SourceError(
                    "size",
                    f.path,
                    origin,
                    f"got {'more than ' if n > f.size else ''}{n} bytes, expected {f.size}",
                )
            digest = h.hexdigest()
            if f.sha256 and digest != f.sha256:
                raise SourceError(
                    "checksum", f.path, origin, f"sha256 {digest} != listed {f.sha256}"
                )
            if _sha256_file(tmp) != digest:  # what landed on the local disk, read back
                raise SourceError("checksum", f.path, tmp, "local copy differs from the bytes read")
            final = self._final(f.path)
            extracted = final != f.path
            dest = os.path.join(self.stage_dir, final)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if extracted:
                out = tmp + ".d"
                self._extract(tmp, out, origin)
                if os.path.isdir(dest):
                    shutil.rmtree(dest)
                os.replace(out, dest)
                os.unlink(tmp)
            else:
                os.replace(tmp, dest)
            rec = {
                "path": f.path,
                "final": final,
                "extracted": extracted,
                "size": f.size,
                "sha256": digest,
                "source": self._stamp(f),
            }
            with open(tmp + ".rec", "w", encoding="utf-8") as r:
                json.dump(rec, r)
            os.replace(tmp + ".rec", self._record(f))
        except BaseException as e:
            for leftover in (tmp, tmp + ".rec"):
                if os.path.lexists(leftover):
                    os.unlink(leftover)
            if os.path.isdir(tmp + ".d"):
                shutil.rmtree(tmp + ".d")
            if self._local_failure(e):
                raise self._staging_error(f"staging {f.path}", e) from e
            if isinstance(e, (urllib.error.URLError, http.client.HTTPException, OSError)) \
                    and not isinstance(e, SourceError):  # the remote's (a dropped connection)
                raise SourceError("unreadable", f.path, origin, str(e) or repr(e)) from e
            raise

    def _copied_paths(self, f: RemoteFile) -> list[str]:
        """The paths of ``f``'s copy: its own, or the files unpacked from it (the source's
        listing now: what a tar removed since left behind is not read)."""
        final = self._final(f.path)
        if final == f.path:
            return [f.path]
        top = os.path.join(self.stage_dir, final)
        return sorted(os.path.relpath(os.path.join(where, name), self.stage_dir).replace(os.sep, "/")
                      for where, _, names in os.walk(top) for name in names)

    def _local_failure(self, e: BaseException) -> bool:
        """An error of the staging disk (full, over quota, read-only, a path in it refused),
        not of the remote file: every copy would meet it."""
        return isinstance(e, OSError) and (
            e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
            or (str(e.filename or "").startswith(self.stage_dir + os.sep)
                and e.errno != errno.ENAMETOOLONG))  # a name too long: that file's problem

    def _staging_error(self, what: str, e: OSError) -> StagingError:
        return StagingError(
            f"{what} into {self.stage_dir} failed: {e.strerror or e}; the staging directory "
            "needs free space and write permission (free space there, or stage to another "
            "disk: stage_dir= or FASTMM_STAGE_DIR)")

    def _extract(self, tar_path: str, out: str, origin: str) -> None:
        """Unpack regular files and directories only, each checked to stay inside ``out``."""
        os.makedirs(out)
        real_out = os.path.realpath(
            out
        )  # no separate size cap: a tar unpacks to less than its own size
        with open(tar_path, "rb") as f:
            for m in iter_members(f, read_data=False, max_member_bytes=self.max_member_bytes):
                where = f"{origin}:{m.header_offset}"
                name = m.name or ""
                if m.problem is not None:
                    self.report(m.problem[0], name, where, m.problem[1])
                    continue
                if m.kind in ("link", "special"):
                    self.report("not_a_file", name, where, f"{m.kind} members are never created")
                    continue
                rel = tar_member_path(name)
                if m.kind == "dir":
                    rel = rel.rstrip("/")
                    if rel in ("", "."):  # the archive's own top ("./")
                        continue
                why = name_problem(rel)
                if why is not None:
                    self.report("unsafe_name", name, where, why)
                    continue
                target = os.path.join(out, rel)
                try:
                    if m.kind == "dir":
                        os.makedirs(target, exist_ok=True)
                        continue
                    parent = os.path.dirname(target)
                    os.makedirs(parent, exist_ok=True)
                    real = os.path.realpath(parent)
                    if real != real_out and not real.startswith(real_out + os.sep):
                        self.report(
                            "unsafe_name", name, where, "resolves outside the staging directory"
                        )
                        continue
                    fd = os.open(
                        target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644
                    )
                except FileExistsError:
                    self.report(
                        "duplicate_member",
                        name,
                        where,
                        "a member of that name was already unpacked",
                    )
                    continue
                except (NotADirectoryError, IsADirectoryError) as e:
                    self.report("bad_name", name, where, str(e))
                    continue
                with os.fdopen(fd, "wb") as dst:
                    f.seek(m.data_offset)
                    left = m.size
                    while left:
                        chunk = f.read(min(_CHUNK, left))
                        dst.write(chunk)
                        left -= len(chunk)
