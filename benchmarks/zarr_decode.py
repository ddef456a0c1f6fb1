r"""Reading a zarr AnnData store's CSR X: decode ceiling and RangeReader speed.

For one store (given, or written here by anndata with its defaults) this
binary measures, in one run:

1. the **decode ceiling**: every chunk (inner chunk when sharded) of
   `X/data` and `X/indices` read into memory (not timed), then decoded by
   `--threads` threads (default: every core) with
   `grain_cells.zarr._codecs.Codec`; cells/s = cells of the store over the
   wall time, with the CPU seconds;
2. the **loader's batch shape**: `--batches` batches of `--blocks` random
   blocks of `--block_size` cells (indptr, then data and indices ranges),
   read by
   * `stub`: zarr-python slicing, one `Array.__getitem__` per merged range
     (main's first RangeReader), with zarr's default codec pipeline, and
     with the `zarrs` codec pipeline when `zarrs` is importable
     (`pip install zarrs`);
   * `fast`: `grain_cells.zarr.RangeReader` without a pool and with a pool
     of `--threads` threads;
   each warm (pages cached) and cold (`posix_fadvise(DONTNEED)` on every
   file of the store before the batches);
3. with `--remote_latency_ms=MS`: the fast reader on the store served as a
   bucket on localhost (`grain_cells.testing.s3_folder_server`, MS added per
   request), without and with `advise` of the next batch, with the requests
   per batch;
4. with `--digest_keys=N`: `store_digest` of a store of N chunk keys.

On a shared machine, compare CPU seconds per batch and ratios of one run;
wall-clock figures measure the neighbours too.

Usage:
  python benchmarks/zarr_decode.py                         # 100k cells, v2 and v3
  python benchmarks/zarr_decode.py --data=atlas.zarr --out=zarr_decode.json
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import tempfile
import time
import warnings

import bench_util
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from grain_cells.zarr._reads import RangeReader
from grain_cells.zarr._store import open_group, store_digest

_DATA = flags.DEFINE_list(
    "data",
    None,
    "zarr AnnData stores with CSR X (default: written here, see --formats).",
)
_FORMATS = flags.DEFINE_list(
    "formats",
    ["v2", "v3", "v3-sharded"],
    "Stores written here when --data is not given: v2 (anndata 0.12's default, "
    "blosc-lz4), v3 (zstd), v3-sharded (anndata's auto sharding).",
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Folder for the stores written here (default: a temporary one)."
)
_N_CELLS = flags.DEFINE_integer("n_cells", 100_000, "Cells of the written stores.")
_N_GENES = flags.DEFINE_integer("n_genes", 20_000, "Genes of the written stores.")
_NNZ = flags.DEFINE_integer("nnz_per_cell", 1_000, "Stored values per cell.")
_BLOCK = flags.DEFINE_integer("block_size", 16, "Cells per block.")
_BLOCKS = flags.DEFINE_integer("blocks", 16, "Random blocks per batch (one read).")
_BATCHES = flags.DEFINE_integer("batches", 40, "Batches timed per reader.")
_THREADS = flags.DEFINE_integer("threads", 0, "Decoding threads (0: every core).")
_DIGEST_KEYS = flags.DEFINE_integer(
    "digest_keys", 0, "Also time store_digest on a store of this many keys (0: no)."
)
_REMOTE_MS = flags.DEFINE_float(
    "remote_latency_ms",
    -1.0,
    "Also read each store as a bucket (grain_cells.testing.s3_folder_server on "
    "localhost, this many ms added per request; -1: no).",
)
_OUT = flags.DEFINE_string("out", None, "JSON file for the results.")
_RECORDED = (
    "data",
    "formats",
    "n_cells",
    "n_genes",
    "nnz_per_cell",
    "block_size",
    "blocks",
    "batches",
    "threads",
    "digest_keys",
    "remote_latency_ms",
)


def write_store(path: str, fmt: str) -> None:
    """A CSR AnnData store written by anndata with its defaults for `fmt`."""
    import anndata
    import scipy.sparse as sp

    n, g, per = _N_CELLS.value, _N_GENES.value, _NNZ.value
    rng = np.random.default_rng(0)
    indptr = np.arange(n + 1, dtype=np.int64) * per
    idx = np.sort(rng.integers(0, g, size=(n, per), dtype=np.int32), axis=1).ravel()
    data = rng.poisson(2.0, size=n * per).astype(np.float32) + 1
    X = sp.csr_matrix((data, idx, indptr), shape=(n, g))
    with warnings.catch_warnings():  # anndata 0.13 deprecates zarr_write_format
        warnings.simplefilter("ignore")
        with anndata.settings.override(
            zarr_write_format=2 if fmt == "v2" else 3,
            auto_shard_zarr_v3=fmt == "v3-sharded",
        ):
            anndata.AnnData(X).write_zarr(path)


def store_files(path: str) -> list[str]:
    return [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]


def decode_ceiling(path: str, threads: int) -> dict:
    group = open_group(path)
    n_cells = group["X/indptr"].shape[0] - 1
    jobs = []
    for name in ("data", "indices"):
        reader = RangeReader(group[f"X/{name}"], path)
        chunks = reader
        if not reader.direct:
            return {"ceiling": "codecs not decoded here"}
        n_chunks = -(-reader.shape[0] // reader.chunk_length)
        units = [(k,) for k in range(n_chunks)]
        if chunks.codec.shard is not None:
            reader.pin()
        for u in units:
            key, a, b = chunks.request(u)
            raw = chunks.keys.get(key, a, b)
            jobs.append((chunks.codec, raw))
    t0, c0 = time.perf_counter(), bench_util.cpu_seconds()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda job: job[0].decode(job[1]), jobs))
    wall, cpu = time.perf_counter() - t0, bench_util.cpu_seconds() - c0
    return {
        "ceiling_cells_per_s": n_cells / wall,
        "ceiling_cells_per_cpu_s": n_cells / cpu,
        "chunks": len(jobs),
        "threads": threads,
    }


def batches(indptr: np.ndarray, count: int, seed: int):
    rng = np.random.default_rng(seed)
    n_blocks = (indptr.size - 1) // _BLOCK.value
    for _ in range(count):
        s = np.sort(rng.choice(n_blocks, _BLOCKS.value, replace=False)) * _BLOCK.value
        yield s, indptr[s], indptr[s + _BLOCK.value]


def stub_read(array, starts, stops, out) -> None:
    at = 0
    for a, b in zip(starts.tolist(), stops.tolist(), strict=False):
        out[at : at + b - a] = array[a:b]
        at += b - a


def time_reader(path: str, kind: str, pool, cold: bool) -> dict:
    group = open_group(path)
    arrays = {k: group[f"X/{k}"] for k in ("indptr", "data", "indices")}
    indptr = arrays["indptr"][:]
    readers = {
        k: RangeReader(a, path, cache_bytes=64 << 20 if k == "indptr" else 0)
        for k, a in arrays.items()
    }
    if cold:
        bench_util.evict_page_cache(store_files(path))
    else:
        bench_util.warm_page_cache(store_files(path))
    c0, t0 = bench_util.cpu_seconds(), time.perf_counter()
    cells = 0
    for blocks, lo, hi in batches(indptr, _BATCHES.value, seed=1 + cold):
        cells += blocks.size * _BLOCK.value
        outs = {}
        for name, (a, b) in (
            ("indptr", (blocks, blocks + _BLOCK.value)),
            ("data", (lo, hi)),
            ("indices", (lo, hi)),
        ):
            out = np.empty(int((b - a).sum()), readers[name].dtype)
            if kind == "fast":
                readers[name].read(a, b, out, pool)
            else:
                stub_read(arrays[name], a, b, out)
            outs[name] = out
    wall, cpu = time.perf_counter() - t0, bench_util.cpu_seconds() - c0
    return {
        "cells_per_s": cells / wall,
        "cpu_ms_per_batch": 1000 * cpu / _BATCHES.value,
        "cells_per_cpu_s": cells / cpu,
    }


def time_remote(path: str, pool, advise: bool) -> dict:
    """The fast reader on the store served as a bucket.

    With `advise`, each batch's chunks are fetched ahead while the previous
    one is read.
    """
    import urllib.request

    from grain_cells.testing.s3_folder_server import STATS_PATH, S3FolderServer

    root, name = os.path.split(os.path.abspath(path))
    parent, bucket = os.path.split(root)
    with S3FolderServer(parent, latency_s=_REMOTE_MS.value / 1000) as server:
        url = f"s3://{bucket}/{name}"
        options = {
            "endpoint_url": server.endpoint_url,
            "region": "us-east-1",
            "skip_signature": True,
        }
        group = open_group(url, options)
        readers = {
            k: RangeReader(group[f"X/{k}"], url, cache_bytes=64 << 20)
            if k == "indptr"
            else RangeReader(group[f"X/{k}"], url)
            for k in ("indptr", "data", "indices")
        }
        readers["indptr"].pin()
        indptr = group["X/indptr"][:]
        plan = list(batches(indptr, _BATCHES.value, seed=3))
        stats = f"{server.endpoint_url}{STATS_PATH}?reset=1"
        urllib.request.urlopen(stats).read()
        c0, t0 = bench_util.cpu_seconds(), time.perf_counter()
        for i, (_, lo, hi) in enumerate(plan):
            if advise and i + 1 < len(plan):
                for name in ("data", "indices"):
                    readers[name].advise(plan[i + 1][1], plan[i + 1][2])
            for name in ("data", "indices"):
                out = np.empty(int((hi - lo).sum()), readers[name].dtype)
                readers[name].read(lo, hi, out, pool)
        wall, cpu = time.perf_counter() - t0, bench_util.cpu_seconds() - c0
        counts = json.loads(urllib.request.urlopen(stats).read())
    cells = len(plan) * _BLOCKS.value * _BLOCK.value
    return {
        "cells_per_s": cells / wall,
        "cpu_ms_per_batch": 1000 * cpu / len(plan),
        "cells_per_cpu_s": cells / cpu,
        "requests_per_batch": counts.get("requests", 0) / len(plan),
    }


def digest_cost(n_keys: int, workdir: str) -> dict:
    import zarr

    path = os.path.join(workdir, f"keys{n_keys}.zarr")
    if not os.path.exists(path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = zarr.create_array(
                path, shape=(n_keys,), chunks=(1,), dtype="u1", fill_value=0
            )
            a[:] = 1
    c0, t0 = bench_util.cpu_seconds(), time.perf_counter()
    store_digest(path)
    return {
        "digest_keys": n_keys,
        "digest_s": time.perf_counter() - t0,
        "digest_cpu_s": bench_util.cpu_seconds() - c0,
    }


def zarrs_available() -> bool:
    try:
        import zarrs  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv) -> None:
    del argv
    import zarr

    threads = _THREADS.value or os.cpu_count() or 1
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="zarr_decode-")
    stores = _DATA.value
    if not stores:
        stores = []
        for fmt in _FORMATS.value:
            path = os.path.join(
                workdir,
                f"csr-{fmt}-n{_N_CELLS.value}-g{_N_GENES.value}-k{_NNZ.value}.zarr",
            )
            if not os.path.exists(path):
                write_store(path, fmt)
            stores.append(path)
    results = []
    pool = concurrent.futures.ThreadPoolExecutor(threads)
    pipelines = ["default"] + (["zarrs"] if zarrs_available() else [])
    for path in stores:
        row = {"store": os.path.basename(path), **decode_ceiling(path, threads)}
        for cold in (False, True):
            temp = "cold" if cold else "warm"
            for pipeline in pipelines:
                path_name = {
                    "default": "zarr.core.codec_pipeline.BatchedCodecPipeline",
                    "zarrs": "zarrs.ZarrsCodecPipeline",
                }[pipeline]
                with zarr.config.set({"codec_pipeline.path": path_name}):
                    row[f"stub_{pipeline}_{temp}"] = time_reader(
                        path, "stub", None, cold
                    )
            row[f"fast_{temp}"] = time_reader(path, "fast", None, cold)
            row[f"fast_pool{threads}_{temp}"] = time_reader(path, "fast", pool, cold)
        if _REMOTE_MS.value >= 0:
            for advise in (False, True):
                key = "remote_advise" if advise else "remote"
                row[key] = time_remote(path, pool, advise)
        results.append(row)
        print(json.dumps(row), flush=True)
    if _DIGEST_KEYS.value:
        row = digest_cost(_DIGEST_KEYS.value, workdir)
        results.append(row)
        print(json.dumps(row), flush=True)
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(
                {
                    "flags": {k: flags.FLAGS[k].value for k in _RECORDED},
                    "results": results,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    app.run(main)
