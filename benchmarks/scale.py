r"""What grain_cells costs at atlas scale: per cell, per file (issue 33).

Writes thin atlas-shaped files (`grain_cells.synthetic.write_thin_atlas`:
~4 values per cell over 2,000 genes, categorical obs `plate`, `donor`,
`cell_type`, `batch` sorted like plate files, in anndata's layout) and
measures, each measure in a fresh process (this file run again with
`--probe=...`) so that every memory figure is its own (`--smoke` runs a
point's measures in one process, one after the other: its figures only show
that each measure runs):

* `construct`: `AnnDataSource(paths, obs_columns=[the four])`: wall and
  CPU-s, peak RSS growth and anonymous-memory growth, CPU-ms per file;
* `first_batch`: 0 workers, source to first minibatch; then cells/s, cells
  per CPU-s and CPU-ms per minibatch over `--minibatches`;
* `throughput`: 0 workers, after `--minibatches`: cells/s and cells per
  CPU-s over `--throughput_minibatches` (a collection's ratio to the one
  file of the same cells: `vs_one_file.throughput_ratio`; per CPU-s,
  `throughput_cpu_ratio`, and of the medians over parts of 160
  minibatches, `throughput_cpu_median_ratio`);
* `epoch`: one whole epoch with `--workers` workers (run only when named):
  every cell once, cells/s, CPU-s of trainer and workers, and the most fds
  any process held and the most anonymous memory a worker and the trainer
  held (children not yet exec'd left out: `scale_probes.worker_pids`);
* `workers`: `--workers` worker processes after `--minibatches`: RSS, peak
  RSS, anonymous, file-backed and shmem resident MiB, PSS, open fds of the
  trainer and of each worker;
* `fds`: the same fds at each `--fd_workers` count;
* `get_state`: 0 workers, median time of `iterator.get_state()` and its size;
* `weights`: `balanced_block_weights(source, --label)`: CPU-s, memory growth,
  and the pickled size of the `WeightedBlockSampler` (sent to every worker);
* `splits`: `split_by_obs(source, "donor", 10% of donors)`: the same, with
  the pickled size of each view;
* `len`: `grain_cells.loader(split=("train", 90/10))`: construction, `len()`;
* `preshuffle`: `grain_cells.preshuffle` of the files (under `--data_dir`);
* `construct_warm`: `construct` again, in a fresh process after the
  earlier measures filled the metadata caches (name it after `construct`).

`--s3` serves each point's files from a local S3 server
(`grain_cells.testing.ServedFolder`, loopback, `--rtt_ms` added to every
request) where they lie, and the measures read them as `s3://` URLs;
`$GRAIN_CELLS_CACHE` is then a folder of the point's own, empty at its first
measure (so the first `construct` is cold). The server's counters give
`requests_per_minibatch` (and bytes) of the loader measures. With `--s3`
nothing is written into `--data_dir` when the files are there already.

Points: one file per `--cells` x `--compression` (`10M-none`, ...) and one
collection per `--files` x `--compression` of `--collection_cells` cells in
all (`f2000-none`: 2,000 files of 5,000 cells), whose cells are exactly the
cells of the one-file point of the same size, so that per-file costs read
as the difference. A measure that fails (an exception, a crash, more than
`--timeout_s`, or a process tree whose PSS passes `--max_rss_gb`) is
recorded with its last error line and the run goes on. Page cache:
`--cache=cold` evicts the point's files before each measure (default),
`warm` reads them first.

JSON (`--json`): `{"flags", "machine", "points": [{"point", "kind",
"cells", "files", "compression", "bytes", "write_s", "measures": {name:
{figures} | {"error", "returncode"}}}]}`.

Usage:
  python benchmarks/scale.py --smoke
  python benchmarks/scale.py --cells=10M --compression=none,gzip --files= \
      --data_dir=/tmp/scale --json=scale-10M.json
  python benchmarks/scale.py --cells= --files=2000 --data_dir=/tmp/scale
  python benchmarks/scale.py --cells= --files=2000 --data_dir=/tmp/scale --s3 \
      --measures=construct,construct_warm,first_batch,throughput,workers
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import bench_util
import scale_probes
from absl import app, flags

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

_CELLS = flags.DEFINE_list("cells", ["10M"], "One-file points: cells (k/M suffixes).")
_FILES = flags.DEFINE_list("files", ["2000"], "Collection points: file counts.")
_COLLECTION_CELLS = flags.DEFINE_string(
    "collection_cells", "10M", "Cells of each collection, split evenly over its files."
)
_COMPRESSION = flags.DEFINE_list("compression", ["none"], "none and/or gzip.")
_MEASURES = flags.DEFINE_list(
    "measures",
    [
        "construct",
        "first_batch",
        "workers",
        "fds",
        "get_state",
        "splits",
        "weights",
        "len",
    ],
    "What to measure at each point, in a fresh process each (see the module "
    "docstring); preshuffle runs only when named.",
)
_WORKERS = flags.DEFINE_integer("workers", 2, "Worker processes of `workers`.")
_FD_WORKERS = flags.DEFINE_list("fd_workers", ["0", "4"], "Worker counts of `fds`.")
_MINIBATCHES = flags.DEFINE_integer(
    "minibatches", 100, "Minibatches per loader measure."
)
_THROUGHPUT_MINIBATCHES = flags.DEFINE_integer(
    "throughput_minibatches", 1000, "Minibatches timed by `throughput`."
)
_BATCH = flags.DEFINE_integer("batch_size", 64, "Cells per minibatch.")
_LABEL = flags.DEFINE_string("label", "cell_type", "Column of `weights`.")
_SPLIT_COLUMN = flags.DEFINE_string("split_column", "donor", "Column of `splits`.")
_N_DONORS = flags.DEFINE_integer("n_donors", 1_000, "Donors of the thin files.")
_CACHE = flags.DEFINE_enum("cache", "cold", ["cold", "warm"], "Page cache per measure.")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 600, "Seconds allowed per measure.")
_MAX_RSS = flags.DEFINE_float(
    "max_rss_gb",
    6.0,
    "A measure whose process tree's PSS (shared pages counted once) passes "
    "this is killed.",
)
_DATA_DIR = flags.DEFINE_string(
    "data_dir",
    None,
    "Folder of the thin files (kept, reused); default: a "
    "temporary folder removed at the end.",
)
_SMOKE = flags.DEFINE_bool(
    "smoke", False, "Tiny sizes (a test of the binary); flags given still win."
)
_JSON = flags.DEFINE_string("json", None, "Write the points and figures here.")
_ONE_PROCESS = flags.DEFINE_bool(
    "one_process",
    False,
    "Run a point's measures one after the other in one fresh process (each "
    "measure's figures then include what the earlier ones left); --smoke's "
    "default, since the process starts were most of its time.",
)
_PROBE = flags.DEFINE_list(
    "probe", None, "Internal: run these measures, print their figures as JSON."
)
_PATHS = flags.DEFINE_string(
    "paths", None, "Internal: a file listing the probe's files."
)
_S3 = flags.DEFINE_bool(
    "s3", False, "Read the files as s3:// URLs from a local server (see above)."
)
_RTT_MS = flags.DEFINE_float("rtt_ms", 0.0, "With --s3: ms added to each request.")
_OPAQUE_ETAGS = flags.DEFINE_bool(
    "opaque_etags",
    True,
    "With --s3: ETags shaped like S3's and GCS's (32 hex digits); false: "
    "ETags that show the size (nginx's shape), which readers check by "
    "sampling the object's bytes at each process's open.",
)
_BLOCK_SIZE = flags.DEFINE_integer(
    "block_size", None, "Cells per block of the source (default: its own choice)."
)
_MAX_OPEN_FILES = flags.DEFINE_integer(
    "max_open_files",
    None,
    "The source's open-file bound per process (default: its own); below the "
    "file count, files are closed and reopened in turn.",
)
_FILE_LIST = flags.DEFINE_string(
    "file_list",
    None,
    "Measure these existing files (one path a line) as the only point, "
    "instead of the --cells and --files points; only the first --list_files.",
)
_LIST_FILES = flags.DEFINE_integer(
    "list_files", None, "With --file_list: measure only its first N files (all: unset)."
)
_ENDPOINT = flags.DEFINE_string(
    "endpoint", None, "Internal: the S3 endpoint of the probe's URLs."
)
_FRESH_META_CACHE = flags.DEFINE_bool(
    "fresh_meta_cache",
    False,
    "Local points: an empty $GRAIN_CELLS_CACHE of the point's own, so its first "
    "`construct` opens every file (a cold build); `construct_warm` then reads "
    "the entries it stored.",
)
_OBS = ["plate", "donor", "cell_type", "batch"]


def parse_count(text: str) -> int:
    """`10M`, `2k`, `2000`, `1.5M` as an int."""
    text = text.strip().replace("_", "").replace(",", "")
    scale = {"k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _label(n: int) -> str:
    for unit, scale in (("M", 10**6), ("k", 10**3)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _opts(scratch: str) -> dict:
    from grain_cells.testing.served_folder import loopback_storage_options

    endpoint = _ENDPOINT.value
    return {
        "obs_columns": _OBS,
        "block_size": _BLOCK_SIZE.value,
        "max_open_files": _MAX_OPEN_FILES.value,
        "storage_options": loopback_storage_options(endpoint) if endpoint else None,
        "stats_url": endpoint + "/__proxy__/stats" if endpoint else None,
        "batch_size": _BATCH.value,
        "minibatches": _MINIBATCHES.value,
        "throughput_minibatches": _THROUGHPUT_MINIBATCHES.value,
        "workers": _WORKERS.value,
        "fd_workers": [int(n) for n in _FD_WORKERS.value],
        "label": _LABEL.value,
        "split_column": _SPLIT_COLUMN.value,
        "split_categories": _N_DONORS.value,
        "scratch": scratch,
    }


def _points(data_dir: str) -> list[dict]:
    if _FILE_LIST.value:
        with open(_FILE_LIST.value) as f:
            paths = [line.strip() for line in f if line.strip()]
        paths = paths[: _LIST_FILES.value]
        return [
            {
                "point": f"list{len(paths)}",
                "kind": "collection",
                "files": len(paths),
                "cells": None,
                "compression": None,
                "where": os.path.splitext(_FILE_LIST.value)[0],
                "paths": paths,
            }
        ]
    total = parse_count(_COLLECTION_CELLS.value)
    out = []
    for comp in _COMPRESSION.value:
        for cells in filter(None, _CELLS.value):
            n = parse_count(cells)
            out.append(
                {
                    "point": f"{_label(n)}-{comp}",
                    "kind": "file",
                    "cells": n,
                    "files": 1,
                    "compression": comp,
                    "where": os.path.join(data_dir, f"thin-n{n}-{comp}.h5ad"),
                }
            )
        for files in filter(None, _FILES.value):
            k = parse_count(files)
            out.append(
                {
                    "point": f"f{k}-{comp}",
                    "kind": "collection",
                    "cells": total // k * k,
                    "files": k,
                    "compression": comp,
                    "where": os.path.join(
                        data_dir, f"thin-f{k}-n{total // k * k}-{comp}"
                    ),
                }
            )
    return out


def _write(point: dict) -> list[str]:
    """The point's files, written once (under a temporary name, then renamed)."""
    from grain_cells.synthetic import write_thin_atlas, write_thin_collection

    if "paths" in point:  # --file_list: there already
        return point.pop("paths")
    where = point["where"]
    kwargs = {
        "compression": None if point["compression"] == "none" else point["compression"],
        "n_donors": _N_DONORS.value,
    }
    if not os.path.exists(where):
        tmp = where + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.perf_counter()
        if point["kind"] == "file":
            write_thin_atlas(tmp, point["cells"], **kwargs)
        else:
            write_thin_collection(
                tmp, point["files"], point["cells"] // point["files"], **kwargs
            )
        os.replace(tmp, where)
        point["write_s"] = round(time.perf_counter() - t0, 1)
    if point["kind"] == "file":
        return [where]
    return sorted(
        os.path.join(where, n) for n in os.listdir(where) if n.endswith(".h5ad")
    )


