r"""CPU per range GET: obstore's calling styles against the local S3 server.

Serves one file (`--data`, default the cached uncompressed Tahoe-shaped file)
with `ServedFolder` (`--server=python`) or `NginxFolder` (`--server=nginx`;
no added latency; the server reads the page cache after the first pass)
and sends `--gets` range GETs of `--range_kib` at
random offsets, in each of:

* `threads=K`: `obstore.get(..., options={"range": ...}).bytes()` from K
  Python threads (what `RemoteByteReader` does, `If-Match` included);
* `async=K`: `obstore.get_async` + `bytes_async` under an asyncio semaphore
  of K, on one event loop;
* `get_ranges`: `obstore.get_ranges` of 64 ranges per call (concurrency
  inside Rust; it cannot send `If-Match`);
* `verified=G/K`: `get_ranges` of G ranges (no coalescing) then a HEAD
  comparing the ETag, from K Python threads (a check after the GETs in
  place of `If-Match` on each);
* `curl=K`: libcurl's multi interface (`pycurl`, not a dependency of the
  package: `pip install pycurl`), K transfers at once from one Python
  thread, each signed with libcurl's own AWS SigV4 and carrying `If-Match`,
  the body written into a buffer allocated per GET: a candidate client with
  less CPU per request than obstore's (the figure decides).

Reported per style: GETs/s, this process's CPU per GET (all its threads,
obstore's runtime included) and the server process's. The first style also
warms the server's page cache; `--repeat` runs the list again.

Usage:
  python benchmarks/range_get_cpu.py
  python benchmarks/range_get_cpu.py --range_kib=10,100 --gets=2000
  python benchmarks/range_get_cpu.py --server=nginx
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import resource
import sys
import tempfile
import time

import bench_util
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

_DATA = flags.DEFINE_string("data", None, "File to serve (default: the cached one).")
_GETS = flags.DEFINE_integer("gets", 3000, "Range GETs per style.")
_RANGE_KIB = flags.DEFINE_list("range_kib", ["100"], "Bytes per GET (KiB).")
_STYLES = flags.DEFINE_list(
    "styles",
    ["threads=16", "threads=16", "threads=64", "async=64", "get_ranges"],
    "threads=K, async=K or get_ranges (the first run also warms the server).",
)
_JSON = flags.DEFINE_string("json", None, "Also write the figures here.")
_SERVER = flags.DEFINE_enum(
    "server", "python", ["python", "nginx"], "The S3-compatible server."
)


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _send(
    style: str, store, key: str, starts: list[int], size: int, etag: str, endpoint: str
):
    import obstore

    def one(start: int):
        options = {"range": (start, start + size), "if_match": etag}
        return obstore.get(store, key, options=options).bytes()

    name, _, k = style.partition("=")
    if name == "threads":
        with concurrent.futures.ThreadPoolExecutor(int(k)) as pool:
            for got in pool.map(one, starts):
                assert len(got) == size
    elif name == "async":

        async def all_gets():
            gate = asyncio.Semaphore(int(k))

            async def get(start):
                async with gate:
                    options = {"range": (start, start + size), "if_match": etag}
                    r = await obstore.get_async(store, key, options=options)
                    return await r.bytes_async()

            return await asyncio.gather(*[get(s) for s in starts])

        for got in asyncio.run(all_gets()):
            assert len(got) == size
    elif name == "verified":
        group, _, threads = k.partition("/")
        group = int(group)

        def batch(part):
            ends = [s + size for s in part]
            got = obstore.get_ranges(store, key, starts=part, ends=ends, coalesce=0)
            if obstore.head(store, key)["e_tag"] != etag:
                raise RuntimeError("changed")
            return got

        parts = [starts[i : i + group] for i in range(0, len(starts), group)]
        with concurrent.futures.ThreadPoolExecutor(int(threads)) as pool:
            for got in pool.map(batch, parts):
                assert all(len(g) == size for g in got)
    elif name == "curl":
        _send_curl(int(k), f"{endpoint}/bench/{key}", starts, size, etag)
    elif name == "get_ranges":
        for i in range(0, len(starts), 64):
            part = starts[i : i + 64]
            ends = [s + size for s in part]
            for got in obstore.get_ranges(store, key, starts=part, ends=ends):
                assert len(got) == size
    else:
        raise app.UsageError(f"unknown style {style!r}")


def _send_curl(k: int, url: str, starts: list[int], size: int, etag: str) -> None:
    import pycurl

    def handle() -> pycurl.Curl:
        c = pycurl.Curl()
        c.setopt(pycurl.AWS_SIGV4, "aws:amz:us-east-1:s3")
        c.setopt(pycurl.USERPWD, "x:x")
        c.setopt(pycurl.BUFFERSIZE, 512 << 10)
        c.setopt(pycurl.TCP_NODELAY, 1)
        return c

    multi = pycurl.CurlMulti()
    free = [handle() for _ in range(k)]
    todo = list(reversed(starts))
    bodies: dict[int, list] = {}
    running = 0
    while todo or running:
        while todo and free:
            c, start = free.pop(), todo.pop()
            body: list = []
            bodies[id(c)] = body
            c.setopt(pycurl.URL, url)
            c.setopt(
                pycurl.HTTPHEADER,
                [f"Range: bytes={start}-{start + size - 1}", f"If-Match: {etag}"],
            )
            c.setopt(pycurl.WRITEFUNCTION, body.append)
            multi.add_handle(c)
            running += 1
        while True:
            ret, _ = multi.perform()
            if ret != pycurl.E_CALL_MULTI_PERFORM:
                break
        _, done, failed = multi.info_read()
        for c in done:
            status = c.getinfo(pycurl.RESPONSE_CODE)
            got = len(b"".join(bodies.pop(id(c))))
            if status != 206 or got != size:
                raise RuntimeError(f"curl GET: status {status}, {got} bytes")
            multi.remove_handle(c)
            free.append(c)
            running -= 1
        if failed:
            raise RuntimeError(f"curl GET failed: {failed[0][2]}")
        if not done:
            multi.select(1.0)


def main(argv):
    del argv
    import obstore
    from obstore.store import S3Store

    path = _DATA.value or bench_util.resolve_data(None, 400_000, 62_710, "none")[0]
    file_size = os.path.getsize(path)
    rng = np.random.default_rng(0)
    results = []
    with (
        tempfile.TemporaryDirectory() as root,
        bench_util.s3_server(_SERVER.value, root, objects={"bench/x": path}) as served,
    ):
        store = S3Store(
            "bench",
            endpoint=served.endpoint_url,
            client_options={"allow_http": True},
            access_key_id="x",
            secret_access_key="x",
            region="us-east-1",
        )
        etag = obstore.head(store, "x")["e_tag"]
        server = served.pids["server"]
        header = ("style", "KiB", "GETs/s", "us CPU/GET", "server us/GET")
        print("{:>12s} {:>5s} {:>8s} {:>11s} {:>14s}".format(*header))
        for kib in [int(v) for v in _RANGE_KIB.value]:
            size = kib << 10
            starts = rng.integers(0, file_size - size, _GETS.value).tolist()
            for style in _STYLES.value:
                own, srv, t0 = _own_cpu(), _cpu_of(server), time.perf_counter()
                _send(style, store, "x", starts, size, etag, served.endpoint_url)
                seconds = time.perf_counter() - t0
                n = len(starts)
                own, srv = _own_cpu() - own, _cpu_of(server) - srv
                row = {
                    "style": style,
                    "range_kib": kib,
                    "gets_per_s": round(n / seconds),
                    "cpu_us_per_get": round(1e6 * own / n, 1),
                    "server_cpu_us_per_get": round(1e6 * srv / n, 1),
                    "load_average": round(os.getloadavg()[0], 1),
                }
                results.append(row)
                print(
                    f"{style:>12s} {kib:5d} {row['gets_per_s']:8d} "
                    f"{row['cpu_us_per_get']:11.1f} "
                    f"{row['server_cpu_us_per_get']:14.1f}",
                    flush=True,
                )
    if _JSON.value:
        bench_util.write_json(
            _JSON.value,
            [path],
            {"gets": _GETS.value, "server": _SERVER.value},
            results,
            synthetic=not _DATA.value,
        )


if __name__ == "__main__":
    app.run(main)
