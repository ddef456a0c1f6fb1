r"""End-to-end throughput of grain_cells through `grain.DataLoader`.

For each output format x worker count x cache state, builds
`grain_cells.DataLoader(AnnDataSource, BlockSampler, fetch_operations)`,
times the first minibatch, skips `--warmup` minibatches, then measures cells/s
over `--minibatches` minibatches (real cells only: padding is not counted).
Reports the peak RSS of the main process and of each worker (VmHWM).

"cold" evicts the file from the page cache before the loader starts; "warm"
reads the whole file once first.

Usage:
  python benchmarks/loader_throughput.py                  # 400k synthetic cells
  python benchmarks/loader_throughput.py --data=a.h5ad,b.h5ad --obs_column=cell_type
  python benchmarks/loader_throughput.py --n_cells=50000 --minibatches=500
  # a pre-shuffled file: big blocks, no in-fetch shuffle needed
  python benchmarks/loader_throughput.py --data=shuffled/part-00000.h5ad \
      --block_size=256 --fetch_factor=1 --fetch_shuffle=0
"""

from __future__ import annotations

import os
import sys
import time

import bench_util
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import grain_cells
from configs import loader_throughput as config_lib

_CONFIG = config_lib.get_config()
_DATA = flags.DEFINE_list(
    "data",
    None,
    "Comma-separated .h5ad files; default: "
    "a synthetic Tahoe-shaped file of --n_cells cells.",
)
_JSON = flags.DEFINE_string(
    "json",
    None,
    "Also write the figures to this JSON file, with the files measured (path, "
    "shape, nnz, storage) and the flags.",
)
HELP = {
    "n_cells": "Cells of the synthetic file (ignored with --data).",
    "n_genes": "Genes of the synthetic file (ignored with --data).",
    "compression": "Filter of the synthetic file's X: none, gzip or lzf "
    "(ignored with --data).",
    "chunks": "Chunking of a compressed synthetic X: 'atlas' (anndata's for a "
    "file this size), 'default' (2**16 values) or a number of values.",
    "chunk_aligned": "N > 0: blocks follow X's chunk grid, N chunks per block "
    "(grain_cells.chunk_aligned); 0: blocks of --block_size cells.",
    "batch_size": "Cells per minibatch.",
    "block_size": "Contiguous cells per block (one read each).",
    "fetch_factor": "Minibatches per fetch: block_size * blocks read together, "
    "shuffled in memory.",
    "fetch_shuffle": "1: shuffle the cells inside a fetch; 0: keep block order "
    "(for pre-shuffled files).",
    "worker_counts": "Comma-separated worker process counts to measure "
    "(0: read in the main process).",
    "outputs": "Comma-separated output formats to measure: csr, padded, dense.",
    "dense_genes": "Genes of the dense output: an evenly spread subset of this "
    "many (0: all genes).",
    "padded_width": "Width of the padded output (values per cell); 0 fits it "
    "to the data (PaddedSparseOutput()).",
    "obs_column": "obs column read with every cell ('' for none).",
    "cache": "Comma-separated page-cache states: cold (file evicted first), "
    "warm (file read once first).",
    "warmup": "Minibatches skipped before the window (includes worker start).",
    "minibatches": "Minibatches in the measured window.",
    "seed": "Seed of the block order and the in-fetch shuffle.",
}
bench_util.define_config_flags(_CONFIG, HELP)
# absl's --help shows the main module's key flags: bench_util defined these.
flags.adopt_module_key_flags(bench_util)
FLAGS = flags.FLAGS


def make_output(name: str):
    """The output format named on the command line."""
    if name == "csr":
        return grain_cells.CsrOutput()
    if name == "padded":
        return grain_cells.PaddedSparseOutput(FLAGS.padded_width or None)
    if name == "dense":
        return grain_cells.DenseOutput()
    raise app.UsageError(f"unknown output {name!r}: expected csr, padded or dense")


