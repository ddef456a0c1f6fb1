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

For each file and worker count, in one run and back to back:

1. local disk, cold (the file evicted from the page cache);
2. the same file as `s3://bench/NAME`, once per `--server_caches`:
   * `cold`: evicted again, so the server reads its disk while serving,
     on the reader's cores;
   * `warm`: the server's copy read into the page cache first, as a store
     elsewhere serves from its own disks and caches at no CPU cost to the
     reader. The reader's side is the same in both (nothing of the file is
     cached in the reader's process; every byte crosses TCP after
     `--rtt_ms`).

   Why both: a server here reads more from disk than it sends (on a disk
   with a large read-ahead, e.g. 8 MiB of `read_ahead_kb`, nginx's
   `sendfile` of a 100 KiB range fills ~0.5 MiB of page cache), and those
   page-cache fills take the reader's two cores. The `disk/served` column
   shows the factor.

Every point is `loader_throughput.run_point` (CSR output with the
`--obs_column` label, `--block_size` / `--fetch_factor` / `--batch_size`,
`--warmup` then `--minibatches` timed). Reported: cells/s, the ratio
remote / local cold, the range GETs and bytes per fetch (`fetch_factor`
minibatches) the server saw over the whole point (metadata and read-ahead
included), the server's CPU per GET (`server us/GET`) and the bytes the
server's process read from disk per byte it sent (`disk/served`).

