"""nginx serving files as S3 objects for range reads, with added latency.

For benchmarks: a compiled server whose CPU per request is a fraction of a
Python server's, so that on a machine where the server shares the reader's
cores (this project's 2-core machines) the figure measures the reader, not
the stand-in for the store. It answers what a reader of a stored object
sends, path-style (`http://host:port/bucket/key`): `HEAD` and `GET` with
`Range` (206 and `Content-Range`), `If-Match` against the ETag (412 when it
differs) and keep-alive connections; signatures are ignored. It does not
list, write or version objects: tests of those use `S3FolderServer`.

The added round-trip time is nginx's echo module (`echo_sleep` on a timer,
then `echo_exec` to the file): no CPU while a request waits, as on a network.
Needs Debian's `nginx-light` and `libnginx-mod-http-echo` (`apt-get install
nginx-light libnginx-mod-http-echo`; the module only when `rtt_s > 0`).

The ETag is nginx's: modification time (in seconds) and size, so a file
rewritten with the same size within the same second keeps its ETag: fine
for benchmarks, not for tests of change detection (`S3FolderServer` there).

Example:
  >>> with NginxFolder("/tmp/buckets", rtt_s=0.02, objects={"b/k": path}) as s:
  ...     options = s.storage_options()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping

from grain_cells.testing.served_folder import loopback_storage_options

_MODULE_DIRS = ("/usr/lib/nginx/modules", "/usr/share/nginx/modules")
INSTALL_HINT = "apt-get install nginx-light libnginx-mod-http-echo"
_LOG_FLUSH_MS = 100  # access log buffered with immutable=True


def find_nginx() -> str | None:
    """The nginx binary on PATH or in /usr/sbin, or None."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")


def echo_module() -> str | None:
    """The path of nginx's echo module (Debian's package), or None."""
    for d in _MODULE_DIRS:
        found = glob.glob(os.path.join(d, "ngx_http_echo_module.so"))
        if found:
            return found[0]
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NginxFolder:
    """Serves `root`'s subfolders and `objects` as S3 buckets through nginx.

    Args:
      root: Folder whose subfolders are buckets (may be empty).
      rtt_s: Seconds each request is held before it is answered
        (milliseconds are the resolution).
      objects: Files served from where they lie, `{"bucket/key": path}`
        (symbolic links in a private folder: the files themselves, their
        link count and ctime, are untouched).
      timeout_s: How long to wait for nginx to listen.
      immutable: The files do not change while served (benchmarks): nginx
        keeps them open between requests (`open_file_cache`) and buffers
        its access log (`stats` then waits for the flush), ~25% less of its
        CPU per GET for 100 KiB ranges (`benchmarks/range_get_cpu.py`):
        CPU on the reader's cores that a store elsewhere would not take.

    Raises (from `start`):
      RuntimeError: nginx (or, with `rtt_s > 0`, its echo module) is not
        installed, or nginx did not start; names the install command.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        rtt_s: float = 0.0,
        objects: Mapping[str, str | os.PathLike] | None = None,
        timeout_s: float = 30.0,
        immutable: bool = False,
    ):
        self.root = os.fspath(root)
        self.immutable = bool(immutable)
        self.rtt_s = round(float(rtt_s), 3)
        self.objects = {k: os.fspath(v) for k, v in (objects or {}).items()}
        self._timeout_s = timeout_s
        self._process: subprocess.Popen | None = None
        self._dir: str | None = None
        self._log_offset = 0
        self.endpoint_url = ""

    def _config(self, nginx: str, port: int, docroot: str) -> str:
        lines = []
        if self.rtt_s > 0:
            module = echo_module()
            if module is None:
                raise RuntimeError(
                    "NginxFolder(rtt_s > 0) needs nginx's echo module "
                    f"(ngx_http_echo_module.so in {' or '.join(_MODULE_DIRS)}): "
                    f"{INSTALL_HINT}"
                )
            lines.append(f"load_module {module};")
        version = subprocess.run(
            [nginx, "-V"], capture_output=True, text=True, check=False
        ).stderr
        aio = "aio threads;" if "--with-threads" in version else ""
        user = "user root;" if os.geteuid() == 0 else ""
        d = self._dir
        log, files = "", ""
        if self.immutable:
            log = f" buffer=64k flush={_LOG_FLUSH_MS}ms"
            files = "open_file_cache max=1024 inactive=3600s;\n  "
            files += "open_file_cache_valid 3600s;"
        if self.rtt_s > 0:
            location = (
                f"location / {{ echo_sleep {self.rtt_s:.3f}; echo_exec @file; }}\n"
                "    location @file { }"
            )
        else:
            location = "location / { }"
        lines.append(f"""