def run_point(
    paths,
    output: str,
    worker_count: int,
    cache: str,
    storage_options: dict | None = None,
    local_files: list[str] | None = None,
) -> dict:
    """Measures one configuration; returns its figures.

    `paths` may be URLs read with `storage_options`; the page cache state is
    then set on `local_files` (the files the object store serves).
    """
    remote = {"storage_options": storage_options} if storage_options else {}
    genes = None
    if output == "dense" and FLAGS.dense_genes:
        # An evenly spread subset of genes (a stand-in for highly variable genes).
        n_genes = grain_cells.AnnDataSource(paths[0], **remote).num_genes
        genes = np.linspace(0, n_genes - 1, FLAGS.dense_genes).astype(np.int64)
    if cache == "cold":
        bench_util.evict_page_cache(local_files or paths)
    else:
        bench_util.warm_page_cache(local_files or paths)
    obs = [FLAGS.obs_column] if FLAGS.obs_column else []
    start = time.perf_counter()
    source = grain_cells.AnnDataSource(
        paths, block_size=FLAGS.block_size, obs_columns=obs, genes=genes, **remote
    )
    if FLAGS.chunk_aligned:
        source = grain_cells.chunk_aligned(source, FLAGS.chunk_aligned)
    sampler = grain_cells.BlockSampler(source, seed=FLAGS.seed, num_epochs=None)
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=grain_cells.fetch_operations(
            source,
            batch_size=FLAGS.batch_size,
            fetch_factor=FLAGS.fetch_factor,
            output=make_output(output),
            shuffle=bool(FLAGS.fetch_shuffle),
            seed=FLAGS.seed,
        ),
        worker_count=worker_count,
    )
    iterator = iter(loader)
    next(iterator)
    first = time.perf_counter() - start
    for _ in range(FLAGS.warmup):
        next(iterator)
    cells = 0
    c0 = bench_util.cpu_seconds()
    t0 = time.perf_counter()
    for _ in range(FLAGS.minibatches):
        cells += int(next(iterator)["mask"].sum())
    rate = cells / (time.perf_counter() - t0)
    per_cpu = cells / max(bench_util.cpu_seconds() - c0, 1e-9)
    workers = bench_util.children_peak_rss_mb() if worker_count else []
    iterator.close()
    return {
        "output": output,
        "worker_count": worker_count,
        "cache": cache,
        "cells_per_s": round(rate),
        "cells_per_cpu_s": round(per_cpu),
        "first_batch_s": round(first, 3),
        "main_peak_rss_mb": round(bench_util.peak_rss_mb(), 1),
        "worker_peak_rss_mb": [round(w, 1) for w in workers],
        "genes": None if genes is None else int(genes.size),
    }


def main(argv):
    del argv
    paths = bench_util.resolve_data(
        _DATA.value, FLAGS.n_cells, FLAGS.n_genes, FLAGS.compression, FLAGS.chunks
    )
    results = []
    print(
        f"{'output':7s} {'workers':>7s} {'cache':5s} {'cells/s':>10s} "
        f"{'first(s)':>8s} {'main RSS':>9s}  worker peak RSS (MiB)"
    )
    for output in FLAGS.outputs.split(","):
        for wc in [int(w) for w in FLAGS.worker_counts.split(",")]:
            for cache in FLAGS.cache.split(","):
                r = run_point(paths, output, wc, cache)
                results.append(r)
                print(
                    f"{output:7s} {wc:7d} {cache:5s} {r['cells_per_s']:10,d} "
                    f"{r['first_batch_s']:8.2f} {r['main_peak_rss_mb']:9.0f}  "
                    f"{r['worker_peak_rss_mb']}",
                    flush=True,
                )
    if _JSON.value:
        flag_values = {k: getattr(FLAGS, k) for k in _CONFIG}
        bench_util.write_json(
            _JSON.value, paths, flag_values, results, synthetic=not _DATA.value
        )


if __name__ == "__main__":
    app.run(main)
