r"""grain_cells on h5ad vs zarr vs annbatch, on the same cells, in one run.

Issue 26, item 5. One synthetic Tahoe-shaped set of cells (plate-sorted, 14
plates), stored four ways, each made once and cached
(`grain_cells.synthetic`):

* `h5ad`: the uncompressed `.h5ad` (`cached_tahoe_like`);
* `zarr`: the same cells as a zarr v3 sharded store at anndata's defaults
  (zstd; `cached_tahoe_like_zarr`);
* `zarr_raw`: the same, uncompressed;
* `zarr_aligned`: `zarr` read with blocks that follow X's (inner) chunk
  grid (`grain_cells.chunk_aligned`, one chunk a block) and
  `--aligned_fetch` minibatches per fetch: each chunk decoded once per
  visit, many blocks per fetch for the entropy (`h5ad_aligned` and
  `zarr_raw_aligned` may be asked for too);
* `collection`: annbatch's pre-shuffled collection of the same cells,
  written by annbatch at its defaults (`cached_tahoe_like_annbatch`), read
  by grain_cells (`AnnDataSource(grain_cells.annbatch_stores(folder))`);
* `annbatch`: annbatch's own `Loader` on that collection, at its defaults
  (`chunk_size=512`, `preload_nchunks=32`, shuffled), measured in a child
  process run by `--annbatch_python` (annbatch needs Python >= 3.12; the
  other points run in this process). annbatch has no worker processes of
  its own (its reads are concurrent inside one process; worker processes
  would need torch's DataLoader): its 0-worker figure stands beside
  grain_cells at every worker count.

The plate-sorted files are read with `--sorted_block` cells per block and
`--sorted_fetch` minibatches per fetch, chosen so that the plate entropy of
a minibatch of 64 is within 0.05 of annbatch's (which reads a shuffled copy,
so sits at random sampling's ~3.63); the collection, shuffled already, with
grain_cells' defaults (no block size or fetch factor given). Every point
reports cells/s and cells per CPU-second (this process and its children:
the workers) over its window, and the mean plate entropy
(`bench_util.measure_loader`), for each page cache state (`cold`: every
file of the point dropped from the page cache first; `warm`: read once
first) and worker count. Wall-clock cells/s on a shared machine is noise;
cells per CPU-second is the steadier figure.

The decode ceiling of each zarr store: every chunk (inner chunk of a
shard) of X's `data`, `indices` and `indptr` read and decoded by
zarr-python with a thread per core, warm, as cells/s and cells per
CPU-second; for the compressed store also `benchmarks/zarr_decode.py`'s
ceiling (grain_cells' own codec on a thread per core, chunks in memory).

Ratios (printed and in the JSON): `collection` / `annbatch` (target >=
1.5) and `zarr`, `zarr_raw` / `h5ad` (target >= 0.8, or `zarr` at its
decode ceiling), per cache state and worker count.

Usage (the `*_aligned` points with 2 workers read 0.2-0.3x as fast as with
none while a ring held at most 255 slots, fewer than a fetch of 512
minibatches; rings now hold 65,535, issue 35):
  python benchmarks/zarr_read.py --n_cells=400000 --annbatch_dataset_size=2GB \
      --annbatch_python=/path/to/py312/bin/python \
      --points=h5ad,zarr,zarr_raw,zarr_aligned,collection,annbatch \
      --json=zarr_read.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import bench_util
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

POINTS = ("h5ad", "zarr", "zarr_raw", "zarr_aligned", "collection", "annbatch")
_N_CELLS = flags.DEFINE_integer(
    "n_cells", 400_000, "Cells of the synthetic data (plate-sorted, 14 plates)."
)
_N_GENES = flags.DEFINE_integer("n_genes", 62_710, "Genes of the synthetic data.")
_MEAN_NNZ = flags.DEFINE_float("mean_nnz", 1_600.0, "Mean stored values per cell.")
_POINTS = flags.DEFINE_list("points", list(POINTS), f"Points to measure, of {POINTS}.")
_WORKERS = flags.DEFINE_list("workers", ["0", "2"], "grain_cells worker counts.")
_CACHES = flags.DEFINE_list("caches", ["cold", "warm"], "Page cache states.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Cells per minibatch.")
_SORTED_BLOCK = flags.DEFINE_integer(
    "sorted_block", 4, "Block size (cells) on the plate-sorted h5ad and zarr."
)
_SORTED_FETCH = flags.DEFINE_integer(
    "sorted_fetch", 64, "Fetch factor (minibatches per fetch) on the sorted files."
)
_ALIGNED_FETCH = flags.DEFINE_integer(
    "aligned_fetch",
    512,
    "Fetch factor of the *_aligned points: blocks of one chunk (or inner "
    "chunk) of X each, so many blocks per fetch keep the plate entropy up.",
)
_CHUNK_SIZE = flags.DEFINE_integer(
    "annbatch_chunk_size",
    512,
    "Cells per contiguous read of annbatch's Loader (its chunk_size).",
)
_PRELOAD = flags.DEFINE_integer(
    "annbatch_preload_nchunks",
    32,
    "Reads annbatch's Loader gathers and shuffles together (its preload_nchunks).",
)
_DATASET_SIZE = flags.DEFINE_string(
    "annbatch_dataset_size",
    "20GB",
    "annbatch's dataset_size when it writes the collection: cells shuffled "
    "in memory together, one dataset_N each (memory: about twice that).",
)
_ANNBATCH_PYTHON = flags.DEFINE_string(
    "annbatch_python",
    "",
    "Python (>= 3.12, annbatch installed) that makes the collection and runs "
    "the annbatch point; empty: this one.",
)
_CEILING = flags.DEFINE_boolean("ceiling", True, "Measure the zarr decode ceilings.")
_WARMUP = flags.DEFINE_integer("warmup", 5, "Minibatches before the window.")
_MINIBATCHES = flags.DEFINE_integer(
    "minibatches",
    2_000,
    "Minibatches per window: several fetches of every point (a fetch of "
    "--aligned_fetch minibatches, a load of annbatch's 16,384 cells), or the "
    "window times the in-memory split of one fetch.",
)
_MAX_SECONDS = flags.DEFINE_float(
    "max_seconds", 20.0, "The warm-up and the window each stop after this long."
)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling and shuffle seed.")
_JSON = flags.DEFINE_string("json", None, "Write files, flags, points, ratios here.")
_CHILD = flags.DEFINE_string(
    "annbatch_child",
    None,
    "Internal: measure annbatch on this collection, print one JSON line.",
)

_FLAGS = (
    _N_CELLS,
    _N_GENES,
    _MEAN_NNZ,
    _POINTS,
    _WORKERS,
    _CACHES,
    _BATCH,
    _SORTED_BLOCK,
    _SORTED_FETCH,
    _ALIGNED_FETCH,
    _CHUNK_SIZE,
    _PRELOAD,
    _DATASET_SIZE,
    _ANNBATCH_PYTHON,
    _CEILING,
    _WARMUP,
    _MINIBATCHES,
    _MAX_SECONDS,
    _SEED,
)


def _shape() -> dict:
    return {"n_genes": _N_GENES.value, "mean_nnz": _MEAN_NNZ.value}


def _python() -> str:
    return _ANNBATCH_PYTHON.value or sys.executable


def _env() -> dict:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def make_data(points) -> dict:
    """The cached paths of every storage the points read (made if missing)."""
    from grain_cells import synthetic

    n, out = _N_CELLS.value, {}
    out["h5ad"] = str(synthetic.cached_tahoe_like(n, progress=True, **_shape()))
    for name, compressed in (("zarr", True), ("zarr_raw", False)):
        if {name, f"{name}_aligned"} & set(points):
            out[name] = str(
                synthetic.cached_tahoe_like_zarr(
                    n, compressed=compressed, progress=True, **_shape()
                )
            )
    if {"collection", "annbatch"} & set(points):
        code = (
            "import sys; from grain_cells.synthetic import cached_tahoe_like_annbatch"
            f" as c; print(c({n}, n_genes={_N_GENES.value}, "
            f"mean_nnz={_MEAN_NNZ.value!r}, dataset_size={_DATASET_SIZE.value!r}, "
            "progress=True))"
        )
        done = subprocess.run(
            [_python(), "-c", code],
            env=_env(),
            check=True,
            capture_output=True,
            text=True,
        )
        out["collection"] = done.stdout.strip().splitlines()[-1]
    return out


def files_of(path: str) -> list[str]:
    """Every file of a `.h5ad` or a store (a directory)."""
    if os.path.isfile(path):
        return [path]
    return [os.path.join(r, f) for r, _, names in os.walk(path) for f in names]


def describe(path: str) -> dict:
    """A file's or store's size, shape and X's storage (metadata only)."""
    if os.path.isfile(path):
        return bench_util.describe_file(path)
    import zarr

    import grain_cells

    out = {"path": path, "bytes": sum(os.path.getsize(f) for f in files_of(path))}
    root = zarr.open_group(path, mode="r")
    groups = (
        [zarr.open_group(s, mode="r") for s in grain_cells.annbatch_stores(path)]
        if root.attrs.get("encoding-type") == "annbatch-preshuffled"
        else [root]
    )
    data = groups[0]["X"]["data"]
    out.update(
        stores=len(groups),
        shape=[
            sum(int(g["X"].attrs["shape"][0]) for g in groups),
            int(groups[0]["X"].attrs["shape"][1]),
        ],
        nnz=sum(int(g["X"]["data"].shape[0]) for g in groups),
        zarr_format=data.metadata.zarr_format,
        chunks=list(data.chunks),
        shards=None if data.shards is None else list(data.shards),
        codecs=[str(c) for c in data.compressors],
    )
    out["mean_nnz_per_cell"] = round(out["nnz"] / out["shape"][0], 1)
    return out


