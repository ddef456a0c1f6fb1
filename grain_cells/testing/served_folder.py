"""`S3FolderServer` behind a `FaultProxy`, in a process of their own.

Benchmarks start the stack here so that the server's and proxy's Python code
does not share a GIL with the loader it serves. Tests start the two parts in
their own process (threads) instead, to set fault rules as they go.

Example:
  >>> with ServedFolder("/tmp/buckets", rtt_s=0.02) as served:  # doctest: +SKIP
  ...     options = served.storage_options()
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import urllib.request


def _serve(root: str, rtt_s: float, conn) -> None:
    from grain_cells.testing.fault_proxy import FaultProxy
    from grain_cells.testing.s3_folder_server import S3FolderServer

    server = S3FolderServer(root).start()
    proxy = FaultProxy(server.address, rtt_s=rtt_s).start()
    conn.send((server.endpoint_url, proxy.endpoint_url))
    conn.recv()  # until told to stop (or the parent's end closes)
    proxy.stop()
    server.stop()


class ServedFolder:
    """Serves `root`'s subfolders as S3 buckets, with `rtt_s` added, in a child.

    Args:
      root: Folder whose subfolders are the buckets.
      rtt_s: Round-trip time the proxy adds to every request.
      timeout_s: How long to wait for the child to start.
    """

    def __init__(self, root: str | os.PathLike, *, rtt_s: float = 0.0, timeout_s=30.0):
        self.root = os.fspath(root)
        self.rtt_s = rtt_s
        self._timeout_s = timeout_s
        self._process = None
        self._conn = None
        self.server_url = self.endpoint_url = ""

    def start(self) -> ServedFolder:
        """Starts the child; returns self once it listens.

        Raises:
          RuntimeError: The child did not start in time.
        """
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve, args=(self.root, self.rtt_s, child), daemon=True
        )
        self._process.start()
        child.close()
        if not self._conn.poll(self._timeout_s):
            self.stop()
            raise RuntimeError(f"the S3 folder server for {self.root} did not start")
        self.server_url, self.endpoint_url = self._conn.recv()
        return self

    def storage_options(self, **extra) -> dict:
        """Storage options that reach the buckets through the proxy."""
        return {
            "endpoint_url": self.endpoint_url,
            "access_key_id": "grain-cells",
            "secret_access_key": "grain-cells",
            "region": "us-east-1",
            **extra,
        }

    def stats(self, reset: bool = False) -> dict[str, int]:
        """The proxy's counters (requests, range GETs, response bytes, ...)."""
        url = f"{self.endpoint_url}/__proxy__/stats" + ("?reset=1" if reset else "")
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.loads(response.read())

    def stop(self) -> None:
        """Stops the child."""
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send("stop")
            self._conn.close()
            self._conn = None
        if self._process is not None:
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
            self._process = None

    def __enter__(self) -> ServedFolder:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
