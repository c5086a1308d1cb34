"""A real S3-protocol server on 127.0.0.1 (moto's server, its own process) behind a proxy
that adds what a real store shows under load: latency per request, a bandwidth cap per
connection, throttling and 5xx answers, connections dropped or stalled mid-object, refused keys.

Used by the tests and by Study 1's object-store arm; it only ever listens on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .nodes import free_port

ACCESS_KEY, SECRET_KEY, REGION = "fastmm-test-key", "fastmm-test-secret", "us-east-1"


@dataclass
class Fault:
    """Break the next ``times`` requests whose path contains ``path`` (and method matches):
    ``status`` answers an S3 error (503 "SlowDown", 500 "InternalError", ...) instead of
    forwarding; ``drop_after`` sends that many body bytes of the real answer, then closes the
    connection; ``stall_s`` sends the headers, then waits that long before the body."""

    path: str = ""
    method: str = "GET"
    times: int = 1
    status: int | None = None
    code: str = "SlowDown"
    drop_after: int | None = None
    stall_s: float = 0.0
    hits: int = field(default=0, init=False)


class _Proxy(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that hung up: normal
            super().handle_error(request, client_address)


class LocalS3:
    """``with LocalS3() as s3:`` starts moto's server and the proxy, sets nothing globally;
    ``s3.env`` is the environment a client needs (endpoint = the proxy), ``s3.direct_env`` the
    one that bypasses the proxy (uploads). ``latency_s``, ``bytes_per_s`` and ``faults`` can be
    changed while it runs; ``requests`` counts what the proxy forwarded or broke, by method,
    ``most_in_flight`` the most it answered at once."""

    def __init__(self, *, latency_s: float = 0.0, bytes_per_s: float | None = None):
        self.latency_s, self.bytes_per_s = latency_s, bytes_per_s
        self.faults: list[Fault] = []
        self.allowed_key = ACCESS_KEY
        self.requests: dict[str, int] = {}
        self.in_flight = self.most_in_flight = 0  # requests the proxy is answering at once
        self._lock = threading.Lock()

    def __enter__(self) -> "LocalS3":
        exe = shutil.which("moto_server", path=os.path.dirname(sys.executable))
        if exe is None:
            raise RuntimeError("moto's server is not installed: pip install 'moto[server]'")
        self.moto_port = free_port()
        self._moto = subprocess.Popen(
            [exe, "-H", "127.0.0.1", "-p", str(self.moto_port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.moto_port), timeout=1):
                    break
            except OSError:
                if self._moto.poll() is not None or time.monotonic() > deadline:
                    self._moto.kill()
                    raise RuntimeError("moto_server did not start on 127.0.0.1") from None
                time.sleep(0.05)
        self._proxy = _Proxy(("127.0.0.1", 0), self._handler())
        self.port = self._proxy.server_address[1]
        self._thread = threading.Thread(target=self._proxy.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._proxy.shutdown()
        self._proxy.server_close()
        self._moto.terminate()
        try:
            self._moto.wait(10)
        except subprocess.TimeoutExpired:
            self._moto.kill()
            self._moto.wait()

    def _env(self, port: int) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            # no profile, config or credentials file of the machine's own may steer the client
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    @property
    def env(self) -> dict[str, str]:
        return self._env(self.port)

    @property
    def direct_env(self) -> dict[str, str]:
        return self._env(self.moto_port)

    @contextlib.contextmanager
    def environ(self, direct: bool = False):
        """This process's os.environ set for the store while inside (restored after)."""
        env = self.direct_env if direct else self.env
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def client(self, direct: bool = True):
        """A boto3 client for setting up buckets (straight to moto unless direct=False)."""
        import boto3

        env = self.direct_env if direct else self.env
        return boto3.session.Session().client(
            "s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=REGION,
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)

    def upload_dir(self, local: str, bucket: str, prefix: str = "") -> list[str]:
        """Put every file under ``local`` into ``bucket`` (created if needed) under ``prefix``;
        returns the s3:// URLs."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        urls = []
        for where, dirs, names in os.walk(local):
            dirs.sort()
            for name in sorted(names):
                path = os.path.join(where, name)
                key = prefix + os.path.relpath(path, local).replace(os.sep, "/")
                client.upload_file(path, bucket, key)
                urls.append(f"s3://{bucket}/{key}")
        return urls

    def _fault_for(self, method: str, path: str) -> Fault | None:
        with self._lock:
            self.requests[method] = self.requests.get(method, 0) + 1
            for f in self.faults:
                if f.hits < f.times and f.method == method and f.path in path:
                    f.hits += 1
                    return f
        return None

    def _handler(self):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body leave at once, as from a store

            def log_message(self, *args):
                pass

            def _error(self, status: int, code: str) -> None:
                body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                        f"<Message>injected by fastmm's test proxy</Message></Error>").encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _forward(self) -> None:
                auth = self.headers.get("Authorization", "")
                if owner.allowed_key and f"Credential={owner.allowed_key}/" not in auth:
                    self._error(403, "InvalidAccessKeyId")
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if owner.latency_s:
                    time.sleep(owner.latency_s)
                fault = owner._fault_for(self.command, self.path)
                if fault is not None and fault.status is not None:
                    self._error(fault.status, fault.code)
                    return
                up = http.client.HTTPConnection("127.0.0.1", owner.moto_port, timeout=60)
                try:
                    up.request(self.command, self.path, body=body, headers=dict(self.headers))
                    r = up.getresponse()
                    data = r.read()
                finally:
                    up.close()
                self.send_response(r.status, r.reason)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                length = r.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if fault is not None and fault.stall_s:
                    time.sleep(fault.stall_s)
                if fault is not None and fault.drop_after is not None:
                    self.wfile.write(data[: fault.drop_after])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self._send(data)

            def _send(self, data: bytes) -> None:
                rate, step = owner.bytes_per_s, 64 << 10
                start = time.monotonic()
                for pos in range(0, len(data), step):
                    self.wfile.write(data[pos : pos + step])
                    if rate:
                        ahead = (pos + step) / rate - (time.monotonic() - start)
                        if ahead > 0:
                            time.sleep(ahead)

            def _counted(self) -> None:
                with owner._lock:
                    owner.in_flight += 1
                    owner.most_in_flight = max(owner.most_in_flight, owner.in_flight)
                try:
                    self._forward()
                finally:
                    with owner._lock:
                        owner.in_flight -= 1

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _counted

        return Handler