daemon off;
{user}
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  log_format counts '$status $body_bytes_sent $request_method';
  access_log {d}/access.log counts{log};
  sendfile on;
  {files}
  {aio}
  tcp_nodelay on;
  keepalive_requests 10000000;
  keepalive_timeout 600s;
  client_body_temp_path {d}/body;
  proxy_temp_path {d}/proxy;
  fastcgi_temp_path {d}/fastcgi;
  uwsgi_temp_path {d}/uwsgi;
  scgi_temp_path {d}/scgi;
  default_type application/octet-stream;
  server {{
    listen 127.0.0.1:{port};
    root {docroot};
    {location}
  }}
}}
""")
        return "\n".join(lines)

    def start(self) -> NginxFolder:
        """Starts nginx; returns self once it answers.

        Raises:
          RuntimeError: nginx is missing or did not start.
        """
        nginx = find_nginx()
        if nginx is None:
            raise RuntimeError(f"NginxFolder needs nginx on PATH: {INSTALL_HINT}")
        self._dir = tempfile.mkdtemp(prefix="grain-cells-nginx-")
        try:
            self._launch(nginx)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, nginx: str) -> None:
        """Writes the private folder and config, starts nginx, waits for it."""
        docroot = os.path.join(self._dir, "root")
        os.makedirs(docroot)
        for name in os.listdir(self.root):
            if os.path.isdir(os.path.join(self.root, name)):
                os.symlink(os.path.join(self.root, name), os.path.join(docroot, name))
        for key, path in self.objects.items():
            link = os.path.join(docroot, key)
            os.makedirs(os.path.dirname(link), exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(link)
            os.symlink(os.path.realpath(path), link)
        port = _free_port()
        conf = os.path.join(self._dir, "nginx.conf")
        with open(conf, "w") as f:
            f.write(self._config(nginx, port, docroot))
        self._process = subprocess.Popen(
            [nginx, "-c", conf, "-p", self._dir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.endpoint_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self._timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                err = self._process.stderr.read().decode(errors="replace")
                raise RuntimeError(
                    f"nginx did not start ({err.strip()}); {INSTALL_HINT}"
                )
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), timeout=1),
            ):
                return
            time.sleep(0.05)
        raise RuntimeError(
            f"nginx did not listen on port {port} in {self._timeout_s} s"
        )

    def storage_options(self, **extra) -> dict:
        """Storage options that reach the buckets."""
        return loopback_storage_options(self.endpoint_url, **extra)

    @property
    def pids(self) -> dict[str, int]:
        """`{"server": pid}` of nginx's worker process (where requests run)."""
        master = self._process.pid
        try:
            with open(f"/proc/{master}/task/{master}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        return {"server": kids[0] if kids else master}

    def stats(self, reset: bool = False) -> dict[str, int]:
        """Requests, range GETs (206) and response bytes since the last reset.

        With `immutable=True`, waits for nginx to flush its log buffer first.
        """
        if self.immutable:
            time.sleep(3 * _LOG_FLUSH_MS / 1000)
        path = os.path.join(self._dir, "access.log")
        requests = range_gets = response_bytes = 0
        with open(path, "rb") as f:
            f.seek(self._log_offset)
            for line in f:
                status, sent, _ = line.split(b" ", 2)
                requests += 1
                range_gets += status == b"206"
                response_bytes += int(sent)
            if reset:
                self._log_offset = f.tell()
        return {
            "requests": requests,
            "range_gets": range_gets,
            "response_bytes": response_bytes,
        }

    def stop(self) -> None:
        """Stops nginx and removes its folder."""
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process.stderr.close()
            self._process = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> NginxFolder:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