def _grain_cells(path: str, kind: str, workers: int) -> tuple[dict, bench_util.Loader]:
    """grain_cells over `path`: `sorted`, `aligned` (to X's chunks) or `collection`."""
    import math

    import grain_cells

    paths = grain_cells.annbatch_stores(path) if kind == "collection" else [path]
    block, fetch = {
        "sorted": (_SORTED_BLOCK.value, _SORTED_FETCH.value),
        "collection": (None, None),  # grain_cells' defaults
        "aligned": (None, _ALIGNED_FETCH.value),
    }[kind]
    if kind == "aligned":  # blocks of one chunk, as chunk_aligned asks
        grid = grain_cells.AnnDataSource(paths, block_size=16)
        per_chunk = grain_cells.blocks.mean_cells_per_chunk(grid)
        # a power of two, so that it divides a fetch (batch x fetch factor)
        block = 2 ** math.ceil(math.log2(max(16, 1.25 * per_chunk)))
    source = grain_cells.AnnDataSource(paths, block_size=block, obs_columns=["plate"])
    if kind == "aligned":
        source = grain_cells.chunk_aligned(source)
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=_SEED.value, num_epochs=None),
        operations=grain_cells.fetch_operations(
            source, batch_size=_BATCH.value, fetch_factor=fetch, seed=_SEED.value
        ),
        worker_count=workers,
    )
    iterator = iter(loader)
    chosen = {
        "blocks": len(source),
        "mean_block_cells": round(source.num_cells / len(source), 1),
        "fetch_factor": fetch,
    }
    labels = lambda b: b["obs/plate"][b["mask"]]  # noqa: E731
    return chosen, bench_util.Loader(iterator, labels, iterator.close)


