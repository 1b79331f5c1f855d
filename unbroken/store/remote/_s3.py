"""One prefix of an S3 bucket (S3 or an S3-compatible store), through boto3.

The only module that imports boto3 (the ``unbroken[s3]`` extra), and only when a remote is
used. Credentials, region and endpoint come from boto3's standard chain: ``AWS_*`` environment
variables (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` for MinIO, Ceph, GCS's S3 interface),
``~/.aws/config`` and ``~/.aws/credentials`` (``AWS_PROFILE``), instance roles. Retries are
botocore's (``standard`` mode, 5 attempts, unless ``AWS_RETRY_MODE`` / ``AWS_MAX_ATTEMPTS`` or
the config file say otherwise): 5xx, throttling and dropped connections are retried with
backoff. A body cut off while streaming (after the response began) is retried here, range by
range. Every failure that is left becomes a :class:`RemoteStoreError` naming the URL, the
endpoint and the cause.

Memory: a ranged GET reads straight into the caller's buffer (``StreamingBody.readinto``);
an upload sends files and parts of at most :data:`PART_BYTES`, :data:`THREADS` at a time, so
neither direction holds more than a few parts. (s3transfer, boto3's transfer manager, was
measured 2x slower than ``put_object`` on files of a few MB: it reads through small buffered
chunks with callbacks; the plain requests are what we time ourselves against.)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ...errors import ConfigError, RemoteStoreError
from .. import _par

SCHEME = "s3://"
PART_BYTES = 8 << 20
"""Multipart upload part size, and the size of each ranged GET of a large object (8 MiB, as
s3transfer's default and AWS's guidance: enough requests to fill :data:`THREADS`)."""
THREADS = 8
"""Requests in flight at once (uploads and ranged GETs): a single HTTP stream is latency-bound."""
READ_BYTES = 1 << 20
"""The most one read of a response body asks for. urllib3's ``readinto`` reads into a new
``bytes`` of the size asked and copies it over, and a fetch wrote through a buffer as large as
its GET: 8 MiB at a time faulted in fresh pages on every request (filling 64 MiB of new 8 MiB
buffers took ~3x as long as refilling one 1 MiB buffer, 2026-12-04). 1 MiB pieces reuse warm
memory (the load: 1-3% faster, within the noise of a shared machine)."""
STREAM_ATTEMPTS = 4
"""Attempts of a ranged GET whose body is cut off mid-stream (botocore retries the rest)."""
_CODES_CREDENTIALS = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "403",
    "Forbidden",
}


def is_url(text: Any) -> bool:
    return isinstance(text, str) and "://" in text


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ("bucket", "some/prefix"); a clear error otherwise."""
    if not isinstance(url, str) or not url.startswith(SCHEME):
        raise ConfigError(
            f"remote {url!r} is not an s3:// URL; unbroken stores checkpoints remotely in S3 and "
            "S3-compatible stores (MinIO, Ceph, GCS's S3 interface: set AWS_ENDPOINT_URL_S3), "
            "e.g. remote='s3://my-bucket/runs/gpt'"
        )
    bucket, _, prefix = url[len(SCHEME) :].partition("/")
    prefix = prefix.strip("/")
    ok = 3 <= len(bucket) <= 63 and all(c.isalnum() or c in "-._" for c in bucket)
    if not ok or bucket != bucket.lower():
        raise ConfigError(f"remote {url!r}: {bucket!r} is not a valid bucket name")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ConfigError(f"remote {url!r}: the prefix {prefix!r} has an empty, '.' or '..' part")
    return bucket, prefix


def _boto() -> Any:
    try:
        import boto3
        import botocore
    except ImportError:
        raise ConfigError(
            "a remote checkpoint store needs boto3: pip install 'unbroken[s3]'"
        ) from None
    return boto3, botocore