def _tree_memory_mb(pid: int) -> tuple[float, float]:
    """(RSS, PSS) summed over `pid` and its descendants, in MiB.

    PSS divides each shared page among the processes mapping it, so workers
    sharing one mapped table count it once; RSS counts it once per process.
    """
    rss = pss = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        r, q = _rollup(p)
        rss, pss = rss + r, pss + q
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(k) for k in f.read().split()]
        except OSError:
            pass
    return rss, pss


def _rollup(pid: int) -> tuple[float, float]:
    found = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    found[key] = int(rest.split()[0]) / 1024
    except OSError:
        pass
    return found.get("Rss", 0.0), found.get("Pss", 0.0)


def _error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln or "Exception" in ln:
            return ln[:500]
    return lines[-1][:500] if lines else ""


def _spawn(measures: list[str], paths_file: str) -> dict:
    """Measures, one after the other, in a fresh process guarded by time and memory.

    Returns `{measure: figures}` of those done and of the one that failed
    (`error`), if any; the rest did not run.
    """
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        f"--probe={','.join(measures)}",
        f"--paths={paths_file}",
    ] + [
        f"--{n}={','.join(map(str, v)) if isinstance(v, list) else v}"
        for n in (
            "workers",
            "fd_workers",
            "minibatches",
            "throughput_minibatches",
            "batch_size",
            "label",
            "split_column",
            "n_donors",
            "data_dir",
            "block_size",
            "max_open_files",
            "endpoint",
        )
        if (v := flags.FLAGS[n].value) is not None
    ]
    out = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed below)
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115
    t0, peak, peak_rss, killed = time.perf_counter(), 0.0, 0.0, None
    proc = subprocess.Popen(
        cmd, stdout=out, stderr=err, text=True, start_new_session=True
    )
    while proc.poll() is None:
        rss, pss = _tree_memory_mb(proc.pid)
        peak, peak_rss = max(peak, pss), max(peak_rss, rss)
        if peak > 1024 * _MAX_RSS.value:
            killed = (
                f"killed: process tree PSS {peak:.0f} MiB > "
                f"--max_rss_gb={_MAX_RSS.value}"
            )
        elif time.perf_counter() - t0 > _TIMEOUT.value:
            killed = f"killed: over --timeout_s={_TIMEOUT.value}"
        if killed:
            os.killpg(proc.pid, 9)
            proc.wait()
            break
        time.sleep(0.1)
    out.seek(0)
    err.seek(0)
    stdout, stderr = out.read(), err.read()
    out.close()
    err.close()
    process = {
        "process_s": round(time.perf_counter() - t0, 1),
        "tree_peak_pss_mb": round(peak, 1),
        "tree_peak_rss_mb": round(peak_rss, 1),
    }
    done = {}  # the probe prints one line `{measure: figures}` per measure
    for line in stdout.splitlines():
        if line.startswith("{"):
            done |= {m: r for m, r in json.loads(line).items() if m in measures}
    records = {m: done[m] | process for m in measures if m in done}
    if killed or proc.returncode != 0:
        failed = next(m for m in measures if m not in done)
        records[failed] = {
            "error": killed or _error_line(stderr),
            "returncode": proc.returncode,
            **process,
            "stderr_tail": stderr[-2000:],
        }
    return records


