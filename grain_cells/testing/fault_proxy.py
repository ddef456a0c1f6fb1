"""An HTTP/1.1 TCP proxy that adds round-trip time and injects faults.

For tests and benchmarks only. It sits between an object-store client and a
local S3-compatible server (`S3FolderServer`, moto) on loopback and:

- adds a fixed round-trip time: each request is held `rtt_s` before it is
  forwarded, and a new connection pays one more `rtt_s` (the TCP handshake);
  response bytes flow back at loopback speed (latency, not bandwidth);
- answers chosen requests itself with an HTTP error (500 InternalError, 503
  SlowDown: S3's throttling reply) without forwarding them;
- drops the connection after a chosen number of response bytes (a connection
  reset mid-body);
- stalls a response for a while after a chosen number of bytes (a slow or
  hung server; clients with a timeout give up and retry).

Which request gets which fault is decided by a rule, a function of the
`Request` (its index among range GETs, method, target, headers) returning a
`Fault` or None. Clients must not pipeline requests on one connection (HTTP
clients don't), so the response bytes that follow a request are its own.

Counters (requests, range GETs, response bytes, faults) are read with
`stats()` in process, or as JSON from `GET /__proxy__/stats` through the proxy
itself (`?reset=1` zeroes them) when the proxy runs in another process.

Example:
  >>> proxy = FaultProxy(server.address, rtt_s=0.02).start()  # doctest: +SKIP
  >>> proxy.set_rule(every(3, Fault.slow_down()))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable

from grain_cells.testing.tcp_server import STATS_PATH, TcpServer, close_socket

_BUFFER = 1 << 20


@dataclasses.dataclass(frozen=True)
class Fault:
    """What the proxy does to one request instead of relaying it plainly.

    Attributes:
      status: Answer with this HTTP status without forwarding (e.g. 500, 503).
      code: The S3 error code of that answer (`InternalError`, `SlowDown`).
      drop_after: Forward, relay this many response bytes, then close.
      stall_s: Forward, then pause the response this long...
      stall_after: ...after this many of its bytes (0: before the headers).
    """

    status: int | None = None
    code: str = "InternalError"
    drop_after: int | None = None
    stall_s: float = 0.0
    stall_after: int = 0

    @classmethod
    def server_error(cls) -> Fault:
        """HTTP 500 InternalError."""
        return cls(status=500, code="InternalError")

    @classmethod
    def slow_down(cls) -> Fault:
        """HTTP 503 SlowDown: S3's throttling answer."""
        return cls(status=503, code="SlowDown")

    @classmethod
    def drop(cls, after_bytes: int = 100) -> Fault:
        """Closes the connection after `after_bytes` of the response."""
        return cls(drop_after=after_bytes)

    @classmethod
    def stall(cls, seconds: float, after_bytes: int = 0) -> Fault:
        """Pauses the response `seconds` after `after_bytes` of it."""
        return cls(stall_s=seconds, stall_after=after_bytes)


@dataclasses.dataclass(frozen=True)
class Request:
    """A request as the rule sees it.

    Attributes:
      index: Its position among the range GETs seen so far (from 0), or -1
        for other requests (HEAD, GETs without `Range`, PUT, lists).
      method: `GET`, `HEAD`, `PUT`, ...
      target: The request target (path and query).
      headers: Header names (lower case) to values.
    """

    index: int
    method: str
    target: str
    headers: dict[str, str]


Rule = Callable[[Request], "Fault | None"]


def every(n: int, fault: Fault, *, first: int = 0, limit: int | None = None) -> Rule:
    """A rule: range GETs number `first`, `first + n`, ... get `fault`.

    Args:
      n: Period.
      fault: The fault.
      first: Index of the first range GET that gets it.
      limit: At most this many faults (None: no limit).
    """

    def rule(request: Request) -> Fault | None:
        k = request.index - first
        if request.index < 0 or k < 0 or k % n:
            return None
        if limit is not None and k // n >= limit:
            return None
        return fault

    return rule


def always(fault: Fault) -> Rule:
    """A rule: every range GET gets `fault` (retries run out)."""
    return lambda request: fault if request.index >= 0 else None