def _annbatch(path: str) -> bench_util.Loader:
    import annbatch
    import pandas as pd

    loader = annbatch.Loader(
        batch_size=_BATCH.value,
        chunk_size=_CHUNK_SIZE.value,
        preload_nchunks=_PRELOAD.value,
        shuffle=True,
        rng=np.random.default_rng(_SEED.value),
        preload_to_gpu=False,
    ).use_collection(annbatch.DatasetCollection(path, mode="r"))

    def forever():
        while True:
            yield from loader

    batches = forever()
    return bench_util.Loader(
        batches, lambda b: pd.factorize(b["obs"]["plate"])[0], batches.close
    )


def _window() -> dict:
    return {
        "warmup": _WARMUP.value,
        "minibatches": _MINIBATCHES.value,
        "max_seconds": _MAX_SECONDS.value,
    }


def measure(point: str, paths: dict, cache: str, workers: int) -> dict:
    """One point at one cache state and worker count."""
    base = point.removesuffix("_aligned")
    path = paths["collection" if point in ("collection", "annbatch") else base]
    if cache == "cold":
        bench_util.evict_page_cache(files_of(path))
    else:
        bench_util.warm_page_cache(files_of(path))
    record = {
        "point": point,
        "cache": cache,
        "workers": workers,
        "load_avg": round(os.getloadavg()[0], 2),
    }
    if point == "annbatch":
        argv = [_python(), os.path.abspath(__file__), f"--annbatch_child={path}"]
        argv += [f"--{k}={v}" for k, v in _window().items()]
        argv += [
            f"--batch_size={_BATCH.value}",
            f"--seed={_SEED.value}",
            f"--annbatch_chunk_size={_CHUNK_SIZE.value}",
            f"--annbatch_preload_nchunks={_PRELOAD.value}",
        ]
        done = subprocess.run(
            argv, env=_env(), capture_output=True, text=True, check=False
        )
        if done.returncode:
            return {**record, "error": done.stderr[-2000:]}
        return {**record, "workers": 0, **json.loads(done.stdout.splitlines()[-1])}
    kind = (
        "collection"
        if point == "collection"
        else "aligned"
        if point.endswith("_aligned")
        else "sorted"
    )
    chosen = {}

    def start():
        nonlocal chosen
        chosen, loader = _grain_cells(path, kind, workers)
        return loader

    result = bench_util.measure_loader(start, workers=workers, **_window())
    return {**record, **chosen, **result}


