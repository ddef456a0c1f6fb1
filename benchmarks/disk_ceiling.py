r"""The byte ceiling of a file on this machine, in cells/s equivalents.

Reads the file (page cache evicted first) two ways, with nothing but
`os.preadv` into reused buffers:

* sequentially, in large pieces from several threads (what a pre-shuffled
  file read in big blocks can approach);
* at random offsets, in pieces the size of one block of cells, with several
  reads in flight (what block sampling of a plate-sorted file asks of the
  disk).

Bytes/s are converted to cells/s with the file's mean bytes per cell (data
plus indices of X), so the figures compare directly with the loader's.

Usage:
  python benchmarks/disk_ceiling.py --data=/tmp/synth400k.h5ad
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time

import bench_util
import numpy as np
from absl import app, flags

import grain_cells

_DATA = flags.DEFINE_string("data", None, "An .h5ad file; default: synthetic.")
_N_CELLS = flags.DEFINE_integer("n_cells", 400_000, "Cells of the synthetic file.")
_BLOCK = flags.DEFINE_integer("block_size", 16, "Cells per random read.")
_DEPTHS = flags.DEFINE_list(
    "depths",
    ["1", "4", "16", "32"],
    "Comma-separated numbers of random reads kept in flight (queue depths).",
)
_BYTES = flags.DEFINE_integer("bytes", 2_000_000_000, "Bytes read per figure.")
_JSON = flags.DEFINE_string("json", None, "Also write the figures here.")


def _read_all(fd: int, offsets: list[int], size: int, threads: int) -> float:
    """Reads `size` bytes at each offset with `threads` in flight; returns s."""
    local = __import__("threading").local()

    def one(offset: int) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(size)
        return os.preadv(fd, [buf], offset)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(one, offsets, chunksize=16):
            pass
    return time.perf_counter() - start


def main(argv):
    del argv
    path = bench_util.resolve_data(
        [_DATA.value] if _DATA.value else None, _N_CELLS.value, 62_710
    )[0]
    source = grain_cells.AnnDataSource(path)
    info = source.file_info(0)
    bytes_per_cell = (info.nnz or 0) * (info.dtype.itemsize + 4) / info.n_obs
    size = os.path.getsize(path)
    total = min(_BYTES.value, size)
    fd = os.open(path, os.O_RDONLY)
    out = {
        "data": "given (--data)" if _DATA.value else "synthetic",
        "file": bench_util.describe_file(path),
        "bytes_per_cell": round(bytes_per_cell),
    }
    try:
        piece = 8 << 20
        bench_util.evict_page_cache([path])
        seconds = _read_all(fd, list(range(0, total - piece, piece)), piece, 8)
        rate = total / seconds
        out["sequential_GBps"] = round(rate / 1e9, 2)
        print(
            f"sequential 8 MiB reads, 8 in flight: {rate / 1e9:5.2f} GB/s = "
            f"{rate / bytes_per_cell:10,.0f} cells/s"
        )
        block = int(_BLOCK.value * bytes_per_cell)
        rng = np.random.default_rng(0)
        for depth in (int(d) for d in _DEPTHS.value):
            n = max(1, total // block // 4)
            offsets = (rng.integers(0, size - block, n) // 4096 * 4096).tolist()
            bench_util.evict_page_cache([path])
            seconds = _read_all(fd, offsets, block, depth)
            rate = n * block / seconds
            out[f"random_qd{depth}_GBps"] = round(rate / 1e9, 2)
            print(
                f"random {block / 1024:.0f} KiB reads, {depth:2d} in flight: "
                f"{rate / 1e9:5.2f} GB/s = {rate / bytes_per_cell:10,.0f} cells/s"
            )
    finally:
        os.close(fd)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    app.run(main)
