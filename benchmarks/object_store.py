r"""grain_cells reading .h5ad from an S3-compatible store, beside local disk.

The Tahoe-shaped synthetic files (uncompressed and gzip, `--compressions`)
are served by a local S3-compatible server that holds each answer
`--rtt_ms` before sending it: 20 ms of round-trip time per request, as a
network between the reader and a remote store adds, and like a network it
costs the reader's machine no CPU. `--server` picks the server:

* `nginx` (default; `grain_cells.testing.NginxFolder`, Debian's
  `nginx-light` and `libnginx-mod-http-echo`): a compiled server, ~0.1 ms
  of CPU per range GET, so that on a machine where it shares the reader's
  cores the figure is the reader's, as with a real store elsewhere;
* `python` (`grain_cells.testing.S3FolderServer` in a child process, range
  GETs by `os.sendfile`): the suite's own server, ~0.2-0.4 ms of CPU per
  GET taken from the reader's cores. `--via_proxy` adds the time in
  `FaultProxy` instead, a relay process of its own, as the fault tests do
  (another ~0.13 ms per GET that a real network would not cost).

The server's CPU is reported beside the figures (`server cores`).
For each file and worker count, in one run and back to back:

1. local disk, cold (the file evicted from the page cache);
2. the same file as `s3://bench/NAME`, cold (evicted again, so the server
   reads it from disk).

Both points are `loader_throughput.run_point` (CSR output with the
`--obs_column` label, `--block_size` / `--fetch_factor` / `--batch_size`,
`--warmup` then `--minibatches` timed). Reported: cells/s, the ratio
remote / local, and the range GETs and bytes per fetch (`fetch_factor`
minibatches) the server saw over the whole point (metadata and read-ahead
included).

Usage:
  python benchmarks/object_store.py                     # 400k cells, ~10 min
  python benchmarks/object_store.py --compressions=none --worker_counts=2
  python benchmarks/object_store.py --data=a.h5ad --rtt_ms=20
  python benchmarks/object_store.py --server=python   # the suite's server
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import bench_util
import loader_throughput  # its flags: block_size, fetch_factor, warmup, ...
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

_COMPRESSIONS = flags.DEFINE_list(
    "compressions", ["none", "gzip"], "Synthetic files to serve (ignored with --data)."
)
_RTT_MS = flags.DEFINE_float("rtt_ms", 20.0, "Round-trip time added per request.")
_SERVER = flags.DEFINE_enum(
    "server", "nginx", ["nginx", "python"], "The S3-compatible server (see above)."
)
_VIA_PROXY = flags.DEFINE_boolean(
    "via_proxy",
    False,
    "Add the round-trip time with FaultProxy (a relay process and TCP hop of "
    "its own, using CPU a network would not); default: the server holds each "
    "answer --rtt_ms.",
)
_ROOT = flags.DEFINE_string(
    "bucket_root",
    None,
    "Folder the server runs on (it holds no data: the files are served from "
    "where they lie). Default: a temporary folder.",
)
_READ_OPTIONS = flags.DEFINE_string(
    "object_store_options",
    "",
    "Extra storage options, key=value,... (ints where they parse), e.g. "
    "tuning options of the remote reader.",
)

FLAGS = flags.FLAGS
BUCKET = "bench"


def served_names(file_sets) -> dict[str, str]:
    """`{"bucket/key": path}` of every file: served in place, never linked.

    A hard link would change the file's link count and ctime, which a run
    reading the same file at the same time takes for a changed file.
    """
    objects = {}
    for _, paths in file_sets:
        for path in paths:
            objects[f"{BUCKET}/{os.path.basename(path)}"] = os.path.realpath(path)
    return objects


def main(argv):
    del argv
    file_sets = []
    if loader_throughput._DATA.value:
        file_sets.append(("data", list(loader_throughput._DATA.value)))
    else:
        for compression in _COMPRESSIONS.value:
            paths = bench_util.resolve_data(
                None, FLAGS.n_cells, FLAGS.n_genes, compression, FLAGS.chunks
            )
            file_sets.append((compression, paths))
    # The server's folder (empty; the files are served in place).
    root = _ROOT.value or tempfile.mkdtemp(prefix="grain-cells-s3-")
    try:
        results = measure(root, file_sets)
    finally:
        if not _ROOT.value:
            shutil.rmtree(root, ignore_errors=True)
    if loader_throughput._JSON.value:
        flag_values = {
            "rtt_ms": _RTT_MS.value,
            "via_proxy": _VIA_PROXY.value,
            "server": _SERVER.value,
            "object_store_options": _READ_OPTIONS.value,
            **{k: getattr(FLAGS, k) for k in loader_throughput._CONFIG},
        }
        all_paths = [p for _, ps in file_sets for p in ps]
        bench_util.write_json(
            loader_throughput._JSON.value, all_paths, flag_values, results
        )


def measure(root: str, file_sets) -> list[dict]:
    """Local cold, then s3 cold, for each file set and worker count."""
    os.makedirs(os.path.join(root, BUCKET), exist_ok=True)
    workers = [int(w) for w in FLAGS.worker_counts.split(",")]
    fetches = (1 + FLAGS.warmup + FLAGS.minibatches) / FLAGS.fetch_factor
    results = []
    print(
        f"{'file':5s} {'workers':>7s} {'local cold':>11s} {'s3 cold':>9s} "
        f"{'ratio':>6s} {'GETs/fetch':>10s} {'MB/fetch':>9s} {'first(s)':>8s} "
        f"{'server us/GET':>13s}"
    )
    with bench_util.s3_server(
        _SERVER.value,
        root,
        rtt_s=_RTT_MS.value / 1000,
        via_proxy=_VIA_PROXY.value,
        objects=served_names(file_sets),
    ) as served:
        options = served.storage_options(
            **bench_util.parse_options(_READ_OPTIONS.value)
        )
        for label, paths in file_sets:
            urls = [f"s3://{BUCKET}/{os.path.basename(p)}" for p in paths]
            for wc in workers:
                local = loader_throughput.run_point(paths, "csr", wc, "cold")
                served.stats(reset=True)
                server_cpu = bench_util.process_cpu_s(served.pids["server"])
                remote = loader_throughput.run_point(
                    urls, "csr", wc, "cold", storage_options=options, local_files=paths
                )
                server_cpu = (
                    bench_util.process_cpu_s(served.pids["server"]) - server_cpu
                )
                stats = served.stats()
                row = {
                    "file": label,
                    "worker_count": wc,
                    "rtt_ms": _RTT_MS.value,
                    "local_cold_cells_per_s": local["cells_per_s"],
                    "s3_cold_cells_per_s": remote["cells_per_s"],
                    "ratio": round(remote["cells_per_s"] / local["cells_per_s"], 3),
                    "s3_cells_per_cpu_s": remote["cells_per_cpu_s"],
                    "s3_first_batch_s": remote["first_batch_s"],
                    "range_gets_per_fetch": round(
                        stats.get("range_gets", 0) / fetches, 1
                    ),
                    "mb_per_fetch": round(
                        stats.get("response_bytes", 0) / fetches / 1e6, 2
                    ),
                    "via_proxy": _VIA_PROXY.value,
                    "server": _SERVER.value,
                    "server_cpu_us_per_get": round(
                        1e6 * server_cpu / max(1, stats.get("range_gets", 0)), 1
                    ),
                    "local": local,
                    "s3": remote,
                }
                results.append(row)
                print(
                    f"{label:5s} {wc:7d} {local['cells_per_s']:11,d} "
                    f"{remote['cells_per_s']:9,d} {row['ratio']:6.2f} "
                    f"{row['range_gets_per_fetch']:10.1f} {row['mb_per_fetch']:9.2f} "
                    f"{remote['first_batch_s']:8.2f} "
                    f"{row['server_cpu_us_per_get']:13.1f}",
                    flush=True,
                )
    return results


if __name__ == "__main__":
    app.run(main)