def decode_ceiling(path: str, codec: bool) -> dict:
    """cells/s and CPU-s per cell decoding every chunk of X once, warm.

    `zarr_python`: zarr-python reads X's three arrays 64 chunks a call with
    a thread per core. With `codec`, also `benchmarks/zarr_decode.py`'s
    ceiling (`zarr-read`'s): every (inner) chunk of `data` and `indices`
    held in memory, then decoded by grain_cells' codec on a thread per
    core; run in a child (its flags clash with these) and only for a
    compressed store (it holds all the chunks in memory at once).
    """
    import zarr

    bench_util.warm_page_cache(files_of(path))
    x = zarr.open_group(path, mode="r")["X"]
    threads = os.cpu_count() or 1
    t0, c0 = time.perf_counter(), time.process_time()
    with zarr.config.set({"threading.max_workers": threads}):
        for name in ("indptr", "indices", "data"):
            array = x[name]
            step = array.chunks[0] * 64  # 64 chunks (inner chunks) a call
            for lo in range(0, array.shape[0], step):
                array[lo : lo + step]
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    cells = int(x.attrs["shape"][0])
    out = {
        "store": path,
        "threads": threads,
        "zarr_python_cells_per_s": round(cells / seconds),
        "zarr_python_cells_per_cpu_s": round(cells / cpu),
    }
    binary = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zarr_decode.py")
    if codec and os.path.exists(binary):
        done = subprocess.run(
            [
                sys.executable,
                binary,
                f"--data={path}",
                "--batches=1",
                f"--threads={threads}",
            ],
            env=_env(),
            capture_output=True,
            text=True,
            check=False,
        )
        try:
            row = json.loads(done.stdout.strip().splitlines()[0])
            out["codec_cells_per_s"] = round(row["ceiling_cells_per_s"])
            out["codec_cells_per_cpu_s"] = round(row["ceiling_cells_per_cpu_s"])
        except (IndexError, KeyError, ValueError):
            out["codec_error"] = done.stderr[-1000:]
    return out


