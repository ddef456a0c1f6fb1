r"""Batched-read throughput of `AnnDataSource`: random blocks of contiguous cells.

Reads `--reads` batches of `--blocks_per_read` random blocks of `--block_size`
cells each (1,024 cells per batch at the defaults: one fetch of batch 64 x
fetch factor 16) and prints cells/s, cold (page cache evicted first) and warm
(every page cached).

Two figures per cache state:
  * fetch: `source.fetch_ranges`, the read into a reused CSR buffer that the
    batched-fetch transform uses;
  * read_blocks: `source.read_blocks`, which also gathers the rows into fresh
    arrays in the order asked (one more copy).

Usage:
  python benchmarks/read_throughput.py --data=/data/a.h5ad
  python benchmarks/read_throughput.py            # synthetic 400k-cell file
"""

from __future__ import annotations

import json
import time

import bench_util
import numpy as np
from absl import app, flags

import grain_cells

_DATA = flags.DEFINE_list(
    "data", None, "Comma-separated .h5ad files; default: a synthetic Tahoe-shaped file."
)
_N_CELLS = flags.DEFINE_integer("n_cells", 400_000, "Cells of the synthetic file.")
_N_GENES = flags.DEFINE_integer("n_genes", 62_710, "Genes of the synthetic file.")
_BLOCK = flags.DEFINE_integer("block_size", 16, "Cells per block.")
_BLOCKS_PER_READ = flags.DEFINE_integer(
    "blocks_per_read", 64, "Blocks per batched read."
)
_READS = flags.DEFINE_integer("reads", 300, "Batched reads per measurement.")
_THREADS = flags.DEFINE_integer(
    "read_threads",
    4,
    "Threads per process issuing positional reads (AnnDataSource "
    "read_threads; 0 reads inline).",
)
_CACHE = flags.DEFINE_enum(
    "cache", "both", ["cold", "warm", "both"], "Page-cache state to measure."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the block choice.")
_JSON = flags.DEFINE_string("json", None, "Also write the figures here.")


def measure(source, keys: np.ndarray, how: str) -> float:
    """Returns cells/s of reading `keys` (n_reads x blocks_per_read)."""
    cells = 0
    start = time.perf_counter()
    for batch in keys:
        blocks = [source[int(k)] for k in batch]
        if how == "fetch":
            got = source.fetch_ranges(
                [b.start for b in blocks], [b.stop for b in blocks]
            )
        else:
            got = source.read_blocks(batch)
        cells += len(got.row_ids)
    return cells / (time.perf_counter() - start)


def main(argv):
    del argv
    paths = bench_util.resolve_data(_DATA.value, _N_CELLS.value, _N_GENES.value)
    source = grain_cells.AnnDataSource(
        paths, block_size=_BLOCK.value, read_threads=_THREADS.value
    )
    rng = np.random.default_rng(_SEED.value)
    results = {
        "data": "given (--data)" if _DATA.value else "synthetic",
        "files": [bench_util.describe_file(p) for p in paths],
        "cells": source.num_cells,
        "block_size": _BLOCK.value,
        "blocks_per_read": _BLOCKS_PER_READ.value,
        "read_threads": _THREADS.value,
    }
    states = ["cold", "warm"] if _CACHE.value == "both" else [_CACHE.value]
    for state in states:
        for how in ("fetch", "read_blocks"):
            keys = np.stack(
                [
                    rng.choice(len(source), _BLOCKS_PER_READ.value, replace=False)
                    for _ in range(_READS.value)
                ]
            )
            if state == "cold":
                bench_util.evict_page_cache(paths)
            else:
                bench_util.warm_page_cache(paths)
            rate = measure(source, keys, how)
            results[f"{state}_{how}_cells_per_s"] = round(rate)
            print(f"{state:5s} {how:12s} {rate:12,.0f} cells/s")
    results["peak_rss_mb"] = round(bench_util.peak_rss_mb(), 1)
    print(f"peak RSS {results['peak_rss_mb']} MiB")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