def _measure(point: dict, paths: list[str], list_file: str) -> None:
    """The point's measures, each in a fresh process.

    With `--one_process`, all in one (a failed measure's successors in the next).
    """
    if _S3.value:
        _measure_s3(point, paths)
        return
    if _FRESH_META_CACHE.value:  # the first `construct` inspects every file
        scratch = tempfile.mkdtemp(prefix="grain_cells_scale_meta-")
        os.environ["GRAIN_CELLS_CACHE"] = scratch
    todo = list(_MEASURES.value)
    while todo:
        if _CACHE.value == "cold":
            bench_util.evict_page_cache(paths)
        else:
            bench_util.warm_page_cache(paths)
        load = {"load_avg": round(os.getloadavg()[0], 2)}
        group = todo if _ONE_PROCESS.value else todo[:1]
        records = _spawn(group, list_file)
        for m, record in records.items():
            point["measures"][m] = load | record
            line = json.dumps(point["measures"][m])[:400]
            print(f"{point['point']} {m}: {line}", flush=True)
        todo = todo[len(records) :]


def _measure_s3(point: dict, paths: list[str]) -> None:
    """`_measure` of the files served as `s3://bench/<name>` (see `--s3`)."""
    from grain_cells.testing import ServedFolder

    scratch = tempfile.mkdtemp(prefix="grain_cells_scale_s3-")
    os.makedirs(os.path.join(scratch, "empty"))
    objects = {f"bench/{os.path.basename(p)}": p for p in paths}
    if len(objects) != len(paths):
        raise app.UsageError("--s3: the files' names must differ")
    list_file = os.path.join(scratch, "urls")
    with open(list_file, "w") as f:
        f.write("\n".join(f"s3://{name}" for name in objects))
    os.environ["GRAIN_CELLS_CACHE"] = os.path.join(scratch, "cache")  # probes'
    served = ServedFolder(
        os.path.join(scratch, "empty"),
        rtt_s=_RTT_MS.value / 1e3,
        via_proxy=False,
        objects=objects,
        opaque_etags=_OPAQUE_ETAGS.value,
    )
    try:
        with served:
            flags.FLAGS.endpoint = served.endpoint_url
            point["s3"] = {"rtt_ms": _RTT_MS.value, "opaque_etags": _OPAQUE_ETAGS.value}
            for m in _MEASURES.value:  # a fresh process each
                if _CACHE.value == "cold":
                    bench_util.evict_page_cache(paths)
                else:
                    bench_util.warm_page_cache(paths)
                served.stats(reset=True)
                records = _spawn([m], list_file)
                record = records.get(m, {}) | {"server": served.stats()}
                point["measures"][m] = {"load_avg": round(os.getloadavg()[0], 2)}
                point["measures"][m] |= record
                line = json.dumps(point["measures"][m])[:400]
                print(f"{point['point']} {m}: {line}", flush=True)
    finally:
        flags.FLAGS.endpoint = None
        shutil.rmtree(scratch, ignore_errors=True)