class S3Objects:
    """Objects under ``s3://bucket/prefix``; names passed in are relative to the prefix."""

    def __init__(self, url: str) -> None:
        self.bucket, self.prefix = parse_url(url)
        self.url = SCHEME + self.bucket + (f"/{self.prefix}" if self.prefix else "")
        self._client: Any = None
        self._lock = threading.Lock()

    # ---- names --------------------------------------------------------------------------------

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def where(self, name: str = "") -> str:
        return f"{self.url}/{name}" if name else self.url

    @property
    def endpoint(self) -> str:
        return str(self.client().meta.endpoint_url)

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = _make_client()
            return self._client

    # ---- requests -----------------------------------------------------------------------------

    def check(self) -> None:
        """Raise RemoteStoreError unless the bucket exists and the credentials may list it."""
        # A GET, not a HEAD: the error body names the cause (InvalidAccessKeyId, NoSuchBucket).
        self._call(
            "reaching the bucket",
            "",
            lambda c: c.list_objects_v2(Bucket=self.bucket, Prefix=self.key(""), MaxKeys=1),
        )

    def list_under(self, under: str) -> dict[str, tuple[int, float]]:
        """{name: (size, mtime)} of every object whose name starts with ``under``."""
        out: dict[str, tuple[int, float]] = {}

        def walk(c: Any) -> None:
            pages = c.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.key(under)
            )
            strip = len(self.key(""))
            for page in pages:
                for obj in page.get("Contents", ()):
                    name = obj["Key"][strip:]
                    out[name] = (int(obj["Size"]), obj["LastModified"].timestamp())

        self._call("listing", under, walk)
        return out

    def size(self, name: str) -> int | None:
        """The object's size, or None when there is no such object (one HEAD)."""
        _boto()
        from botocore.exceptions import ClientError

        try:
            resp = self.client().head_object(Bucket=self.bucket, Key=self.key(name))
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._error("examining", name, e) from e
        except Exception as e:
            raise self._error("examining", name, e) from e
        return int(resp["ContentLength"])

    def get_into(self, name: str, offset: int, view: memoryview) -> None:
        """Fill ``view`` with bytes [offset, offset + len(view)) of the object."""
        self.get_into_many(name, offset, [view])

    def get_into_many(self, name: str, offset: int, views: list[memoryview]) -> None:
        """One ranged GET from ``offset``, its bytes streamed into each of ``views`` in turn
        (a scatter read: neighbouring chunks land in their own tensors, gaps in a scratch)."""

        def consume(body: Any) -> None:
            for view in views:
                got = 0
                while got < len(view):
                    n = body.readinto(view[got : got + READ_BYTES])
                    if not n:
                        raise _cut(got, len(view))
                    got += n

        self._ranged(name, offset, sum(len(v) for v in views), consume)

    def get_stream(
        self,
        name: str,
        offset: int,
        want: int,
        sink: Callable[[memoryview, int], None],
        begin: Callable[[], None],
    ) -> None:
        """One ranged GET of ``want`` bytes from ``offset``, handed in order to ``sink(piece,
        at)`` through one buffer of at most :data:`READ_BYTES`. ``begin()`` is called before
        the first piece, and again if the body is cut off and the range read anew."""
        buf = memoryview(bytearray(min(want, READ_BYTES)))

        def consume(body: Any) -> None:
            begin()
            got = 0
            while got < want:
                n = body.readinto(buf[: min(len(buf), want - got)])
                if not n:
                    raise _cut(got, want)
                try:
                    sink(buf[:n], offset + got)
                except Exception as e:  # the caller's (a full disk): not the store's, no retry
                    raise _NotTheStore() from e
                got += n

        self._ranged(name, offset, want, consume)

    def _ranged(self, name: str, offset: int, want: int, consume: Callable[[Any], None]) -> None:
        if not want:
            return
        for attempt in range(STREAM_ATTEMPTS):
            rng = f"bytes={offset}-{offset + want - 1}"
            resp = self._call(
                "reading",
                name,
                lambda c, rng=rng: c.get_object(Bucket=self.bucket, Key=self.key(name), Range=rng),
            )
            body = resp["Body"]
            try:
                if int(resp.get("ContentLength", -1)) != want:
                    raise RemoteStoreError(
                        f"{self.where(name)}: asked for bytes {offset}...{offset + want}, the "
                        f"store sent {resp.get('ContentLength')} (the object is shorter than its "
                        "manifest says, or the store ignores ranges)",
                        path=self.where(name),
                    )
                consume(body)
                return
            except RemoteStoreError:
                raise
            except _NotTheStore as e:
                assert e.__cause__ is not None
                raise e.__cause__ from None
            except Exception as e:  # a body cut off mid-stream: botocore does not retry those
                if attempt + 1 == STREAM_ATTEMPTS:
                    raise self._error("reading", name, e) from e
                time.sleep(0.2 * 2**attempt)
            finally:
                body.close()

    def get_bytes(self, name: str, size: int) -> bytes:
        """The whole object, known (from a listing) to hold ``size`` bytes."""
        buf = bytearray(size)
        self.get_into(name, 0, memoryview(buf))
        return bytes(buf)

    def put_bytes(self, name: str, data: bytes) -> None:
        self._call(
            "writing",
            name,
            lambda c: c.put_object(Bucket=self.bucket, Key=self.key(name), Body=data),
        )

    def upload(self, items: Iterable[tuple[str, str, int]]) -> None:
        """Upload each (name, local file, n): the file's first n bytes. A file of more than
        :data:`PART_BYTES` goes in parts (a multipart upload); every request -- whole files and
        parts of all of them -- runs :data:`THREADS` at a time, each holding the one part it
        sends. Returns when all are stored; at the first failure the rest are cancelled, every
        multipart upload begun is aborted, and the error is raised."""
        parts: dict[str, list[Any]] = {}  # name -> [upload id, {part number: etag}]
        tasks: list[tuple[str, str, int, int, int]] = []  # (name, path, offset, n, part number)
        try:
            for name, path, n in items:
                if n <= PART_BYTES:
                    tasks.append((name, path, 0, n, 0))
                    continue
                up = self._call(
                    "writing",
                    name,
                    lambda c, name=name: c.create_multipart_upload(
                        Bucket=self.bucket, Key=self.key(name)
                    ),
                )
                parts[name] = [up["UploadId"], {}]
                for i, at in enumerate(range(0, n, PART_BYTES)):
                    tasks.append((name, path, at, min(PART_BYTES, n - at), i + 1))
            # Daemon threads, not a ThreadPoolExecutor (whose threads the interpreter joins at
            # exit): a store that stops answering must not hold the process past the bounded
            # wait of finish() (remote_timeout).
            _par.each(tasks, lambda t: self._send(t, parts), 0, n_threads=THREADS)
            for name, (upload_id, etags) in parts.items():
                done = {"Parts": [{"PartNumber": k, "ETag": etags[k]} for k in sorted(etags)]}
                self._call(
                    "writing",
                    name,
                    lambda c, name=name, upload_id=upload_id, done=done: (
                        c.complete_multipart_upload(
                            Bucket=self.bucket,
                            Key=self.key(name),
                            UploadId=upload_id,
                            MultipartUpload=done,
                        )
                    ),
                )
        except BaseException:
            for name, (upload_id, _) in parts.items():
                try:  # stored parts are invisible but billed until aborted
                    self.client().abort_multipart_upload(
                        Bucket=self.bucket, Key=self.key(name), UploadId=upload_id
                    )
                except Exception:
                    pass  # completed already, or the store is gone: swept at the next start
            raise

    def _send(self, task: tuple[str, str, int, int, int], parts: dict[str, list[Any]]) -> None:
        name, path, offset, n, number = task
        with open(path, "rb", buffering=0) as f:
            data = os.pread(f.fileno(), n, offset)
        if len(data) != n:
            raise RemoteStoreError(
                f"{path} has fewer than {offset + n} bytes; it changed while being uploaded",
                path=path,
            )
        if number == 0:
            self._call(
                "writing",
                name,
                lambda c: c.put_object(Bucket=self.bucket, Key=self.key(name), Body=data),
            )
            return
        upload_id, etags = parts[name]
        resp = self._call(
            "writing",
            name,
            lambda c: c.upload_part(
                Bucket=self.bucket,
                Key=self.key(name),
                UploadId=upload_id,
                PartNumber=number,
                Body=data,
            ),
        )
        etags[number] = resp["ETag"]

    def delete(self, names: Iterable[str]) -> None:
        names = list(names)
        for i in range(0, len(names), 1000):
            batch = [{"Key": self.key(n)} for n in names[i : i + 1000]]
            resp = self._call(
                "deleting",
                names[i],
                lambda c, batch=batch: c.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                ),
            )
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise RemoteStoreError(
                    f"{self.where()}: could not delete {first.get('Key')}: {first.get('Code')} "
                    f"{first.get('Message')}",
                    path=self.where(),
                )

    def copy(self, src: str, dst: str) -> None:
        """Server-side copy (no bytes pass through this process)."""
        self._call(
            "copying",
            src,
            lambda c: c.copy(
                {"Bucket": self.bucket, "Key": self.key(src)}, self.bucket, self.key(dst)
            ),
        )

    def abort_uploads(self, under: str, older_than: float) -> int:
        """Abort multipart uploads under ``under`` begun before ``older_than`` (a killed
        upload leaves its parts stored, invisible and billed, until aborted)."""
        aborted = 0

        def walk(c: Any) -> None:
            nonlocal aborted
            pages = c.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self.key(under)
            )
            for page in pages:
                for up in page.get("Uploads", ()):
                    if up["Initiated"].timestamp() < older_than:
                        c.abort_multipart_upload(
                            Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"]
                        )
                        aborted += 1

        self._call("cleaning up unfinished uploads", under, walk)
        return aborted

    # ---- errors -------------------------------------------------------------------------------

    def _call(self, what: str, name: str, fn: Any) -> Any:
        try:
            return fn(self.client())
        except RemoteStoreError:
            raise
        except Exception as e:
            raise self._error(what, name, e) from e

    def _error(self, what: str, name: str, e: BaseException) -> RemoteStoreError:
        where = self.where(name)
        return RemoteStoreError(
            f"{where}: {what} failed: {describe(e, self.bucket)} (endpoint "
            f"{_endpoint_of(self._client)})",
            path=where,
        )


