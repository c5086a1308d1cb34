"""Objects in S3 or an S3-compatible store (``s3://bucket/prefix``), read with boto3.

Endpoint, region and credentials come from the standard AWS chain (``AWS_ENDPOINT_URL``,
``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``~/.aws/config`` and
``~/.aws/credentials``), so the same code reaches AWS and any S3-compatible store.

Faults: throttling (503 SlowDown), 5xx answers and refused connections are retried by
botocore's "standard" mode (exponential backoff with jitter, ``attempts`` tries in all); a
connection that drops mid-object is resumed from the byte it reached, pinned to the object's
ETag, up to ``attempts`` times too. Every socket wait is bounded by ``timeout_s``, so a stalled
store ends in an error naming the object, never a hang. A missing key is a FileNotFoundError
(a sample's problem, for ``on_error``); wrong credentials, a missing bucket or an unreachable
endpoint are an ObjectStoreError (the run's problem) when the source is opened.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import random
import time
from dataclasses import dataclass

from ..config import ObjectStoreConfig
from .base import name_problem

SCHEME = "s3://"


def is_s3(path) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


def split_url(url: str) -> tuple[str, str]:
    """("bucket", "key/prefix") of ``s3://bucket/key/prefix``."""
    bucket, _, key = url[len(SCHEME):].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket; use s3://bucket/prefix")
    return bucket, key


class ObjectStoreError(RuntimeError):
    """The store cannot be used at all (credentials refused, no such bucket, endpoint not
    reachable): the run's problem, raised when a source is opened, never counted as a sample's."""


@dataclass(frozen=True)
class ObjectInfo:
    url: str  # s3://bucket/key
    size: int
    etag: str


_RUN_ERRORS = {  # S3 error codes that no retry or other object can fix
    "NoSuchBucket": "no such bucket",
    "InvalidAccessKeyId": "the access key is not known to the store",
    "SignatureDoesNotMatch": "the secret key does not match the access key",
    "AccessDenied": "access denied",
    "InvalidToken": "the session token is not valid",
    "ExpiredToken": "the session token has expired",
    "AllAccessDisabled": "access to the bucket is disabled",
}


