r"""Where the CPU of an s3 read goes: the reader, the server, the proxy.

Serves the uncompressed Tahoe-shaped file as `s3://bench/NAME`
(`--server=python`: `ServedFolder`, `S3FolderServer` holding each answer
`--rtt_ms`, or behind `FaultProxy` adding it with `--via_proxy`;
`--server=nginx`: `NginxFolder`, as in object_store.py),
reads it with 0 workers (block 16 / fetch 16, batch 64, CSR + plate),
`--warmup` minibatches, then times `--minibatches` and reports cells/s and
the CPU cores used by the reading process (all its threads), the server's
process and the proxy's process over the timed part. Warm: the server
reads from the page cache (this tells the CPU cost per cell, not the disk).

Usage:
  python benchmarks/object_store_cpu.py --in_flight=16,64,128 --rtt_ms=20
  python benchmarks/object_store_cpu.py --data=a.h5ad --minibatches=50
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time

import bench_util
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import grain_cells

_IN_FLIGHT = flags.DEFINE_list(
    "in_flight",
    ["16", "64"],
    "Comma-separated max_in_flight values (range GETs in flight per read) to measure.",
)
_RTT_MS = flags.DEFINE_float("rtt_ms", 20.0, "Round-trip time added per request.")
_WARMUP = flags.DEFINE_integer("warmup", 100, "Minibatches before timing.")
_MINIBATCHES = flags.DEFINE_integer(
    "minibatches", 400, "Minibatches in the measured window."
)
_JSON = flags.DEFINE_string("json", None, "Also write the figures here.")
_VIA_PROXY = flags.DEFINE_boolean(
    "via_proxy",
    False,
    "Add the round-trip time in FaultProxy (a relay process); default: the "
    "server holds each answer (as object_store.py).",
)
_SERVER = flags.DEFINE_enum(
    "server", "python", ["python", "nginx"], "The S3-compatible server."
)
_DATA = flags.DEFINE_string(
    "data", None, "An uncompressed .h5ad (default: the cached Tahoe-shaped file)."
)


def _self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def point(served, url: str, in_flight: int) -> dict:
    options = served.storage_options(max_in_flight=in_flight)
    source = grain_cells.AnnDataSource(
        url, block_size=16, obs_columns=["plate"], storage_options=options
    )
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=None),
        operations=grain_cells.fetch_operations(source, batch_size=64, fetch_factor=16),
    )
    iterator = iter(loader)
    for _ in range(_WARMUP.value):
        next(iterator)
    pids = served.pids
    before = {n: bench_util.process_cpu_s(p) for n, p in pids.items()}
    own, t0, cells = _self_cpu_s(), time.perf_counter(), 0
    for _ in range(_MINIBATCHES.value):
        cells += int(next(iterator)["mask"].sum())
    seconds = time.perf_counter() - t0
    own = _self_cpu_s() - own
    cores = {
        n: round((bench_util.process_cpu_s(p) - before[n]) / seconds, 2)
        for n, p in pids.items()
    }
    iterator.close()
    return {
        "max_in_flight": in_flight,
        "rtt_ms": _RTT_MS.value,
        "cells_per_s": round(cells / seconds),
        "reader_cores": round(own / seconds, 2),
        "cells_per_reader_cpu_s": round(cells / own),
        **{f"{n}_cores": c for n, c in cores.items()},
        "load_average": round(os.getloadavg()[0], 1),
    }


def main(argv):
    del argv
    path = _DATA.value or bench_util.resolve_data(None, 400_000, 62_710, "none")[0]
    # The file is served in place (`objects`): a hard link into a folder
    # would change its ctime, and every other reader of it would see a
    # changed file.
    with tempfile.TemporaryDirectory() as root:
        url = f"s3://bench/{os.path.basename(path)}"
        results = []
        with bench_util.s3_server(
            _SERVER.value,
            root,
            rtt_s=_RTT_MS.value / 1000,
            via_proxy=_VIA_PROXY.value,
            objects={f"bench/{os.path.basename(path)}": path},
        ) as served:
            for k in [int(v) for v in _IN_FLIGHT.value]:
                row = point(served, url, k)
                results.append(row)
                print(row, flush=True)
    if _JSON.value:
        bench_util.write_json(
            _JSON.value,
            [path],
            {"rtt_ms": _RTT_MS.value, "server": _SERVER.value},
            results,
            synthetic=not _DATA.value,
        )


if __name__ == "__main__":
    app.run(main)
