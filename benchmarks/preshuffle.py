r"""Time `grain_cells.preshuffle` writing a shuffled copy of `.h5ad` files.

Prints the writer's wall time, seconds per million cells, its CPU time (every
thread of this process: the figure to compare on a shared machine), the
output's size and this process's peak RSS. `--format=zarr` writes AnnData
zarr stores instead of `.h5ad` files. Parts already in `--output_dir` from an earlier
run (those listed in its `preshuffle.json`) are deleted first, so the timing
always covers a full write.

Inputs (`--data`) and `--output_dir` may be URLs of a bucket
(`s3://bucket/prefix`), reached with `--storage_options` (key=value,...;
credentials otherwise from the environment or an AWS profile); a bucket
output is staged on local disk, at most two parts at a time: one uploading, one
being written (`--staging_dir`).

Usage:
  python benchmarks/preshuffle.py --data=/tmp/synth400k.h5ad \
      --output_dir=/tmp/preshuffled
  python benchmarks/preshuffle.py --n_cells=50000 --output_dir=/tmp/ps50k
  python benchmarks/preshuffle.py --n_cells=100000 --output_dir=/tmp/ps100k \
      --format=zarr --keep=none
  python benchmarks/preshuffle.py --data=atlas.h5ad --output_dir=/tmp/grouped \
      --group_by=cell_type --keep=layers/counts
  python benchmarks/preshuffle.py --data=s3://atlas/a.h5ad \
      --output_dir=s3://atlas/shuffled --storage_options=profile=lab
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time

import bench_util
from absl import app, flags

from grain_cells.preshuffle import _preshuffle as preshuffle_lib
from grain_cells.storage.remote import _store as object_store
from grain_cells.storage.remote import _versions as object_versions
from grain_cells.storage.remote import _versions as object_writes

_DATA = flags.DEFINE_list(
    "data", None, "Comma-separated .h5ad files; default: a synthetic Tahoe-shaped file."
)
_N_CELLS = flags.DEFINE_integer("n_cells", 400_000, "Cells of the synthetic file.")
_N_GENES = flags.DEFINE_integer("n_genes", 62_710, "Genes of the synthetic file.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Folder for the parts.")
_CELLS_PER_FILE = flags.DEFINE_integer(
    "cells_per_file", None, "Cells per output part; default: one part."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the permutation.")
_COMPRESSION = flags.DEFINE_enum(
    "compression",
    "none",
    ["none", "gzip", "lzf", "zstd"],
    "Compression of the output (lzf: h5ad only; zstd: zarr only).",
)
_FORMAT = flags.DEFINE_enum(
    "format",
    "h5ad",
    ["h5ad", "zarr", "zarr-v2"],
    "Format of the parts (preshuffle's format): .h5ad files, or AnnData zarr "
    "stores (zarr: v3 with sharded matrices; zarr-v2: v2, no shards).",
)
_BUDGET_MB = flags.DEFINE_integer(
    "memory_budget_mb", 2048, "memory_budget_bytes, in MiB."
)
_CACHE = flags.DEFINE_enum(
    "cache",
    "warm",
    ["warm", "cold", "asis"],
    "Page-cache state of the inputs before the write: warm reads them once, "
    "cold evicts them (do not use on files others are benchmarking), asis "
    "leaves them.",
)
_CHUNK_CELLS = flags.DEFINE_integer(
    "chunk_cells",
    None,
    "Cells per HDF5 chunk of the output (e.g. the block size you will read "
    "with); default: the writer's.",
)
_OPTIONS = flags.DEFINE_string(
    "storage_options",
    "",
    "Storage options of URL inputs and output, key=value,... (ints where "
    "they parse), e.g. endpoint_url=http://127.0.0.1:9000,region=us-east-1.",
)
_STAGING = flags.DEFINE_string(
    "staging_dir", None, "Local folder for parts before upload (URL output)."
)
_GROUP_BY = flags.DEFINE_list(
    "group_by",
    None,
    "obs column(s) whose labels' cells are written contiguously, shuffled "
    "within each label (preshuffle's group_by); default: one shuffle of all cells.",
)
_KEEP = flags.DEFINE_list(
    "keep",
    None,
    "Elements carried besides X, obs and var (preshuffle's keep: layers, raw, "
    "obsm, varm, varp, uns, layers/<name>, obsm/<name>); 'none' for X, obs and "
    "var only; default: every element that fits.",
)
_JSON = flags.DEFINE_string("json", None, "Also write the figures here.")
flags.mark_flag_as_required("output_dir")


def remove_previous_output(output_dir, options: dict) -> None:
    """Deletes the parts and manifest of an earlier run into `output_dir`."""
    if object_store.is_url(output_dir):
        names = object_writes.list_names(output_dir, options)
        for name in [*object_writes.part_names(names), preshuffle_lib.MANIFEST]:
            if name in names:
                object_writes.delete(object_writes.join(output_dir, name), options)
        return
    output_dir = pathlib.Path(output_dir)
    manifest = output_dir / preshuffle_lib.MANIFEST
    if not manifest.is_file():
        return
    with open(manifest) as f:
        parts = json.load(f)["parts"]
    for part in parts:
        path = output_dir / part["file"]
        if path.is_dir():  # a zarr part
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    manifest.unlink()


def main(argv):
    del argv
    paths = bench_util.resolve_data(_DATA.value, _N_CELLS.value, _N_GENES.value)
    options = bench_util.parse_options(_OPTIONS.value)
    output_dir = _OUTPUT_DIR.value
    remove_previous_output(output_dir, options)
    local = [p for p in paths if not object_store.is_url(p)]
    if _CACHE.value == "warm":
        bench_util.warm_page_cache(local)
    elif _CACHE.value == "cold":
        bench_util.evict_page_cache(local)
    compression = None if _COMPRESSION.value == "none" else _COMPRESSION.value
    start = time.perf_counter()
    cpu_start = time.process_time()
    parts = preshuffle_lib.preshuffle(
        paths,
        output_dir,
        cells_per_file=_CELLS_PER_FILE.value,
        seed=_SEED.value,
        compression=compression,
        chunk_cells=_CHUNK_CELLS.value,
        memory_budget_bytes=_BUDGET_MB.value << 20,
        storage_options=options,
        staging_dir=_STAGING.value,
        group_by=_GROUP_BY.value,
        keep=None if _KEEP.value is None else [k for k in _KEEP.value if k != "none"],
        format=_FORMAT.value,
    )
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start  # every thread of this process
    manifest = json.loads(read_bytes(output_dir, preshuffle_lib.MANIFEST, options))
    cells = manifest["cells"]
    in_bytes = sum(size_of(p, options) for p in paths)
    out_bytes = sum(size_of(p, options) for p in parts)
    results = {
        "inputs": paths,
        "cells": cells,
        "parts": len(parts),
        "windows": sum(p["windows"] for p in manifest["parts"]),
        "format": _FORMAT.value,
        "compression": _COMPRESSION.value,
        "chunk_cells": _CHUNK_CELLS.value,
        "group_by": _GROUP_BY.value,
        "keep": _KEEP.value,
        "memory_budget_mb": _BUDGET_MB.value,
        "cache": _CACHE.value,
        "wall_s": round(wall, 2),
        "s_per_million_cells": round(wall / max(cells, 1) * 1e6, 2),
        "cpu_s": round(cpu, 2),
        "cpu_us_per_cell": round(cpu / max(cells, 1) * 1e6, 2),
        "input_gb": round(in_bytes / 1e9, 3),
        "output_gb": round(out_bytes / 1e9, 3),
        "peak_rss_mb": round(bench_util.peak_rss_mb(), 1),
    }
    print(
        f"preshuffled {cells:,} cells ({results['input_gb']} GB) into "
        f"{len(parts)} part(s), {results['output_gb']} GB, in {wall:.1f} s: "
        f"{results['s_per_million_cells']} s per million cells, CPU "
        f"{results['cpu_s']} s ({results['cpu_us_per_cell']} us per cell), "
        f"{results['windows']} window(s), peak RSS {results['peak_rss_mb']} MiB"
    )
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(results, f, indent=2)


def size_of(path, options: dict) -> int:
    """Bytes of a local file, a local folder's files (a zarr part) or an object."""
    if object_store.is_url(os.fspath(path)):
        return object_versions.head(os.fspath(path), options).size
    if os.path.isdir(path):
        return sum(
            p.stat().st_size for p in pathlib.Path(path).rglob("*") if p.is_file()
        )
    return os.path.getsize(path)


def read_bytes(folder, name: str, options: dict) -> bytes:
    """A small file of a folder or an object under a prefix, whole."""
    if not object_store.is_url(os.fspath(folder)):
        return (pathlib.Path(folder) / name).read_bytes()
    url = object_writes.join(os.fspath(folder), name)
    stat = object_versions.head(url, options)
    ranges = [(0, stat.size)]
    return bytes(
        object_versions.get_ranges(url, options, ranges, stat, if_match=True)[0]
    )


if __name__ == "__main__":
    app.run(main)
