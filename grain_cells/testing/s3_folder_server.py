"""A minimal S3-compatible server that serves the files of a local folder.

For tests and benchmarks only: no authentication (signatures are ignored), no
versioning, no multipart upload. It exists because moto's server (the
S3-compatible server on PyPI the suite uses elsewhere) keeps every object in a
spooled buffer and copies the whole object on every GET, range GETs included
(`moto/s3/models.py`, `FakeKey.value`), so a range read of a 5 GB object costs
seconds. This one answers a range GET with `os.sendfile` from the file, and
parses requests itself (`http.server` costs ~270 us of CPU per request).

Served: `HEAD` and `GET` of an object (`Range: bytes=a-b`, `a-`, `-n`;
`If-Match` / `If-None-Match` against the ETag), `PUT` of a whole object
(written to a temporary file and renamed in, so readers of the old object
never see a mix), and `ListObjectsV2` (`GET /bucket?list-type=2&prefix=`).
Buckets are the folders directly under `root`; keys are paths below them;
requests are path-style (`http://host:port/bucket/key`). Files elsewhere are
served under a name given in `objects` (`{"bucket/key": "/path/to/file"}`),
read from where they lie: no copy and no hard link, which would change the
file's link count and ctime (and with them the identity that a loader
reading the same file at the same time checks, see `grain_cells.io._identity`).
Serving never writes to a served file or its metadata.

The ETag of an object is derived from its inode, size and modification time,
so replacing or rewriting the file changes it. By default it shows them
(`"ino-size-mtime"` in hex, as nginx's does), so a reader cannot take it for a
digest of the content; with `opaque_etags` it is 32 hex digits (a digest of
the same fields), shaped like the MD5 ETag of an S3 or GCS object.

Example:
  >>> with S3FolderServer("/data/buckets") as server:  # doctest: +SKIP
  ...     url = server.endpoint_url  # http://127.0.0.1:PORT
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import os
import re
import socket
import tempfile
import time
import urllib.parse
from collections.abc import Mapping
from xml.sax.saxutils import escape

from grain_cells.testing.tcp_server import STATS_PATH, TcpServer

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_REASONS = {
    200: "OK",
    206: "Partial Content",
    304: "Not Modified",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    412: "Precondition Failed",
    416: "Range Not Satisfiable",
}


def object_etag(stat: os.stat_result, opaque: bool = False) -> str:
    """The quoted ETag of a file with this `os.stat` result (see the module)."""
    fields = f"{stat.st_ino:x}-{stat.st_size:x}-{stat.st_mtime_ns:x}"
    if opaque:
        return (
            '"' + hashlib.md5(fields.encode(), usedforsecurity=False).hexdigest() + '"'
        )
    return f'"{fields}"'


class S3FolderServer(TcpServer):
    """Serves `root`'s subfolders as S3 buckets on a loopback port, in threads.

    One thread per connection (clients keep connections alive).

    Args:
      root: Folder whose subfolders are the buckets.
      host: Address to listen on (loopback only in tests).
      port: Port, or 0 for a free one.
      latency_s: Seconds to hold every request before answering it (added
        round-trip time without a proxy).
      objects: Extra objects, `{"bucket/key": path}`: the file at `path` is
        served as `key` of `bucket` (read in place; the bucket need not be a
        folder under `root`). They shadow files of the same name in `root`
        and are read-only (a PUT of one is refused).
      requester_pays: Buckets that refuse, as GCS requester-pays buckets
        do (HTTP 400 `UserProjectMissing`), every request without a billing
        project (an `x-goog-user-project` header or a `userProject` query
        parameter). `user_projects` lists the projects requests named.
      opaque_etags: ETags shaped like S3's and GCS's MD5 ETags (32 hex
        digits), which readers take to follow the content, instead of ones
        that show the file's size (see the module).

    Raises:
      ValueError: A name in `objects` is not `bucket/key`.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        latency_s: float = 0.0,
        objects: Mapping[str, str | os.PathLike] | None = None,
        requester_pays: tuple[str, ...] = (),
        opaque_etags: bool = False,
    ):
        self.opaque_etags = opaque_etags
        self.requester_pays = frozenset(requester_pays)
        self.user_projects: list[str] = []
        self.objects = {}
        for name, path in (objects or {}).items():
            bucket, _, key = name.strip("/").partition("/")
            if not bucket or not key:
                raise ValueError(
                    f"objects: {name!r} is not 'bucket/key'; name each file "
                    "as its bucket and key, e.g. 'bench/a.h5ad'"
                )
            self.objects[f"{bucket}/{key}"] = os.path.realpath(os.fspath(path))
        super().__init__(host, port, backlog=256, name="s3-folder-server")
        self.root = os.path.realpath(os.fspath(root))
        self.latency_s = latency_s
        self._counts: dict[str, int] = {}
        self._paths: dict[str, str | None] = dict(self.objects)

    # -- connections --------------------------------------------------------

    def _count(self, **add: int) -> None:
        with self._lock:
            for name, value in add.items():
                self._counts[name] = self._counts.get(name, 0) + value

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pending = b""
        try:
            while True:
                while b"\r\n\r\n" not in pending:
                    data = conn.recv(65536)
                    if not data:
                        return
                    pending += data
                head, _, pending = pending.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target = ([*lines[0].split(" "), "", ""])[:2]
                headers = {}
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length") or 0)
                while len(pending) < length:
                    data = conn.recv(1 << 20)
                    if not data:
                        return
                    pending += data
                body, pending = pending[:length], pending[length:]
                self._answer(conn, method, target, headers, body)
                if headers.get("connection", "").lower() == "close":
                    return
        except OSError:
            pass  # the client (or the fault proxy) hung up
        finally:
            self._forget(conn)

    # -- requests -----------------------------------------------------------

    def _answer(self, conn, method, target, headers, body) -> None:
        if target.startswith(STATS_PATH):
            with self._lock:
                counts = json.dumps(self._counts).encode()
                if "reset=1" in target:
                    self._counts = {}
            _send(conn, 200, {"Content-Type": "application/json"}, counts)
            return
        self._count(requests=1, range_gets=int(method == "GET" and "range" in headers))
        if self.latency_s:
            time.sleep(self.latency_s)
        parsed = urllib.parse.urlsplit(target)
        bucket, _, key = urllib.parse.unquote(parsed.path).lstrip("/").partition("/")
        project = headers.get("x-goog-user-project") or "".join(
            urllib.parse.parse_qs(parsed.query).get("userProject", [])
        )
        if project:
            with self._lock:
                self.user_projects.append(project)
        if bucket in self.requester_pays and not project:
            _error(
                conn,
                method,
                target,
                400,
                "UserProjectMissing",
                "Bucket is a requester pays bucket but no user project provided.",
            )
            return
        if method in ("GET", "HEAD") and key:
            self._get(conn, method, target, bucket, key, headers)
        elif method == "GET" and bucket:
            self._list(conn, target, bucket, urllib.parse.parse_qs(parsed.query))
        elif method == "PUT" and key:
            self._put(conn, target, bucket, key, body)
        else:
            _error(conn, method, target, 405, "MethodNotAllowed", f"{method} {target}")

    def _path(self, bucket: str, key: str) -> str | None:
        """The file of `bucket/key`, or None if it is outside the bucket."""
        name = f"{bucket}/{key}"
        path = self._paths.get(name)
        if path is None and name not in self._paths:
            base = os.path.realpath(os.path.join(self.root, bucket))
            path = os.path.realpath(os.path.join(base, key))
            if os.path.dirname(base) != self.root or not path.startswith(base + os.sep):
                path = None
            self._paths[name] = path
        return path

    def _get(self, conn, method, target, bucket, key, headers) -> None:
        path = self._path(bucket, key)
        try:
            f = open(path, "rb") if path else None  # noqa: SIM115 (closed below)
        except OSError:
            f = None
        if f is None:
            _error(
                conn, method, target, 404, "NoSuchKey", f"no key {key!r} in {bucket!r}"
            )
            return
        with f:
            # The ETag and the bytes come from the same open file: a file
            # replaced meanwhile is a new inode, never a mix.
            stat = os.fstat(f.fileno())
            etag = object_etag(stat, self.opaque_etags)
            if_match = headers.get("if-match")
            if if_match and if_match not in ("*", etag):
                _error(
                    conn, method, target, 412, "PreconditionFailed", f"ETag is {etag}"
                )
                return
            if headers.get("if-none-match") == etag:
                _send(conn, 304, {"ETag": etag}, b"")
                return
            size = stat.st_size
            start, stop, status = 0, size, 200
            out = {
                "ETag": etag,
                "Last-Modified": email.utils.formatdate(stat.st_mtime, usegmt=True),
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
            }
            spec = headers.get("range")
            if spec:
                bounds = _parse_range(spec, size)
                if bounds is None:
                    _error(
                        conn, method, target, 416, "InvalidRange", f"{spec} of {size}"
                    )
                    return
                start, stop = bounds
                status = 206
                out["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
            out["Content-Length"] = str(stop - start)
            conn.sendall(_head(status, out))
            if method == "GET":
                _sendfile(conn, f.fileno(), start, stop - start)
                self._count(response_bytes=stop - start)

    def _put(self, conn, target, bucket, key, body) -> None:
        if f"{bucket}/{key}" in self.objects:
            _error(conn, "PUT", target, 403, "AccessDenied", "a read-only object")
            return
        path = self._path(bucket, key)
        if path is None or not os.path.isdir(os.path.join(self.root, bucket)):
            _error(conn, "PUT", target, 404, "NoSuchBucket", f"no bucket {bucket!r}")
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".put-")
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.replace(tmp, path)
        _send(conn, 200, {"ETag": object_etag(os.stat(path), self.opaque_etags)}, b"")

    def _list(self, conn, target, bucket, query) -> None:
        folder = os.path.join(self.root, bucket)
        mapped = {
            name.partition("/")[2]: path
            for name, path in self.objects.items()
            if name.partition("/")[0] == bucket
        }
        if not os.path.isdir(folder) and not mapped:
            _error(conn, "GET", target, 404, "NoSuchBucket", f"no bucket {bucket!r}")
            return
        prefix = query.get("prefix", [""])[0]
        found = {}
        for dirpath, _, names in os.walk(folder):
            for name in names:
                if name.startswith(".put-"):
                    continue
                path = os.path.join(dirpath, name)
                found[os.path.relpath(path, folder).replace(os.sep, "/")] = path
        found.update(mapped)
        entries = sorted(
            (key, os.stat(path))
            for key, path in found.items()
            if key.startswith(prefix)
        )
        contents = "".join(
            f"<Contents><Key>{escape(key)}</Key><Size>{st.st_size}</Size>"
            f"<ETag>{escape(object_etag(st, self.opaque_etags))}</ETag><LastModified>"
            f"{_iso(st.st_mtime)}</LastModified></Contents>"
            for key, st in entries
        )
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult>'
            f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>"
            f"<KeyCount>{len(entries)}</KeyCount><IsTruncated>false</IsTruncated>"
            f"{contents}</ListBucketResult>"
        ).encode()
        _send(conn, 200, {"Content-Type": "application/xml"}, xml)


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _send(conn, status: int, headers: dict[str, str], body: bytes) -> None:
    conn.sendall(_head(status, {**headers, "Content-Length": str(len(body))}) + body)


def _error(conn, method: str, target: str, status: int, code: str, message: str):
    xml = (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f"<Error><Code>{code}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(target)}</Resource></Error>"
    ).encode()
    headers = {"Content-Type": "application/xml", "Content-Length": str(len(xml))}
    conn.sendall(_head(status, headers) + (b"" if method == "HEAD" else xml))


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


def _sendfile(conn, fd: int, offset: int, count: int) -> None:
    while count > 0:
        sent = os.sendfile(conn.fileno(), fd, offset, count)
        if sent == 0:
            raise ConnectionError("sendfile sent nothing")
        offset += sent
        count -= sent


def _iso(seconds: float) -> str:
    import datetime

    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.000Z")
