"""A minimal S3-compatible server that serves the files of a local folder.

For tests and benchmarks only: no authentication (signatures are ignored), no
versioning, no multipart upload. It exists because moto's server (the
S3-compatible server on PyPI the suite uses elsewhere) keeps every object in a
spooled buffer and copies the whole object on every GET, range GETs included
(`moto/s3/models.py`, `FakeKey.value`), so a range read of a 5 GB object costs
seconds. This one answers a range GET with `os.sendfile` from the file.

Served: `HEAD` and `GET` of an object (`Range: bytes=a-b`, `a-`, `-n`;
`If-Match` / `If-None-Match` against the ETag), `PUT` of a whole object
(written to a temporary file and renamed in, so readers of the old object
never see a mix), and `ListObjectsV2` (`GET /bucket?list-type=2&prefix=`).
Buckets are the folders directly under `root`; keys are paths below them;
requests are path-style (`http://host:port/bucket/key`).

The ETag of an object is derived from its inode, size and modification time,
so replacing or rewriting the file changes it.

Example:
  >>> with S3FolderServer("/data/buckets") as server:  # doctest: +SKIP
  ...     url = server.endpoint_url  # http://127.0.0.1:PORT
"""

from __future__ import annotations

import email.utils
import http.server
import json
import os
import re
import sys
import tempfile
import threading
import time
import urllib.parse
from xml.sax.saxutils import escape

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
# Counters as JSON (`?reset=1` zeroes them), as FaultProxy answers them.
STATS_PATH = "/__proxy__/stats"


def object_etag(stat: os.stat_result) -> str:
    """The quoted ETag of a file with this `os.stat` result."""
    return f'"{stat.st_ino:x}-{stat.st_size:x}-{stat.st_mtime_ns:x}"'