Usage:
  python benchmarks/object_store.py                     # 400k cells, ~10 min
  python benchmarks/object_store.py --minibatches=5000   # RESULTS round 8
  python benchmarks/object_store.py --compressions=none --server_caches=warm \
      --minibatches=5000 --repeats=3                     # medians of 3 rounds
  python benchmarks/object_store.py --compressions=none --worker_counts=2
  python benchmarks/object_store.py --data=a.h5ad --rtt_ms=20
  python benchmarks/object_store.py --server=python   # the suite's server
  python benchmarks/object_store.py --server_caches=cold  # as before round 8
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
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
_SERVER_CACHES = flags.DEFINE_list(
    "server_caches",
    ["cold", "warm"],
    "Page-cache states of the served file for the s3 points (see above).",
)
_REPEATS = flags.DEFINE_integer(
    "repeats",
    1,
    "Rounds of every point (each round in the order above); with more than "
    "one, the medians per file, worker count and server cache are printed "
    "and added to the JSON (rows with `repeats`).",
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

# --help shows loader_throughput's flags too (this binary reads them).
flags.adopt_module_key_flags(loader_throughput)
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
    summary = medians(results) if _REPEATS.value > 1 else []
    if summary:
        print_medians(summary)
    if loader_throughput._JSON.value:
        flag_values = {
            "rtt_ms": _RTT_MS.value,
            "via_proxy": _VIA_PROXY.value,
            "server": _SERVER.value,
            "server_caches": _SERVER_CACHES.value,
            "repeats": _REPEATS.value,
            "object_store_options": _READ_OPTIONS.value,
            **{k: getattr(FLAGS, k) for k in loader_throughput._CONFIG},
        }
        all_paths = [p for _, ps in file_sets for p in ps]
        bench_util.write_json(
            loader_throughput._JSON.value,
            all_paths,
            flag_values,
            results + summary,
            synthetic=not loader_throughput._DATA.value,
        )


def measure(root: str, file_sets) -> list[dict]:
    """Local cold, then s3 per server cache state, per file set and worker count."""
    os.makedirs(os.path.join(root, BUCKET), exist_ok=True)
    workers = [int(w) for w in FLAGS.worker_counts.split(",")]
    results = []
    print(
        f"{'file':5s} {'workers':>7s} {'local cold':>11s} {'server':>6s} "
        f"{'s3':>9s} {'ratio':>6s} {'GETs/fetch':>10s} {'MB/fetch':>9s} "
        f"{'first(s)':>8s} {'server us/GET':>13s} {'disk/served':>11s}"
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
        for repeat, (label, paths), wc in itertools.product(
            range(_REPEATS.value), file_sets, workers
        ):
            urls = [f"s3://{BUCKET}/{os.path.basename(p)}" for p in paths]
            local = loader_throughput.run_point(paths, "csr", wc, "cold")
            for cache in _SERVER_CACHES.value:
                row = _remote_point(served, urls, paths, wc, cache, options)
                cells_per_s = local["cells_per_s"]
                row.update(
                    file=label,
                    repeat=repeat,
                    local_cold_cells_per_s=cells_per_s,
                    ratio=round(row["s3_cells_per_s"] / cells_per_s, 3),
                    local=local,
                )
                results.append(row)
                print(
                    f"{label:5s} {wc:7d} {local['cells_per_s']:11,d} {cache:>6s} "
                    f"{row['s3_cells_per_s']:9,d} {row['ratio']:6.2f} "
                    f"{row['range_gets_per_fetch']:10.1f} "
                    f"{row['mb_per_fetch']:9.2f} "
                    f"{row['s3']['first_batch_s']:8.2f} "
                    f"{row['server_cpu_us_per_get']:13.1f} "
                    f"{row['server_disk_per_byte_served']:11.2f}",
                    flush=True,
                )
    return results


def medians(results: list[dict]) -> list[dict]:
    """Per file, worker count and server cache: medians over the repeats."""
    groups: dict[tuple, list[dict]] = {}
    for row in results:
        key = (row["file"], row["worker_count"], row["server_cache"])
        groups.setdefault(key, []).append(row)
    out = []
    for (label, wc, cache), rows in groups.items():
        out.append(
            {
                "file": label,
                "worker_count": wc,
                "server_cache": cache,
                "repeats": len(rows),
                **{
                    f"median_{k}": statistics.median(r[k] for r in rows)
                    for k in ("local_cold_cells_per_s", "s3_cells_per_s", "ratio")
                },
            }
        )
    return out


def print_medians(summary: list[dict]) -> None:
    """The medians' table (printed after the points when there are repeats)."""
    print(
        f"medians: {'file':5s} {'workers':>7s} {'server':>6s} {'repeats':>7s} "
        f"{'local cold':>11s} {'s3':>9s} {'ratio':>6s}"
    )
    for m in summary:
        print(
            f"         {m['file']:5s} {m['worker_count']:7d} "
            f"{m['server_cache']:>6s} {m['repeats']:7d} "
            f"{m['median_local_cold_cells_per_s']:11,.0f} "
            f"{m['median_s3_cells_per_s']:9,.0f} {m['median_ratio']:6.2f}"
        )


def _remote_point(served, urls, paths, wc: int, cache: str, options) -> dict:
    """One s3 point, the server's file `cache` (cold or warm) at its start."""
    fetches = (1 + FLAGS.warmup + FLAGS.minibatches) / FLAGS.fetch_factor
    server = served.pids["server"]
    served.stats(reset=True)
    cpu, disk = bench_util.process_cpu_s(server), bench_util.process_read_bytes(server)
    # run_point evicts or warms `paths` (the served files) from this process,
    # so neither counts in the server's CPU or disk reads.
    remote = loader_throughput.run_point(
        urls, "csr", wc, cache, storage_options=options, local_files=paths
    )
    cpu = bench_util.process_cpu_s(server) - cpu
    disk = bench_util.process_read_bytes(server) - disk
    stats = served.stats()
    gets, sent = stats.get("range_gets", 0), stats.get("response_bytes", 0)
    return {
        "worker_count": wc,
        "server_cache": cache,
        "rtt_ms": _RTT_MS.value,
        "s3_cells_per_s": remote["cells_per_s"],
        "s3_cells_per_cpu_s": remote["cells_per_cpu_s"],
        "s3_first_batch_s": remote["first_batch_s"],
        "range_gets_per_fetch": round(gets / fetches, 1),
        "mb_per_fetch": round(sent / fetches / 1e6, 2),
        "via_proxy": _VIA_PROXY.value,
        "server": _SERVER.value,
        "server_cpu_us_per_get": round(1e6 * cpu / max(1, gets), 1),
        "server_disk_per_byte_served": round(disk / max(1, sent), 3),
        "s3": remote,
    }


if __name__ == "__main__":
    app.run(main)