def _derive(points: list[dict]) -> None:
    """Collections beside the one file of the same cells: per-file costs."""
    single = {(p["cells"], p["compression"]): p for p in points if p["kind"] == "file"}
    for p in points:
        one = single.get((p["cells"], p["compression"]))
        if p["kind"] != "collection" or one is None:
            continue
        mine, base = p["measures"], one["measures"]
        cmp = {"vs_point": one["point"]}
        c1, c0 = mine.get("construct", {}), base.get("construct", {})
        if "construct_cpu_s" in c1 and "construct_cpu_s" in c0:
            cmp["extra_construct_cpu_ms_per_file"] = round(
                1e3 * (c1["construct_cpu_s"] - c0["construct_cpu_s"]) / p["files"], 3
            )
        f1, f0 = mine.get("first_batch", {}), base.get("first_batch", {})
        if "cells_per_s" in f1 and "cells_per_s" in f0:
            cmp["cells_per_s_ratio"] = round(f1["cells_per_s"] / f0["cells_per_s"], 3)
            cmp["cells_per_cpu_s_ratio"] = round(
                f1["cells_per_cpu_s"] / f0["cells_per_cpu_s"], 3
            )
        t1, t0 = mine.get("throughput", {}), base.get("throughput", {})
        if "cells_per_s" in t1 and "cells_per_s" in t0:
            cmp["throughput_ratio"] = round(t1["cells_per_s"] / t0["cells_per_s"], 3)
            cmp["throughput_cpu_ratio"] = round(
                t1["cells_per_cpu_s"] / t0["cells_per_cpu_s"], 3
            )
        m1 = t1.get("cells_per_cpu_s_median_part")
        m0 = t0.get("cells_per_cpu_s_median_part")
        if m1 and m0:
            cmp["throughput_cpu_median_ratio"] = round(m1 / m0, 3)
        p["vs_one_file"] = cmp


