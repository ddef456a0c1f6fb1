r"""Where the time of one fetch goes: read, CSR output, token outputs, kernel steps.

For `--fetches` random fetches (block 16 x fetch 16 = 1,024 cells), times
each step `--repeats` times and prints the best, in ms per 1,024 cells:

* `read`: `AnnDataSource.fetch_ranges` of the fetch's 64 blocks (wall time:
  the read uses threads);
* `csr`, `rank_value`, `value_bin` (compiled and NumPy kernels): the
  output's `format` of the fetch's 16 minibatches of 64 in one thread,
  thread CPU time;
* the compiled outputs with `threads="auto"` (one thread per core, up to
  4; `grain_cells.tokens._threads`), wall time;
* the compiled rank-value kernel's steps, thread CPU time: the key pass
  (gather tokens and medians, divide, pack keys), the key pass plus the
  sort (bucket and insertion passes) (`rank_value_key_steps` here),
  and the whole kernel (`RankValueTokens.tokenize` of the fetch: also
  writing `gene_ids` and `attention_mask`).

Thread CPU time, not wall time, so that other processes on a shared machine
inflate the figures less; the load average is printed beside them.

Usage:
  python benchmarks/token_steps.py --data=a.h5ad
  python benchmarks/token_steps.py --fetches=3 --repeats=5 --json=steps.json
"""

from __future__ import annotations

import functools
import os
import sys
import time

import bench_util
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from token_kernels import rank_value_key_steps

import grain_cells
from grain_cells.io._matrix import CsrRows
from grain_cells.outputs import Fetch

_DATA = flags.DEFINE_list("data", None, "Comma-separated .h5ad files.")
_N_CELLS = flags.DEFINE_integer("n_cells", 400_000, "Synthetic file without --data.")
_N_GENES = flags.DEFINE_integer("n_genes", 62_710, "Synthetic file without --data.")
_FETCHES = flags.DEFINE_integer("fetches", 5, "Random fetches timed.")
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timings per step and fetch.")
_LENGTH = flags.DEFINE_integer("length", 2048, "Tokens per cell.")
_N_BINS = flags.DEFINE_integer(
    "n_bins", 51, "Value bins of the value-bin tokens (scGPT's default is 51)."
)
_STRIDE = flags.DEFINE_integer("stats_stride", 8, "Corpus stats over 1 in N runs.")
_JSON = flags.DEFINE_string("json", None, "Also write the figures here.")

BLOCK, FETCH, BATCH = 16, 16, 64


def _format_all(output, row_ids, csr, order) -> None:
    """`output.format` of every minibatch of one fetch, as the loader calls it."""
    fetch = Fetch(None, row_ids, csr.n_vars, 5, _csr=csr)
    for i in range(0, order.size, BATCH):
        output.format(fetch, order[i : i + BATCH], BATCH)


def _best(fn, repeats: int, clock=time.thread_time) -> float:
    times = []
    for _ in range(repeats):
        t = clock()
        fn()
        times.append(clock() - t)
    return min(times) * 1e3


def main(argv):
    del argv
    paths = bench_util.resolve_data(_DATA.value, _N_CELLS.value, _N_GENES.value)
    source = grain_cells.AnnDataSource(paths, block_size=BLOCK)
    vocab = grain_cells.tokens.GeneVocabulary.from_genes(source.var_names)
    rows = np.arange(source.num_cells)
    stats = grain_cells.tokens.corpus_stats(
        source.select(rows[(rows // 1024) % max(1, _STRIDE.value) == 0]),
        method="histogram",
    )
    outputs = {"csr": grain_cells.CsrOutput()}
    for kernels in ("numba", "numpy"):
        outputs[f"rank_value/{kernels}"] = (
            grain_cells.tokens.RankValueTokens.for_source(
                source, vocab, stats, length=_LENGTH.value, kernels=kernels, threads=1
            )
        )
        outputs[f"value_bin/{kernels}"] = grain_cells.tokens.ValueBinTokens.for_source(
            source,
            vocab,
            length=_LENGTH.value,
            n_bins=_N_BINS.value,
            kernels=kernels,
            threads=1,
        )
    threaded = {
        "rank_value/numba": grain_cells.tokens.RankValueTokens.for_source(
            source, vocab, stats, length=_LENGTH.value
        ),
        "value_bin/numba": grain_cells.tokens.ValueBinTokens.for_source(
            source, vocab, length=_LENGTH.value, n_bins=_N_BINS.value
        ),
    }
    n_threads = threaded["rank_value/numba"].threads
    rank = outputs["rank_value/numba"]
    rng = np.random.default_rng(0)
    best: dict[str, float] = {}
    n_blocks = source.num_cells // BLOCK
    n_cells = FETCH * BATCH  # one fetch: 64 blocks of 16
    for _ in range(_FETCHES.value):
        starts = np.sort(rng.choice(n_blocks, n_cells // BLOCK, replace=False)) * BLOCK

        def read(starts=starts):
            return source.fetch_ranges(starts, starts + BLOCK)

        steps = {"read": _best(read, _REPEATS.value, time.perf_counter)}
        got = read()
        csr = CsrRows(
            got.csr.data.copy(),
            got.csr.indices.copy(),
            got.csr.indptr.copy(),
            source.num_genes,
        )
        row_ids = got.row_ids.copy()
        order = rng.permutation(row_ids.size)
        for name, output in outputs.items():
            fmt = functools.partial(_format_all, output, row_ids, csr, order)
            fmt()  # compiles or loads the kernels once
            steps[name] = _best(fmt, _REPEATS.value)
        for name, output in threaded.items():
            fmt = functools.partial(_format_all, output, row_ids, csr, order)
            fmt()
            steps[f"{name}, {n_threads} threads (wall)"] = _best(
                fmt, _REPEATS.value, time.perf_counter
            )
        data = np.ascontiguousarray(csr.data, np.float32)
        # The kernel skips its per-value tests when every value is positive
        # and every column has a token, as the outputs decide.
        checked = not (
            (rank.column_tokens >= 0).all() and (not data.size or data.min() > 0)
        )
        args = (
            data,
            np.ascontiguousarray(csr.indices),
            np.ascontiguousarray(csr.indptr, np.int64),
            rank.column_tokens,
            rank.column_medians,
            checked,
        )
        for name, sort in (("kernel: key pass", False), ("kernel: + sort", True)):
            run = functools.partial(rank_value_key_steps, *args, sort)
            run()
            steps[name] = _best(run, _REPEATS.value)
        fetch = Fetch(None, row_ids, source.num_genes, 5, _csr=csr)
        steps["kernel: + gene_ids, mask"] = _best(
            functools.partial(rank.tokenize, fetch), _REPEATS.value
        )
        for name, ms in steps.items():
            best[name] = min(best.get(name, np.inf), ms * 1024 / row_ids.size)
    load = os.getloadavg()
    print(
        f"ms per 1,024 cells (best of {_FETCHES.value} x {_REPEATS.value}); "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    for name, ms in best.items():
        print(f"{name:40s} {ms:8.2f}")
    if _JSON.value:
        flag_values = {
            "fetches": _FETCHES.value,
            "repeats": _REPEATS.value,
            "length": _LENGTH.value,
            "n_bins": _N_BINS.value,
            "load_average": load,
            "threads": n_threads,
        }
        results = [
            {"step": k, "ms_per_1024_cells": round(v, 3)} for k, v in best.items()
        ]
        bench_util.write_json(
            _JSON.value, paths, flag_values, results, synthetic=not _DATA.value
        )


if __name__ == "__main__":
    app.run(main)