def ratios(results: list[dict], ceilings: list[dict] = ()) -> list[dict]:
    """The issue's ratios per cache state and worker count (cells/s).

    `collection` over `annbatch` (target 1.5); `zarr`, `zarr_raw` and
    `zarr_aligned` over `h5ad` (target 0.8); and `zarr_aligned` over the
    compressed store's decode ceiling (grain_cells' codec on a thread per
    core, chunks in memory: target 0.8, "at the decode ceiling").
    """
    out = []
    codec = next((c for c in ceilings if "codec_cells_per_s" in c), None)
    peer = {
        r["cache"]: r for r in results if r["point"] == "annbatch" and "error" not in r
    }
    for r in results:
        if "error" in r or r["point"] == "annbatch":
            continue
        base = None
        if r["point"] == "collection" and r["cache"] in peer:
            base, target, name = peer[r["cache"]], 1.5, "annbatch"
        elif r["point"] in ("zarr", "zarr_raw", "zarr_aligned"):
            base = next(
                (
                    h
                    for h in results
                    if h["point"] == "h5ad"
                    and h["cache"] == r["cache"]
                    and h["workers"] == r["workers"]
                ),
                None,
            )
            target, name = 0.8, "h5ad"
        if base is None:
            continue
        out.append(_ratio(r, name, base, target, same_entropy=True))
        if r["point"] == "zarr_aligned" and codec is not None:
            ceiling = {
                "cells_per_s": codec["codec_cells_per_s"],
                "cells_per_cpu_s": codec["codec_cells_per_cpu_s"],
                "entropy_mean": base["entropy_mean"],
            }
            out.append(_ratio(r, "decode ceiling", ceiling, 0.8, same_entropy=False))
    return out


def _ratio(r: dict, over: str, base: dict, target: float, *, same_entropy) -> dict:
    """`r` over `base` in cells/s and cells/CPU-s.

    Met at `target` (and, with `same_entropy`, a mean entropy within 0.05 of
    the base's).
    """
    x = r["cells_per_s"] / base["cells_per_s"]
    close = abs(r["entropy_mean"] - base["entropy_mean"]) <= 0.05
    return {
        "point": r["point"],
        "over": over,
        "cache": r["cache"],
        "workers": r["workers"],
        "x_cells_per_s": round(x, 2),
        "x_cells_per_cpu_s": round(r["cells_per_cpu_s"] / base["cells_per_cpu_s"], 2),
        "entropy": r["entropy_mean"],
        "entropy_over": base["entropy_mean"],
        "target": target,
        "met": x >= target and (close or not same_entropy),
    }


def child(path: str) -> None:
    result = bench_util.measure_loader(lambda: _annbatch(path), workers=0, **_window())
    print(json.dumps(result), flush=True)


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CHILD.value:
        return child(_CHILD.value)
    known = {*POINTS, "h5ad_aligned", "zarr_raw_aligned"}
    unknown = sorted(set(_POINTS.value) - known)
    if unknown:
        raise app.UsageError(f"--points: unknown {unknown}; known: {sorted(known)}")
    paths = make_data(_POINTS.value)
    results = []
    for cache in _CACHES.value:
        for workers in (int(w) for w in _WORKERS.value):
            for point in _POINTS.value:
                if point == "annbatch" and workers != int(_WORKERS.value[0]):
                    continue  # in-process only: measured once per cache state
                r = measure(point, paths, cache, workers)
                results.append(r)
                print(json.dumps(r), flush=True)
    ceilings = [
        decode_ceiling(paths[p], codec=p == "zarr")
        for p in ("zarr", "zarr_raw")
        if _CEILING.value and p in paths
    ]
    for c in ceilings:
        print(json.dumps({"decode_ceiling": c}), flush=True)
    table = ratios(results, ceilings)
    for r in table:
        print(json.dumps(r), flush=True)
    if _JSON.value:
        record = {
            "files": {k: describe(v) for k, v in paths.items()},
            "flags": {h.name: h.value for h in _FLAGS},
            "results": results,
            "decode_ceilings": ceilings,
            "ratios": table,
        }
        with open(_JSON.value, "w") as f:
            json.dump(record, f, indent=2, default=str)


if __name__ == "__main__":
    app.run(main)
