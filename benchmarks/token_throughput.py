r"""Token outputs (rank-value, value-bin) against the CSR output, same run.

For each worker count, runs `grain_cells.DataLoader(AnnDataSource,
BlockSampler, fetch_operations(output=...))` with the CSR output, then
`RankValueTokens` (Geneformer) and `ValueBinTokens` (scGPT) of `--length`
tokens, one after the other, and prints each one's cells/s and its ratio to
the CSR output's cells/s of the same worker count and cache state.

The gene vocabulary is the file's own genes; the rank-value medians come from
`grain_cells.tokens._corpus_stats` over one in `--stats_stride` runs of 1,024 cells
(histogram method; cached beside the data, not timed).

Usage:
  python benchmarks/token_throughput.py                   # 400k synthetic cells
  python benchmarks/token_throughput.py --data=a.h5ad --cache=cold,warm
  python benchmarks/token_throughput.py --n_cells=50000 --minibatches=200
  python benchmarks/token_throughput.py --kernels=numpy    # the NumPy kernels
  python benchmarks/token_throughput.py --threads=1,auto   # 1 and auto kernel threads
"""

from __future__ import annotations

import itertools
import os
import sys

import bench_util
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import grain_cells
from configs import token_throughput as config_lib

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
flags.DEFINE_integer(
    "repeats",
    1,
    "Runs of the outputs, in turn, per worker count and cache state (the "
    "machine is shared: medians of same-run ratios are printed at the end).",
)
HELP = {
    "n_cells": "Cells of the synthetic file (ignored with --data).",
    "n_genes": "Genes of the synthetic file (ignored with --data).",
    "batch_size": "Cells per minibatch.",
    "block_size": "Contiguous cells per block (one read each).",
    "fetch_factor": "Minibatches per fetch (blocks read together, shuffled in memory).",
    "outputs": "Comma-separated outputs to measure: csr (the baseline of the "
    "ratios), rank_value (Geneformer), value_bin (scGPT).",
    "worker_counts": "Comma-separated worker process counts to measure.",
    "cache": "Comma-separated page-cache states: cold (file evicted first), "
    "warm (file read once first).",
    "length": "Tokens per cell, special tokens included.",
    "n_bins": "Value bins of value_bin tokens (scGPT's default is 51).",
    "selection": "Genes value_bin keeps: top (highest values) or random.",
    "kernels": "Token kernels: auto (numba when installed), numba or numpy.",
    "threads": "Kernel threads per minibatch: auto, a number, or a "
    "comma-separated list to compare (1,auto).",
    "stats_stride": "Corpus statistics (rank_value medians) over one in this "
    "many runs of 1,024 cells.",
    "obs_column": "obs column read with every cell ('' for none).",
    "warmup": "Minibatches skipped before the window (includes worker start).",
    "minibatches": "Minibatches in the measured window.",
    "max_seconds": "Per point, the warm-up and the window each stop after "
    "this many seconds.",
    "seed": "Seed of the block order and the in-fetch shuffle.",
}
bench_util.define_config_flags(_CONFIG, HELP)
# absl's --help shows the main module's key flags: bench_util defined these.
flags.adopt_module_key_flags(bench_util)
FLAGS = flags.FLAGS