class S3Store:
    """A boto3 S3 client made lazily in each process (a client does not survive pickling,
    and one made before a fork is not the child's), with bounded retries and timeouts.
    ``attempts``: tries per request and per resumed read (default FASTMM_S3_ATTEMPTS, then
    5); ``timeout_s``: connect and per-read socket timeout (FASTMM_S3_TIMEOUT_S, then 30)."""

    def __init__(self, *, attempts: int | None = None, timeout_s: float | None = None):
        if (attempts is not None and attempts < 1) or (timeout_s is not None and timeout_s <= 0):
            raise ValueError(f"attempts={attempts} (>= 1), timeout_s={timeout_s} (> 0)")
        config = ObjectStoreConfig.resolve(attempts=attempts, timeout_s=timeout_s)
        self.attempts, self.timeout_s = config.attempts, config.timeout_s
        self._client, self._pid = None, None
        self.stats = {"requests": 0, "resumed": 0, "bytes": 0}  # this process's

    def __getstate__(self):
        return {"attempts": self.attempts, "timeout_s": self.timeout_s}

    def __setstate__(self, state):
        self.__init__(**state)

    @property
    def client(self):
        if self._client is None or self._pid != os.getpid():
            try:
                import boto3
                from botocore.config import Config
            except ImportError as e:
                raise ImportError("s3:// roots need boto3: pip install boto3") from e
            config = Config(
                retries={"mode": "standard", "max_attempts": self.attempts},
                connect_timeout=self.timeout_s,
                read_timeout=self.timeout_s,
                max_pool_connections=16,
            )
            self._client = boto3.session.Session().client("s3", config=config)
            self._pid = os.getpid()
        return self._client

    def _fail(self, e: Exception, url: str) -> Exception:
        """The exception to raise for ``e`` met on ``url``: ObjectStoreError for the run's
        problems, FileNotFoundError for a missing key, OSError for the rest."""
        from botocore.exceptions import ClientError, NoCredentialsError, EndpointConnectionError

        if isinstance(e, NoCredentialsError):
            return ObjectStoreError(f"{url}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                                    "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or ~/.aws/credentials)")
        if isinstance(e, EndpointConnectionError):  # at start, check() makes it the run's
            return OSError(errno.EHOSTUNREACH, f"the endpoint cannot be reached after "
                           f"{self.attempts} tries ({e})", url)
        if isinstance(e, ClientError):
            code = e.response.get("Error", {}).get("Code", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _RUN_ERRORS:
                return ObjectStoreError(f"{url}: {_RUN_ERRORS[code]} ({code}, HTTP {status})")
            if code in ("NoSuchKey", "404", "NotFound"):
                return FileNotFoundError(errno.ENOENT, "no such object", url)
            if code in ("PreconditionFailed", "412"):
                return OSError(errno.ESTALE, "the object changed while it was read", url)
            return OSError(errno.EIO, f"{code} (HTTP {status}) after {self.attempts} tries", url)
        return OSError(errno.EIO, f"{type(e).__name__}: {e}", url)

    def check(self, url: str) -> None:
        """Raise ObjectStoreError now if the bucket cannot be listed (credentials, bucket,
        endpoint), so a run fails at start with the reason instead of sample by sample."""
        bucket, key = split_url(url)
        try:
            self.client.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
        except Exception as e:
            raise self._run_error(e, url) from e

    def _run_error(self, e: Exception, url: str) -> ObjectStoreError:
        """``e`` met while listing: every failure there is the run's."""
        err = self._fail(e, url)
        return err if isinstance(err, ObjectStoreError) else ObjectStoreError(str(err))

    def files_under(self, url: str) -> list[tuple[str, ObjectInfo]]:
        """(path relative to ``url``, object) for each object under the "directory" ``url``,
        sorted; well-formed names with a part starting with "." are left out, as a local walk
        leaves them. Paths are the store's keys, hostile or not: callers check each with
        ``name_problem`` and report the bad ones. FileNotFoundError where nothing is under it:
        a typo, not an empty corpus."""
        bucket, prefix = split_url(url.rstrip("/") + "/")
        out = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix
            ):
                self.stats["requests"] += 1
                for obj in page.get("Contents", ()):
                    out.append(ObjectInfo(f"{SCHEME}{bucket}/{obj['Key']}", obj["Size"],
                                          obj["ETag"]))
        except Exception as e:
            raise self._run_error(e, url) from e
        if not out:
            raise FileNotFoundError(errno.ENOENT, "no objects under the prefix", url)
        rel = len(SCHEME) + len(bucket) + 1 + len(prefix)
        return [(o.url[rel:], o) for o in sorted(out, key=lambda o: o.url)
                if name_problem(o.url[rel:]) is not None
                or not any(part.startswith(".") for part in o.url[rel:].split("/"))]

    def head(self, url: str) -> ObjectInfo:
        bucket, key = split_url(url)
        try:
            r = self.client.head_object(Bucket=bucket, Key=key)
        except Exception as e:
            raise self._fail(e, url) from e
        self.stats["requests"] += 1
        return ObjectInfo(url, r["ContentLength"], r["ETag"])

    def _get(self, url: str, start: int, end: int | None, etag: str | None):
        """The body of one GET of bytes ``start``..``end``, and the object's ETag.

        Args:
            url: the object's ``s3://`` URL.
            start: its first byte to get.
            end: its last byte to get (inclusive); None: to the end.
            etag: the ETag the object must still have (a resumed read's); None: any.
        """
        bucket, key = split_url(url)
        args = {"Bucket": bucket, "Key": key}
        if start or end is not None:
            args["Range"] = f"bytes={start}-{'' if end is None else end}"
        if etag:
            args["IfMatch"] = etag  # a resumed read must come from the same object
        self.stats["requests"] += 1
        r = self.client.get_object(**args)
        return r["Body"], r["ETag"]

    def read(self, url: str, start: int = 0, size: int | None = None,
             etag: str | None = None) -> bytes:
        """``size`` bytes from ``start``: one ranged GET, resumed where a dropped connection
        left it. Fewer bytes only where the object ends first.

        Args:
            url: the object's ``s3://`` URL.
            start: the first byte to read.
            size: how many bytes; None: to the end.
            etag: the ETag the object must have (the one a listing or head gave); None: any,
                then the first GET's for its resumptions.
        """
        from botocore.exceptions import ClientError

        parts, got, tries = [], 0, 0
        while size is None or got < size:
            try:
                body, etag = self._get(url, start + got,
                                       None if size is None else start + size - 1, etag)
                while chunk := body.read(1 << 20):
                    got += len(chunk)
                    self.stats["bytes"] += len(chunk)
                    parts.append(chunk)
                break
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") == "InvalidRange":
                    break  # from at or past the end: nothing there
                raise self._fail(e, url) from e
            except Exception as e:
                tries += 1
                self._resume_or_raise(e, url, start + got, tries)
        return b"".join(parts)

    def _resume_or_raise(self, e: Exception, url: str, at: int, tries: int) -> None:
        """After ``e`` on the ``tries``-th try: wait a backoff and return (the caller resumes),
        or raise if ``e`` is not a dropped connection or tries are spent.

        Args:
            e: what the try raised.
            url: the object's ``s3://`` URL, for the error.
            at: the byte the caller resumes at, for the error.
            tries: tries so far, this one included.
        """
        if not _dropped(e):
            raise self._fail(e, url) from e
        if tries >= self.attempts:
            raise OSError(errno.EIO, f"connection dropped {tries} times, last at byte {at} "
                          f"({type(e).__name__}: {e})", url) from e
        self.stats["resumed"] += 1
        time.sleep(min(2.0, 0.05 * 2 ** tries) * random.random())

    def open(self, info: ObjectInfo, buffer_size: int = 1 << 20):
        """A buffered, seekable reader of the object: one streaming GET read front to back,
        resumed on a drop, reopened at a seek it cannot skip to."""
        return io.BufferedReader(_ObjectReader(self, info), buffer_size)


