"""`S3FolderServer` behind a `FaultProxy`, in a process of their own.

Tests and benchmarks start the stack here, never in threads of their own
process: the server's and proxy's Python code would share a GIL with the
loader, and, worse, a server thread that garbage-collects an h5py object
waits for h5py's global lock while the reader holding it waits for the
server (a deadlock). Fault rules travel to the proxy's process pickled with
cloudpickle (`set_rule`).

Example:
  >>> with ServedFolder("/tmp/buckets", rtt_s=0.02) as served:  # doctest: +SKIP
  ...     options = served.storage_options()
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import urllib.parse
import urllib.request
from collections.abc import Mapping


def _serve_folder(root: str, latency_s: float, objects: dict, opaque, conn) -> None:
    from grain_cells.testing.s3_folder_server import S3FolderServer

    server = S3FolderServer(
        root, latency_s=latency_s, objects=objects, opaque_etags=opaque
    ).start()
    conn.send(server.endpoint_url)
    conn.recv()  # until told to stop (or the parent's end closes)
    server.stop()


def _serve_proxy(upstream: tuple[str, int], rtt_s: float, conn) -> None:
    import cloudpickle

    from grain_cells.testing.fault_proxy import FaultProxy

    proxy = FaultProxy(upstream, rtt_s=rtt_s).start()
    conn.send(proxy.endpoint_url)
    while True:  # until told to stop (or the parent's end closes)
        try:
            message = conn.recv()
        except EOFError:
            break
        if message[0] != "rule":
            break
        proxy.set_rule(cloudpickle.loads(message[1]))
        conn.send("ok")
    proxy.stop()


def loopback_storage_options(endpoint_url: str, **extra) -> dict:
    """Storage options for a local S3 stand-in at `endpoint_url` (no auth)."""
    return {
        "endpoint_url": endpoint_url,
        "access_key_id": "grain-cells",
        "secret_access_key": "grain-cells",
        "region": "us-east-1",
        **extra,
    }


class ServedFolder:
    """Serves `root`'s subfolders as S3 buckets with added latency, in children.

    The server and the proxy each run in a process of their own (their Python
    threads would otherwise share one GIL).

    Args:
      root: Folder whose subfolders are the buckets.
      rtt_s: Round-trip time added to every request.
      via_proxy: True: the proxy adds `rtt_s` (as in the fault tests). False:
        no proxy; the server holds each answer `rtt_s` (no extra hop, so the
        cost of the proxy itself can be told apart).
      timeout_s: How long to wait for the children to start.
      objects: Files served from where they lie, `{"bucket/key": path}`
        (see `S3FolderServer`): no copy or link into `root`.
      opaque_etags: S3-shaped ETags (see `S3FolderServer`).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        rtt_s: float = 0.0,
        via_proxy: bool = True,
        timeout_s: float = 30.0,
        objects: Mapping[str, str | os.PathLike] | None = None,
        opaque_etags: bool = False,
    ):
        self.opaque_etags = opaque_etags
        self.root = os.fspath(root)
        self.objects = {k: os.fspath(v) for k, v in (objects or {}).items()}
        self.rtt_s = rtt_s
        self.via_proxy = via_proxy
        self._timeout_s = timeout_s
        self._children: list[tuple] = []
        self.server_url = self.endpoint_url = ""

    def _spawn(self, target, *args) -> str:
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        process = ctx.Process(target=target, args=(*args, child), daemon=True)
        process.start()
        child.close()
        self._children.append((process, conn))
        try:
            if not conn.poll(self._timeout_s):
                raise EOFError
            return conn.recv()
        except (EOFError, OSError):
            self.stop()
            raise RuntimeError(
                f"the S3 folder server for {self.root} did not start (see its "
                "error above; scripts that start it need the "
                "`if __name__ == '__main__':` guard)"
            ) from None

    def start(self) -> ServedFolder:
        """Starts the children; returns self once they listen.

        Raises:
          RuntimeError: A child did not start in time.
        """
        latency = 0.0 if self.via_proxy else self.rtt_s
        self.server_url = self._spawn(
            _serve_folder, self.root, latency, self.objects, self.opaque_etags
        )
        self.endpoint_url = self.server_url
        if self.via_proxy:
            host, port = urllib.parse.urlsplit(self.server_url).netloc.split(":")
            self.endpoint_url = self._spawn(_serve_proxy, (host, int(port)), self.rtt_s)
        return self

    def set_rule(self, rule) -> None:
        """Sets the proxy's fault rule (see `FaultProxy.set_rule`).

        Raises:
          ValueError: There is no proxy (`via_proxy=False`).
        """
        import cloudpickle

        if not self.via_proxy or len(self._children) < 2:
            raise ValueError("no proxy to set a fault rule on (via_proxy=False)")
        _, conn = self._children[1]
        conn.send(("rule", cloudpickle.dumps(rule)))
        conn.recv()

    def storage_options(self, **extra) -> dict:
        """Storage options that reach the buckets (through the proxy if any)."""
        return loopback_storage_options(self.endpoint_url, **extra)

    @property
    def pids(self) -> dict[str, int]:
        """Process ids of the children: `server` and, with a proxy, `proxy`."""
        names = ("server", "proxy")
        return {n: p.pid for n, (p, _) in zip(names, self._children, strict=False)}

    def stats(self, reset: bool = False) -> dict[str, int]:
        """The proxy's counters (requests, range GETs, response bytes, ...).

        Without a proxy, the server's (requests, range GETs, response bytes).
        """
        url = f"{self.endpoint_url}/__proxy__/stats" + ("?reset=1" if reset else "")
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.loads(response.read())

    def stop(self) -> None:
        """Stops the children."""
        for process, conn in reversed(self._children):
            with contextlib.suppress(OSError):
                conn.send(("stop",))
            conn.close()
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
        self._children = []

    def __enter__(self) -> ServedFolder:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