class FaultProxy(TcpServer):
    """Proxies loopback TCP connections to `upstream`, with delay and faults.

    Args:
      upstream: `(host, port)` of the server.
      rtt_s: Round-trip time to add per request (and once more per connection).
      rule: Chooses the fault of each request (None: no faults).
      host: Address to listen on.
      port: Port, or 0 for a free one.
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        rtt_s: float = 0.0,
        rule: Rule | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        super().__init__(host, port, backlog=128, name="fault-proxy")
        self.upstream = upstream
        self.rtt_s = rtt_s
        self._rule = rule
        self._stats = self._zero()

    @staticmethod
    def _zero() -> dict[str, int]:
        return dict(connections=0, requests=0, range_gets=0, response_bytes=0, faults=0)

    def set_rule(self, rule: Rule | None) -> None:
        """Replaces the fault rule (None: relay everything plainly)."""
        with self._lock:
            self._rule = rule

    def stats(self, reset: bool = False) -> dict[str, int]:
        """Counters since start (or the last reset)."""
        with self._lock:
            out = dict(self._stats)
            if reset:
                self._stats = self._zero()
        return out

    # -- connections --------------------------------------------------------

    def _serve(self, client: socket.socket) -> None:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        upstream = None
        try:
            if self.rtt_s:
                time.sleep(self.rtt_s)  # the handshake's round trip
            upstream = socket.create_connection(self.upstream)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._track(upstream)  # the client is tracked since accept
            with self._lock:
                self._stats["connections"] += 1
            plan = _ResponsePlan()
            back = threading.Thread(
                target=self._relay_back, args=(upstream, client, plan), daemon=True
            )
            back.start()
            self._relay_requests(client, upstream, plan)
        except OSError:
            pass
        finally:
            self._forget(*(s for s in (client, upstream) if s is not None))

    def _relay_requests(self, client, upstream, plan: _ResponsePlan) -> None:
        pending = b""
        while True:
            head, pending = _read_head(client, pending)
            if head is None:
                return
            lines = head.decode("latin-1").split("\r\n")
            method, target = ([*lines[0].split(" "), "", ""])[:2]
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length") or 0)
            while len(pending) < length:
                data = client.recv(_BUFFER)
                if not data:
                    return
                pending += data
            body, pending = pending[:length], pending[length:]
            if target.startswith(STATS_PATH):
                _answer(client, 200, json.dumps(self.stats("reset=1" in target)))
                continue
            fault = self._decide(method, target, headers)
            if self.rtt_s:
                time.sleep(self.rtt_s)
            if fault is not None and fault.status is not None:
                message = f"injected by FaultProxy: {fault.code}"
                body_xml = (
                    f"<Error><Code>{fault.code}</Code>"
                    f"<Message>{message}</Message></Error>"
                )
                _answer(client, fault.status, body_xml, "application/xml")
                continue
            plan.set(fault)
            upstream.sendall(head + b"\r\n\r\n" + body)

    def _decide(self, method: str, target: str, headers: dict[str, str]):
        with self._lock:
            self._stats["requests"] += 1
            index = -1
            if method == "GET" and "range" in headers:
                index = self._stats["range_gets"]
                self._stats["range_gets"] += 1
            rule = self._rule
        fault = rule(Request(index, method, target, headers)) if rule else None
        if fault is not None:
            with self._lock:
                self._stats["faults"] += 1
        return fault

    def _relay_back(self, upstream, client, plan: _ResponsePlan) -> None:
        buf = bytearray(_BUFFER)
        view = memoryview(buf)
        try:
            while True:
                n = upstream.recv_into(buf)
                if n == 0:
                    break
                start = 0
                while start < n:
                    step, action = plan.take(n - start)
                    if step:
                        client.sendall(view[start : start + step])
                        start += step
                    if action == "drop":
                        return
                    if action == "stall":
                        time.sleep(plan.pop_stall())
                with self._lock:
                    self._stats["response_bytes"] += n
        except OSError:
            pass
        finally:
            close_socket(client)
            close_socket(upstream)


class _ResponsePlan:
    """Where in the current response to drop or stall (one per connection)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._drop_at: int | None = None
        self._stall_at: int | None = None
        self._stall_s = 0.0

    def set(self, fault: Fault | None) -> None:
        with self._lock:
            self._drop_at = fault.drop_after if fault else None
            stall = fault is not None and fault.stall_s > 0
            self._stall_at = fault.stall_after if stall else None
            self._stall_s = fault.stall_s if stall else 0.0

    def take(self, available: int) -> tuple[int, str | None]:
        """How many bytes to send now, then what to do (None, drop, stall)."""
        with self._lock:
            marks = [
                (m, a)
                for m, a in ((self._drop_at, "drop"), (self._stall_at, "stall"))
                if m is not None
            ]
            if not marks:
                return available, None
            mark, action = min(marks)
            if mark >= available:
                for name in ("_drop_at", "_stall_at"):
                    value = getattr(self, name)
                    if value is not None:
                        setattr(self, name, value - available)
                return available, None
            for name in ("_drop_at", "_stall_at"):
                value = getattr(self, name)
                if value is not None:
                    setattr(self, name, value - mark)
            if action == "stall":
                self._stall_at = None
            return mark, action

    def pop_stall(self) -> float:
        with self._lock:
            seconds, self._stall_s = self._stall_s, 0.0
        return seconds


def _read_head(sock, pending: bytes) -> tuple[bytes | None, bytes]:
    while b"\r\n\r\n" not in pending:
        data = sock.recv(_BUFFER)
        if not data:
            return None, b""
        pending += data
    head, _, rest = pending.partition(b"\r\n\r\n")
    return head, rest


def _answer(sock, status: int, body: str, content_type: str = "application/json"):
    data = body.encode()
    reason = {200: "OK", 500: "Internal Server Error", 503: "Slow Down"}.get(
        status, "Error"
    )
    sock.sendall(
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