def _error_body(code: str, message: str, resource: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f"<Error><Code>{code}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(resource)}</Resource></Error>"
    ).encode()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "grain-cells-s3-folder"
    root: str = ""  # set on the subclass made per server

    def log_message(self, format, *args):
        pass

    # -- helpers ------------------------------------------------------------

    def _split(self) -> tuple[str, str, dict[str, list[str]]]:
        parsed = urllib.parse.urlsplit(self.path)
        parts = urllib.parse.unquote(parsed.path).lstrip("/").split("/", 1)
        bucket = parts[0]
        key = parts[1] if len(parts) > 1 else ""
        return bucket, key, urllib.parse.parse_qs(parsed.query)

    def _file(self, bucket: str, key: str) -> str | None:
        base = os.path.realpath(os.path.join(self.root, bucket))
        path = os.path.realpath(os.path.join(base, key))
        if not path.startswith(base + os.sep) or not os.path.isfile(path):
            return None
        return path

    def _send_error(self, status: int, code: str, message: str) -> None:
        body = _error_body(code, message, self.path)
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _drain_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    # -- verbs --------------------------------------------------------------

    def _count(self, **add: int) -> None:
        counts = self.server.counts
        with self.server.counts_lock:
            for name, value in add.items():
                counts[name] = counts.get(name, 0) + value

    def _begin(self) -> None:
        self._count(
            requests=1,
            range_gets=int(self.command == "GET" and "Range" in self.headers),
        )
        if self.server.latency_s:
            time.sleep(self.server.latency_s)

    def do_HEAD(self):
        self._begin()
        self._get(send_body=False)

    def do_GET(self):
        if self.path.startswith(STATS_PATH):
            self._stats()
            return
        self._begin()
        bucket, key, query = self._split()
        if not key:
            self._list(bucket, query)
        else:
            self._get(send_body=True)

    def _stats(self) -> None:
        with self.server.counts_lock:
            body = json.dumps(self.server.counts).encode()
            if "reset=1" in self.path:
                self.server.counts = {}
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self):
        self._begin()
        bucket, key, _ = self._split()
        body = self._drain_body()
        folder = os.path.join(self.root, bucket)
        if not key or not os.path.isdir(folder):
            self._send_error(404, "NoSuchBucket", f"no bucket {bucket!r}")
            return
        path = os.path.join(folder, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".put-")
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.replace(tmp, path)
        self.send_response(200)
        self.send_header("ETag", object_etag(os.stat(path)))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _list(self, bucket: str, query: dict[str, list[str]]) -> None:
        folder = os.path.join(self.root, bucket)
        if not bucket or not os.path.isdir(folder):
            self._send_error(404, "NoSuchBucket", f"no bucket {bucket!r}")
            return
        prefix = query.get("prefix", [""])[0]
        entries = []
        for dirpath, _, names in os.walk(folder):
            for name in names:
                if name.startswith(".put-"):
                    continue
                path = os.path.join(dirpath, name)
                key = os.path.relpath(path, folder).replace(os.sep, "/")
                if key.startswith(prefix):
                    entries.append((key, os.stat(path)))
        entries.sort()
        contents = "".join(
            f"<Contents><Key>{escape(key)}</Key><Size>{st.st_size}</Size>"
            f"<ETag>{escape(object_etag(st))}</ETag><LastModified>"
            f"{_iso(st.st_mtime)}</LastModified></Contents>"
            for key, st in entries
        )
        body = (
            '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult>'
            f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>"
            f"<KeyCount>{len(entries)}</KeyCount><IsTruncated>false</IsTruncated>"
            f"{contents}</ListBucketResult>"
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _get(self, send_body: bool) -> None:
        bucket, key, _ = self._split()
        path = self._file(bucket, key)
        if path is None:
            self._send_error(404, "NoSuchKey", f"no key {key!r} in {bucket!r}")
            return
        with open(path, "rb") as f:
            # The ETag and the bytes come from the same open file: a file
            # replaced meanwhile is a new inode, never a mix.
            stat = os.fstat(f.fileno())
            etag = object_etag(stat)
            if_match = self.headers.get("If-Match")
            if if_match and if_match.strip() not in ("*", etag):
                self._send_error(412, "PreconditionFailed", f"ETag is {etag}")
                return
            if self.headers.get("If-None-Match", "").strip() == etag:
                self.send_response(304)
                self.send_header("ETag", etag)
                self.end_headers()
                return
            size = stat.st_size
            start, stop = 0, size
            status = 200
            spec = self.headers.get("Range")
            if spec:
                bounds = _parse_range(spec, size)
                if bounds is None:
                    self._send_error(416, "InvalidRange", f"{spec} of {size}")
                    return
                start, stop = bounds
                status = 206
            self.send_response(status)
            self.send_header("Content-Length", str(stop - start))
            self.send_header("ETag", etag)
            self.send_header(
                "Last-Modified", email.utils.formatdate(stat.st_mtime, usegmt=True)
            )
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
            self.end_headers()
            if send_body:
                self.wfile.flush()
                _sendfile(self.connection, f.fileno(), start, stop - start)
                self._count(response_bytes=stop - start)


def _parse_range(spec: str, size: int) -> tuple[int, int] | None:
    match = _RANGE.match(spec.strip())
    if not match or match.group(1) == match.group(2) == "":
        return None
    first, last = match.groups()
    if first == "":  # the last n bytes
        return max(0, size - int(last)), size
    start = int(first)
    stop = size if last == "" else min(size, int(last) + 1)
    if start >= size or stop <= start:
        return None
    return start, stop


def _sendfile(sock, fd: int, offset: int, count: int) -> None:
    while count > 0:
        sent = os.sendfile(sock.fileno(), fd, offset, count)
        if sent == 0:
            raise ConnectionError("sendfile sent nothing")
        offset += sent
        count -= sent


def _iso(seconds: float) -> str:
    import datetime

    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.000Z")


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def handle_error(self, request, client_address):
        # A client (or the fault proxy) hanging up mid-response is routine.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class S3FolderServer:
    """Serves `root`'s subfolders as S3 buckets on a loopback port, in a thread.

    Args:
      root: Folder whose subfolders are the buckets.
      host: Address to listen on (loopback only in tests).
      port: Port, or 0 for a free one.
      latency_s: Seconds to hold every request before answering it (added
        round-trip time without a proxy).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        latency_s: float = 0.0,
    ):
        handler = type("Handler", (_Handler,), {"root": os.fspath(root)})
        self._server = _Server((host, port), handler)
        self._server.latency_s = latency_s
        self._server.counts = {}
        self._server.counts_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """`(host, port)` the server listens on."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def endpoint_url(self) -> str:
        """`http://host:port`, for `storage_options={"endpoint_url": ...}`."""
        host, port = self.address
        return f"http://{host}:{port}"

    def start(self) -> S3FolderServer:
        """Starts serving in a daemon thread; returns self."""
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="s3-folder-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving and closes the listening socket."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> S3FolderServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