class _NotTheStore(Exception):
    """Carries an error of a :meth:`S3Objects.get_stream` sink past the retries."""


def _cut(got: int, want: int) -> Exception:
    return ConnectionError(f"the response ended after {got} of {want} bytes")


def describe(e: BaseException, bucket: str) -> str:
    """What went wrong, in words a user can act on."""
    _boto()
    from botocore import exceptions as bx

    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return (
            f"no usable AWS credentials ({e}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "or AWS_PROFILE with ~/.aws/credentials"
        )
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", "?"))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket" or (code in ("404", "NotFound") and "HeadBucket" in str(e)):
            return f"the bucket {bucket!r} does not exist ({code}); create it or fix the URL"
        if code in _CODES_CREDENTIALS or status == 403:
            return (
                f"the store refused the credentials for bucket {bucket!r} ({code}: "
                f"{err.get('Message', '')}); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                "or AWS_PROFILE, and the bucket's permissions"
            )
        return f"{code} (HTTP {status}): {err.get('Message', '')}"
    if isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError)):
        return f"cannot connect to the endpoint ({e}); is the store up and the URL right?"
    if isinstance(e, bx.BotoCoreError):
        return f"{type(e).__name__}: {e}"
    return f"{type(e).__name__}: {e}"


def _endpoint_of(client: Any) -> str:
    return str(client.meta.endpoint_url) if client is not None else "?"


_loader: Any = None


def _make_client() -> Any:
    boto3, _ = _boto()
    from botocore.config import Config
    from botocore.session import get_session

    session = get_session()  # a fresh one: credentials from the environment as it is now
    # The service description (a large JSON) is parsed once per process, not once per client.
    global _loader
    if _loader is None:
        _loader = session.get_component("data_loader")
    else:
        session.register_component("data_loader", _loader)
    mode = session.get_config_variable("retry_mode") or "standard"
    attempts = session.get_config_variable("max_attempts") or 5
    config = Config(
        retries={"mode": mode, "total_max_attempts": int(attempts)},
        connect_timeout=10,
        read_timeout=60,
        max_pool_connections=2 * THREADS + 4,
    )
    return boto3.session.Session(botocore_session=session).client("s3", config=config)
