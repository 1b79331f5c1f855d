"""A real S3-protocol server on 127.0.0.1 for the remote-tier tests, and a fault proxy.

``S3Server`` runs moto's server mode (what s3fs tests itself against) in its own process on a
free port; it can be killed and started again. ``FaultProxy`` is a real HTTP proxy in front of
it (the endpoint the clients are given): it forwards every request, and on demand answers 5xx,
delays each request, holds a matching request until released (a deterministic "mid-upload"
moment), or drops the connection in the middle of a request body. Every request it sees is
recorded, so a test can assert that its fault point was reached.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.ports import free_port

ACCESS, SECRET = "unbroken-test", "unbroken-test-secret"


def _wait_port(port: int, proc: subprocess.Popen | None, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the S3 server exited {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


class S3Server:
    """moto's S3 server in a process of its own. With ``auth`` it checks credentials and
    signatures like a real store (moto's IAM emulation): the first three requests, made by
    :meth:`start` itself, create a user, its access key and a policy; every later request must
    be signed with that key (:attr:`access`, :attr:`secret`)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.access, self.secret = ACCESS, SECRET
        self.auth = False

    def start(self, auth: bool = True) -> None:
        self.port, self.auth = free_port(), auth
        env = dict(os.environ)
        env.pop("INITIAL_NO_AUTH_ACTION_COUNT", None)
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        _wait_port(self.port, self.proc)
        if auth:
            self.access, self.secret = _make_user(f"http://127.0.0.1:{self.port}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _make_user(endpoint: str) -> tuple[str, str]:
    import boto3

    iam = boto3.client(
        "iam",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="bootstrap",
        aws_secret_access_key="bootstrap",
    )
    iam.create_user(UserName="trainer")
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    allow = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
    }
    iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(allow))
    return key["AccessKeyId"], key["SecretAccessKey"]


class FaultProxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, backend_port: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.backend_port = backend_port
        self.lock = threading.Lock()
        self.seen: list[tuple[str, str]] = []
        self.reset()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def reset(self) -> None:
        with self.lock:
            thaw = getattr(self, "thaw", None)
            if thaw is not None:
                thaw.set()  # frozen requests end (their connections dropped)
            self.thaw = threading.Event()
            self.thaw.set()
            self.seen.clear()
            self.fail: list[tuple[re.Pattern[str], int, int]] = []  # (match, status, times)
            self.delay = 0.0
            self.cut: tuple[re.Pattern[str], int] | None = None
            self.hold_match: re.Pattern[str] | None = None
            self.held = threading.Event()
            self.held_line = ""  # the method and path of the request held
            self.release = threading.Event()
            self.release.set()
            self.drop_held = False

    def freeze(self) -> None:
        """From now on every request is read and never answered, its connection held open
        (a store that accepts connections and does not reply), until :meth:`reset`."""
        with self.lock:
            self.thaw = threading.Event()

    def fail_next(self, times: int, status: int = 503, match: str = ".") -> None:
        with self.lock:
            self.fail.append((re.compile(match), status, times))

    def hold(self, match: str) -> None:
        """Hold the first request matching ``match`` (method and path) until released."""
        with self.lock:
            self.hold_match = re.compile(match)
            self.held = threading.Event()
            self.release = threading.Event()

    def drop(self) -> None:
        """Release the held request without forwarding it (its client was killed)."""
        self.drop_held = True
        self.release.set()

    def cut_body(self, match: str, after: int) -> None:
        """Drop the connection of the next matching request after ``after`` body bytes."""
        with self.lock:
            self.cut = (re.compile(match), after)

    def requests(self, match: str = ".") -> list[tuple[str, str]]:
        pat = re.compile(match)
        with self.lock:
            return [r for r in self.seen if pat.search(f"{r[0]} {r[1]}")]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FaultProxy

    def log_message(self, *args: Any) -> None:
        pass

    def _any(self) -> None:
        srv = self.server
        line = f"{self.command} {self.path}"
        with srv.lock:
            srv.seen.append((self.command, self.path))
            status = None
            for i, (pat, code, times) in enumerate(srv.fail):
                if times > 0 and pat.search(line):
                    srv.fail[i] = (pat, code, times - 1)
                    status = code
                    break
            cut = srv.cut if srv.cut is not None and srv.cut[0].search(line) else None
            if cut is not None:
                srv.cut = None
            hold = srv.hold_match is not None and srv.hold_match.search(line)
            if hold:
                srv.hold_match = None
                srv.held_line = line
            delay, held, release, thaw = srv.delay, srv.held, srv.release, srv.thaw
        if delay:
            time.sleep(delay)
        body = self._body(cut[1] if cut else None)
        if body is None or not thaw.is_set():
            thaw.wait()  # frozen: no answer until the test ends it
            self.close_connection = True
            _shutdown(self.connection)
            return
        if hold:
            held.set()
            release.wait(120)
            if srv.drop_held:  # the client died meanwhile: nothing of this request arrives
                self.close_connection = True
                return
        if status is not None:
            msg = f"<Error><Code>ServiceUnavailable</Code><Message>injected {status}</Message>"
            xml = {"Content-Type": "application/xml"}
            self._reply(status, xml, (msg + "</Error>").encode())
            return
        self._forward(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    def _body(self, cut_after: int | None) -> bytes | None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raw = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                chunk = self.rfile.read(size + 2)
                raw += f"{size:x}\r\n".encode() + chunk
                if cut_after is not None and len(raw) > cut_after:
                    return None
                if size == 0:
                    raw += self._trailers()
                    return bytes(raw)
        n = int(self.headers.get("Content-Length") or 0)
        if cut_after is not None and n > cut_after:
            self.rfile.read(cut_after)
            return None
        return self.rfile.read(n) if n else b""

    def _trailers(self) -> bytes:
        out = b""
        while True:
            line = self.rfile.readline()
            out += line
            if line in (b"\r\n", b"\n", b""):
                return out

    def _forward(self, body: bytes) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.server.backend_port, timeout=120)
        try:
            headers = {k: v for k, v in self.headers.items()}
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in headers.items():
                conn.putheader(k, v)
            conn.endheaders()
            if body:
                conn.send(body)
            resp = conn.getresponse()
            data = resp.read()
            out = {k: v for k, v in resp.getheaders() if k.lower() != "transfer-encoding"}
            out["Content-Length"] = str(len(data))
            if self.command == "HEAD":
                out["Content-Length"] = resp.getheader("Content-Length", "0")
            self._reply(resp.status, out, data)
        except OSError:  # the backend went away (killed), or the client did
            self.close_connection = True
            _shutdown(self.connection)
        finally:
            conn.close()

    def _reply(self, status: int, headers: dict[str, str], data: bytes) -> None:
        self.send_response_only(status)
        for k, v in headers.items():
            if k.lower() not in ("connection", "content-length", "date", "server"):
                self.send_header(k, v)
        self.send_header("Content-Length", headers.get("Content-Length", str(len(data))))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class S3:
    """What a test gets: the server, the proxy in front of it, a fresh bucket and its URL."""

    def __init__(self, server: S3Server, proxy: FaultProxy, bucket: str) -> None:
        self.server, self.proxy, self.bucket = server, proxy, bucket
        self.url = f"s3://{bucket}/run"

    def restart_server(self) -> None:
        """A new server process behind the same proxy: empty (moto keeps objects in memory)
        and not checking credentials (a new one would have new keys)."""
        self.server.kill()
        self.server.start(auth=False)
        self.proxy.backend_port = self.server.port
        make_bucket(self.bucket)


def env_for(server: S3Server, endpoint: str, home: str) -> dict[str, str]:
    """The AWS environment of the tests: the proxy as endpoint, the server's key, no files."""
    return {
        "AWS_ACCESS_KEY_ID": server.access,
        "AWS_SECRET_ACCESS_KEY": server.secret,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_CONFIG_FILE": os.path.join(home, "aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": os.path.join(home, "aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_MAX_ATTEMPTS": "4",
        "AWS_RETRY_MODE": "standard",
    }


def make_bucket(bucket: str) -> None:
    import boto3

    boto3.session.Session().client("s3").create_bucket(Bucket=bucket)


_counter = [0]


@pytest.fixture(scope="session")
def s3_backend(tmp_path_factory: pytest.TempPathFactory) -> Any:
    server = S3Server()
    server.start()
    proxy = FaultProxy(server.port)
    home = str(tmp_path_factory.mktemp("aws"))
    yield server, proxy, home
    proxy.shutdown()
    server.kill()


@pytest.fixture
def s3(s3_backend: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    server, proxy, home = s3_backend
    if server.proc is None or server.proc.poll() is not None or not server.auth:
        server.kill()  # killed or replaced by the previous test
        server.start()
        proxy.backend_port = server.port
    for k, v in env_for(server, proxy.url, home).items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    proxy.reset()
    _counter[0] += 1
    bucket = f"unbroken-{os.getpid()}-{_counter[0]}"
    make_bucket(bucket)
    yield S3(server, proxy, bucket)
    proxy.reset()