def make_outputs(source) -> dict:
    """The outputs named by --outputs, built for `source`.

    With several --threads values each token output is built once per value
    and named `name/threads=N`.
    """
    vocab = grain_cells.tokens.GeneVocabulary.from_genes(source.var_names)
    outputs = {}
    all_threads = [t if t == "auto" else int(t) for t in FLAGS.threads.split(",")]
    for name in FLAGS.outputs.split(","):
        if name == "csr":
            outputs[name] = grain_cells.CsrOutput()
            continue
        if name not in ("rank_value", "value_bin"):
            raise app.UsageError(
                f"unknown output {name!r}: expected csr, rank_value or value_bin"
            )
        stats = None
        if name == "rank_value":
            step = max(1, FLAGS.stats_stride)
            rows = np.arange(source.num_cells)
            corpus = source.select(rows[(rows // 1024) % step == 0])
            stats = grain_cells.tokens.corpus_stats(corpus, method="histogram")
        for threads in all_threads:
            key = name if len(all_threads) == 1 else f"{name}/threads={threads}"
            if name == "rank_value":
                outputs[key] = grain_cells.tokens.RankValueTokens.for_source(
                    source,
                    vocab,
                    stats,
                    length=FLAGS.length,
                    kernels=FLAGS.kernels,
                    threads=threads,
                )
            else:
                outputs[key] = grain_cells.tokens.ValueBinTokens.for_source(
                    source,
                    vocab,
                    length=FLAGS.length,
                    n_bins=FLAGS.n_bins,
                    selection=FLAGS.selection,
                    kernels=FLAGS.kernels,
                    threads=threads,
                )
    return outputs


def run_point(paths, output, worker_count: int, cache: str) -> dict:
    """Measures one configuration; returns its figures."""
    if cache == "cold":
        bench_util.evict_page_cache(paths)
    else:
        bench_util.warm_page_cache(paths)
    obs = [FLAGS.obs_column] if FLAGS.obs_column else []

    def start():
        source = grain_cells.AnnDataSource(
            paths, block_size=FLAGS.block_size, obs_columns=obs
        )
        loader = grain_cells.DataLoader(
            data_source=source,
            sampler=grain_cells.BlockSampler(source, seed=FLAGS.seed, num_epochs=None),
            operations=grain_cells.fetch_operations(
                source,
                batch_size=FLAGS.batch_size,
                fetch_factor=FLAGS.fetch_factor,
                output=output,
                seed=FLAGS.seed,
            ),
            worker_count=worker_count,
        )
        iterator = iter(loader)
        column = f"obs/{FLAGS.obs_column}" if obs else "row_ids"
        return bench_util.Loader(
            iterator, lambda b: np.asarray(b[column])[b["mask"]], iterator.close
        )

    return bench_util.measure_loader(
        start,
        workers=worker_count,
        warmup=FLAGS.warmup,
        minibatches=FLAGS.minibatches,
        max_seconds=FLAGS.max_seconds,
    )


def main(argv):
    del argv
    paths = bench_util.resolve_data(_DATA.value, FLAGS.n_cells, FLAGS.n_genes)
    outputs = make_outputs(grain_cells.AnnDataSource(paths, block_size=16))
    results = []
    print(
        f"{'output':24s} {'workers':>7s} {'cache':5s} {'cells/s':>10s} "
        f"{'x CSR':>6s} {'first(s)':>8s}"
    )
    for wc in [int(w) for w in FLAGS.worker_counts.split(",")]:
        for cache, repeat in itertools.product(
            FLAGS.cache.split(","), range(FLAGS.repeats)
        ):
            csr_rate = None
            for name, output in outputs.items():
                r = run_point(paths, output, wc, cache)
                r.update(output=name, worker_count=wc, cache=cache, repeat=repeat)
                if name == "csr":
                    csr_rate = r["cells_per_s"]
                r["ratio_to_csr"] = (
                    round(r["cells_per_s"] / csr_rate, 3) if csr_rate else None
                )
                results.append(r)
                ratio = "" if csr_rate is None else f"{r['ratio_to_csr']:6.2f}"
                print(
                    f"{name:24s} {wc:7d} {cache:5s} {r['cells_per_s']:10,d} "
                    f"{ratio:>6s} {r['first_batch_s']:8.2f}",
                    flush=True,
                )
    if FLAGS.repeats > 1:
        print("medians over repeats:")
        for key in dict.fromkeys(
            (r["output"], r["worker_count"], r["cache"]) for r in results
        ):
            same = [
                r
                for r in results
                if (r["output"], r["worker_count"], r["cache"]) == key
            ]
            rate = np.median([r["cells_per_s"] for r in same])
            ratios = [r["ratio_to_csr"] for r in same if r["ratio_to_csr"]]
            ratio = f"{np.median(ratios):6.2f}" if ratios else ""
            print(f"{key[0]:24s} {key[1]:7d} {key[2]:5s} {rate:10,.0f} {ratio:>6s}")
    if _JSON.value:
        flag_values = {k: getattr(FLAGS, k) for k in _CONFIG}
        bench_util.write_json(
            _JSON.value, paths, flag_values, results, synthetic=not _DATA.value
        )


if __name__ == "__main__":
    app.run(main)