def _dropped(e: BaseException) -> bool:
    """A connection lost or stalled mid-body (which botocore does not retry)."""
    from botocore.exceptions import (
        ConnectionClosedError, IncompleteReadError, ReadTimeoutError, ResponseStreamingError,
    )
    from urllib3.exceptions import ProtocolError, ReadTimeoutError as Urllib3ReadTimeout

    return isinstance(e, (ResponseStreamingError, IncompleteReadError, ReadTimeoutError,
                          ConnectionClosedError, ProtocolError, Urllib3ReadTimeout,
                          ConnectionError, TimeoutError))


class _ObjectReader(io.RawIOBase):
    """Raw, seekable bytes of one object for io.BufferedReader: reads go on along one open
    GET while they move forward (a gap of up to SKIP bytes is read through), else a new
    ranged GET starts where the read is."""

    SKIP = 1 << 20

    def __init__(self, store: S3Store, info: ObjectInfo):
        self.store, self.info, self.pos = store, info, 0
        self.name = info.url
        self._body, self._body_pos = None, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.info.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def _drop_body(self) -> None:
        if self._body is not None:
            with contextlib.suppress(Exception):
                self._body.close()
            self._body = None

    def close(self) -> None:
        self._drop_body()
        super().close()

    def readinto(self, buf) -> int:
        size = min(len(buf), self.info.size - self.pos)
        if size <= 0:
            return 0
        tries = 0
        while True:
            try:
                gap = self.pos - self._body_pos
                if self._body is None or not 0 <= gap <= self.SKIP:
                    self._drop_body()
                    self._body, _ = self.store._get(self.info.url, self.pos, None, self.info.etag)
                    self._body_pos = self.pos
                while self._body_pos < self.pos:
                    skipped = self._body.read(min(self.pos - self._body_pos, 1 << 20))
                    if not skipped:
                        raise ConnectionError("the object ended before its listed size")
                    self._body_pos += len(skipped)
                data = self._body.read(size)
                if not data:
                    raise ConnectionError("the object ended before its listed size")
                break
            except Exception as e:
                self._drop_body()
                tries += 1
                self.store._resume_or_raise(e, self.info.url, self.pos, tries)
        n = len(data)
        buf[:n] = data
        self.pos += n
        self._body_pos = self.pos
        self.store.stats["bytes"] += n
        return n
