"""A loopback TCP server in daemon threads: listen, accept, serve, close.

What `S3FolderServer` and `FaultProxy` share. A subclass implements
`_serve(conn)` (one thread per accepted connection) and calls
`_forget(conn)` when it is done with one; `stop()` closes the listener and
every connection still open.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Self

# Counters as JSON (`?reset=1` zeroes them), answered by both servers.
STATS_PATH = "/__proxy__/stats"


class TcpServer:
    """Accepts loopback connections and serves each in its own thread.

    Args:
      host: Address to listen on.
      port: Port, or 0 for a free one.
      backlog: Connections the listener queues.
      name: Name of the accepting thread.
    """

    def __init__(self, host: str, port: int, *, backlog: int, name: str):
        self._listener = socket.create_server((host, port), backlog=backlog)
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._name = name

    @property
    def address(self) -> tuple[str, int]:
        """`(host, port)` the server listens on."""
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    @property
    def endpoint_url(self) -> str:
        """`http://host:port`, for `storage_options={"endpoint_url": ...}`."""
        host, port = self.address
        return f"http://{host}:{port}"

    def start(self) -> Self:
        """Starts accepting in a daemon thread; returns self."""
        self._thread = threading.Thread(
            target=self._accept, name=self._name, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops accepting and closes every open connection."""
        self._closing = True
        with contextlib.suppress(OSError):
            # Wake accept() with a connection of our own.
            socket.create_connection(self.address, timeout=1).close()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            close_socket(conn)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if self._closing:
                conn.close()
                return
            self._track(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _track(self, *socks: socket.socket) -> None:
        """Registers sockets for `stop()` to close."""
        with self._lock:
            self._conns.update(socks)

    def _forget(self, *socks: socket.socket) -> None:
        """Closes sockets and drops them from the registry."""
        with self._lock:
            self._conns.difference_update(socks)
        for sock in socks:
            close_socket(sock)

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError


def close_socket(sock: socket.socket) -> None:
    """Shuts a socket down both ways and closes it (errors ignored)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