def _flag_values() -> dict:
    """This binary's flags that shape the figures (not where files go)."""
    internal = ("data_dir", "json", "probe", "paths", "endpoint")
    return {
        f.name: f.value
        for f in flags.FLAGS.get_flags_for_module(sys.argv[0])
        if f.name not in internal
    }


def _commit() -> str | None:
    done = subprocess.run(
        ["git", "-C", _HERE, "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or None


def _summary(p: dict) -> str:
    parts = []
    for name, r in p["measures"].items():
        if "error" in r:
            parts.append(f"{name}: FAILED ({r['error'][:120]})")
        elif name == "construct":
            parts.append(
                f"construct {r['construct_cpu_s']} CPU-s, "
                f"peak +{r['construct_peak_growth_mb']} MiB"
            )
        elif name == "workers":
            anon = [w.get("anon_mb") for w in r["worker"]]
            parts.append(
                f"workers anon {anon} MiB, trainer fds {r['trainer'].get('fds')}"
            )
    return f"{p['point']}: " + "; ".join(parts)


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _PROBE.value:
        flags.FLAGS.mark_as_parsed()
        with open(_PATHS.value) as f:
            paths = f.read().split("\n")
        opts = _opts(_DATA_DIR.value or tempfile.gettempdir())
        for m in _PROBE.value:  # a line each, printed as soon as it is done
            figures = scale_probes.MEASURES[m](paths, opts)
            print(json.dumps({m: figures}), flush=True)
        return
    if _SMOKE.value:
        for name, value in (
            ("cells", ["3000"]),
            ("files", ["3"]),
            ("collection_cells", "3000"),
            ("minibatches", 3),
            ("throughput_minibatches", 3),
            ("fd_workers", ["0"]),
            ("workers", 1),
            ("n_donors", 20),
            ("timeout_s", 120),
            ("one_process", True),
        ):
            if not flags.FLAGS[name].present:  # flags given win
                flags.FLAGS[name].value = value
    unknown = set(_MEASURES.value) - set(scale_probes.MEASURES)
    if unknown:
        raise app.UsageError(f"--measures: unknown {sorted(unknown)}")
    data_dir = _DATA_DIR.value or tempfile.mkdtemp(prefix="grain_cells_scale-")
    os.makedirs(data_dir, exist_ok=True)
    points = _points(data_dir)
    try:
        for p in points:
            paths = _write(p)
            p["bytes"] = sum(os.path.getsize(q) for q in paths)
            p["file"] = bench_util.describe_file(paths[0])
            list_file = p["where"].rstrip("/") + ".paths"
            if _FILE_LIST.value:  # never beside the files of the list
                list_file = os.path.join(data_dir, "file-list.paths")
            if not _S3.value:  # --s3 writes its own list of URLs
                with open(list_file, "w") as f:
                    f.write("\n".join(paths))
            p["measures"] = {}
            _measure(p, paths, list_file)
            del p["where"]
            print(_summary(p), flush=True)
        _derive(points)
        if _JSON.value:
            with open(_JSON.value, "w") as f:
                json.dump(
                    {
                        "flags": _flag_values(),
                        "machine": {
                            "cpus": os.cpu_count(),
                            "python": sys.version.split()[0],
                            "commit": _commit(),
                        },
                        "points": points,
                    },
                    f,
                    indent=2,
                )
    finally:
        if not _DATA_DIR.value:
            shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
