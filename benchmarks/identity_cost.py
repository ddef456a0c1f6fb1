r"""What file identity costs: taking it, and checking it at every fetch.

In one run, on the same file and warm page cache:
  * take: `FileIdentity.take` (stat, metadata digest, sampled values), which
    `AnnDataSource` pays per file when it is built;
  * layout: the metadata digest alone, which every process pays per file
    when it opens it;
  * check: the per-fetch check (`fstat` of the file's descriptor, compared
    with the identity), per call;
  * fetch: `source.fetch_ranges` of `--blocks_per_read` random blocks (the
    read one fetch does; the check above is part of it);
and the ratio check / fetch.

Usage:
  python benchmarks/identity_cost.py                    # synthetic 400k cells
  python benchmarks/identity_cost.py --data=/data/a.h5ad
"""

from __future__ import annotations

import json
import os
import time

import bench_util
import h5py
import numpy as np
from absl import app, flags

import grain_cells
from grain_cells.io import _identity as identity

_DATA = flags.DEFINE_list(
    "data", None, "Comma-separated .h5ad files; default: a synthetic Tahoe-shaped file."
)
_N_CELLS = flags.DEFINE_integer("n_cells", 400_000, "Cells of the synthetic file.")
_N_GENES = flags.DEFINE_integer("n_genes", 62_710, "Genes of the synthetic file.")
_BLOCK = flags.DEFINE_integer("block_size", 16, "Cells per block.")
_BLOCKS_PER_READ = flags.DEFINE_integer("blocks_per_read", 64, "Blocks per fetch.")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Identity takes per file.")
_CHECKS = flags.DEFINE_integer("checks", 100_000, "Per-fetch checks timed.")
_FETCHES = flags.DEFINE_integer(
    "fetches",
    300,
    "Random fetches read to time a fetch (the identity check's reference).",
)
_JSON = flags.DEFINE_string("json", None, "Also write the figures here.")


def _per_call(fn, n: int) -> float:
    """Median over 5 rounds of the seconds per call of `fn`, called n times."""
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t) / n)
    return float(np.median(rounds))


def main(argv):
    """Prints (and optionally writes) the figures."""
    del argv
    paths = bench_util.resolve_data(_DATA.value, _N_CELLS.value, _N_GENES.value)
    bench_util.warm_page_cache(paths)
    path = paths[0]
    with h5py.File(path, "r") as f:
        take_s = _per_call(
            lambda: identity.FileIdentity.take(f, path, "X"), _REPEATS.value
        )
        layout_s = _per_call(lambda: identity.layout_digest(f, "X"), _REPEATS.value)
        ident = identity.FileIdentity.take(f, path, "X")
    fd = os.open(path, os.O_RDONLY)
    try:
        check_s = _per_call(
            lambda: ident.check_stat(identity.FileStat.of(os.fstat(fd)), "bench"),
            _CHECKS.value // 5,
        )
    finally:
        os.close(fd)

    source = grain_cells.AnnDataSource(paths, block_size=_BLOCK.value)
    rng = np.random.default_rng(0)
    keys = [
        np.sort(rng.choice(len(source), _BLOCKS_PER_READ.value, replace=False))
        for _ in range(_FETCHES.value)
    ]
    ranges = [source.block_ranges(k)[1:] for k in keys]
    source.fetch_ranges(*ranges[0])  # opens the file
    t = time.perf_counter()
    cells = 0
    for starts, stops in ranges:
        cells += int(source.fetch_ranges(starts, stops).row_ids.size)
    fetch_s = (time.perf_counter() - t) / len(ranges)
    source.close()
    figures = {
        "data": "given (--data)" if _DATA.value else "synthetic",
        "file": bench_util.describe_file(path),
        "take_ms": round(take_s * 1e3, 2),
        "layout_ms": round(layout_s * 1e3, 2),
        "check_us": round(check_s * 1e6, 2),
        "fetch_ms": round(fetch_s * 1e3, 3),
        "cells_per_fetch": cells // len(ranges),
        "check_share_of_fetch": round(check_s / fetch_s, 5),
    }
    for key, value in figures.items():
        print(f"{key:>22}: {value}")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    app.run(main)
