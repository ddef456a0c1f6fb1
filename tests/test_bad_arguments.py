"""Every bad argument of the public API is refused by name, with its value.

A table of `pytest.param(callable, kwargs, expected, id=...)` over
`grain_cells.__all__`, `grain_cells.tokens` and `grain_cells.synthetic`:
each call passes one argument of the wrong type or out of range, and the
error must contain `expected`, which names the argument and the value
given (`"batch_size=-1"`). `SOURCE`, `SAMPLER` and `PATH` in kwargs stand
for a small source (the conftest files, `block_size=5`), a `BlockSampler` over
it and one of its paths.

Rows of functions another helper owns and which still fail are marked
`xfail(strict=True)` with the owner in the reason, so that a fix turns them
into failures that say "remove this mark".
"""

from __future__ import annotations

import numpy as np
import pytest

import grain_cells
import grain_cells.synthetic
import grain_cells.tokens

SOURCE, SAMPLER, PATH, VOCAB = (object() for _ in range(4))


def owned(owner: str, why: str):
    """Marks a row of a function another helper owns as a known failure."""
    return pytest.mark.xfail(strict=True, reason=f"owned by '{owner}': {why}")


def P(fn, kwargs, expected, *, id, marks=()):
    return pytest.param(fn, kwargs, expected, id=id, marks=marks)


CELL_WEIGHTS, WEIGHTS, OUT_DIR, OPS = (object() for _ in range(4))


def select(source, **kwargs):
    return source.select(**kwargs)


def read(source, rows):
    return source.read(rows)


def densify_(num_genes):
    return grain_cells.densify(np.zeros((2, 3)), np.zeros((2, 3), np.int32), num_genes)


gc = grain_cells
tok = grain_cells.tokens
syn = grain_cells.synthetic

CASES = [
    # -- AnnDataSource ------------------------------------------------------
    P(
        gc.AnnDataSource,
        {"paths": PATH, "block_size": 0},
        "block_size=0",
        id="source-block_size-0",
    ),
    P(
        gc.AnnDataSource,
        {"paths": PATH, "block_size": -3},
        "block_size=-3",
        id="source-block_size-neg",
    ),
    P(
        gc.AnnDataSource,
        {"paths": PATH, "block_size": 2.5},
        "block_size=2.5",
        id="source-block_size-float",
    ),
    P(
        gc.AnnDataSource,
        {"paths": PATH, "obs_columns": "cell_type"},
        "obs_columns='cell_type'",
        id="source-obs_columns-str",
    ),
    P(
        gc.AnnDataSource,
        {"paths": PATH, "obs_columns": ["nope"]},
        "'nope'",
        id="source-obs_columns-missing",
    ),
    P(
        gc.AnnDataSource,
        {"paths": PATH, "genes": "g1"},
        "genes='g1'",
        id="source-genes-str",
    ),
    P(
        gc.AnnDataSource,
        {"paths": PATH, "join": "union"},
        "join='union'",
        id="source-join",
    ),
    P(
        gc.AnnDataSource,
        {"paths": PATH, "obs_missing": "skip"},
        "obs_missing='skip'",
        id="source-obs_missing",
    ),
    P(
        gc.AnnDataSource,
        {"paths": PATH, "read_threads": -1},
        "read_threads=-1",
        id="source-read_threads-neg",
    ),
    P(
        gc.AnnDataSource,
        {"paths": PATH, "read_threads": "4"},
        "read_threads='4'",
        id="source-read_threads-str",
    ),
    P(gc.AnnDataSource, {"paths": PATH, "layer": 3}, "layer=3", id="source-layer-int"),
    P(
        gc.AnnDataSource,
        {"paths": PATH, "check_indices": "yes"},
        "check_indices='yes'",
        id="source-check_indices-str",
    ),
    P(
        gc.AnnDataSource,
        {"paths": PATH, "storage_options": "anon"},
        "storage_options='anon'",
        id="source-storage_options-str",
    ),
    P(gc.AnnDataSource, {"paths": 42}, "paths=42", id="source-paths-int"),
    P(gc.AnnDataSource, {"paths": []}, "paths=[]", id="source-paths-empty"),
    # -- samplers -----------------------------------------------------------
    P(
        gc.BlockSampler,
        {"num_blocks": -1},
        "num_blocks=-1",
        id="sampler-num_blocks-neg",
    ),
    P(
        gc.BlockSampler,
        {"num_blocks": SOURCE, "seed": "x"},
        "seed='x'",
        id="sampler-seed-str",
    ),
    P(
        gc.BlockSampler,
        {"num_blocks": SOURCE, "seed": -1},
        "seed=-1",
        id="sampler-seed-neg",
    ),
    P(
        gc.BlockSampler,
        {"num_blocks": SOURCE, "num_epochs": 0},
        "num_epochs=0",
        id="sampler-num_epochs-0",
    ),
    P(
        gc.BlockSampler,
        {"num_blocks": SOURCE, "readahead_cells": -5},
        "readahead_cells=-5",
        id="sampler-readahead-neg",
    ),
    P(
        gc.BlockSampler,
        {"num_blocks": SOURCE, "shard_options": 2},
        "shard_options=2",
        id="sampler-shard_options-int",
    ),
    P(
        gc.ConditionBlockSampler,
        {"source": SOURCE, "column": "cell_type", "blocks_per_fetch": 0},
        "blocks_per_fetch=0",
        id="condition-blocks_per_fetch-0",
    ),
    P(
        gc.ConditionBlockSampler,
        {"source": SOURCE, "column": "nope", "blocks_per_fetch": 2},
        "'nope'",
        id="condition-column-missing",
    ),
    P(
        gc.ConditionBlockSampler,
        {
            "source": SOURCE,
            "column": "cell_type",
            "blocks_per_fetch": 2,
            "worker_count": -1,
        },
        "worker_count=-1",
        id="condition-worker_count-neg",
    ),
    P(
        gc.ConditionBlockSampler,
        {"source": SOURCE, "column": "cell_type", "blocks_per_fetch": 2, "seed": "x"},
        "seed='x'",
        id="condition-seed-str",
    ),
    P(
        gc.condition_blocks,
        {"source": SOURCE, "column": "nope"},
        "'nope'",
        id="condition_blocks-column",
    ),
    # -- outputs and extra matrices -----------------------------------------
    P(gc.CsrOutput, {"dtype": "floaty"}, "dtype='floaty'", id="csr-dtype"),
    P(gc.DenseOutput, {"dtype": "floaty"}, "dtype='floaty'", id="dense-dtype"),
    P(gc.DenseOutput, {"dtype": None}, "dtype=None", id="dense-dtype-none"),
    P(gc.PaddedSparseOutput, {"width": 0}, "width=0", id="padded-width-0"),
    P(gc.PaddedSparseOutput, {"width": "512"}, "width='512'", id="padded-width-str"),
    P(
        gc.PaddedSparseOutput,
        {"truncate": "cut"},
        "truncate='cut'",
        id="padded-truncate",
    ),
    P(gc.PaddedSparseOutput, {"dtype": "floaty"}, "dtype='floaty'", id="padded-dtype"),
    P(gc.PaddedSparseOutput, {"quantile": 1.5}, "quantile=1.5", id="padded-quantile"),
    P(gc.Layer, {"name": 3}, "name=3", id="layer-name-int"),
    P(
        gc.Layer,
        {"name": "counts", "output": "csr"},
        "output='csr'",
        id="layer-output-str",
    ),
    P(gc.Obsm, {"name": ["X_pca"]}, "name=['X_pca']", id="obsm-name-list"),
    P(gc.Obsm, {"name": "X_pca", "dtype": "floaty"}, "dtype='floaty'", id="obsm-dtype"),
    # -- the fetch transform ------------------------------------------------
    P(
        gc.fetch_operations,
        {"source": SOURCE, "batch_size": -4},
        "batch_size=-4",
        id="ops-batch_size-neg",
    ),
    P(
        gc.fetch_operations,
        {"source": SOURCE, "batch_size": 4, "fetch_factor": 0},
        "fetch_factor=0",
        id="ops-fetch_factor-0",
    ),
    P(
        gc.fetch_operations,
        {"source": SOURCE, "batch_size": 4, "seed": "x"},
        "seed='x'",
        id="ops-seed-str",
    ),
    P(
        gc.fetch_operations,
        {"source": SOURCE, "batch_size": 4, "remainder": "keep"},
        "remainder='keep'",
        id="ops-remainder",
    ),
    P(
        gc.fetch_operations,
        {"source": SOURCE, "batch_size": 4, "output": "dense"},
        "output='dense'",
        id="ops-output-str",
    ),
    P(
        gc.fetch_operations,
        {"source": SOURCE, "batch_size": 4, "numeric_obs": "float64"},
        "numeric_obs='float64'",
        id="ops-numeric_obs",
    ),
    P(
        gc.fetch_operations,
        {"source": SOURCE, "batch_size": 4, "condition": "nope"},
        "condition='nope'",
        id="ops-condition",
    ),
    P(
        gc.fetch_operations,
        {"source": SOURCE, "batch_size": 4, "extra": ["counts"]},
        "extra=['counts']",
        id="ops-extra-list",
    ),
    P(
        gc.fetch_operations,
        {"source": SOURCE, "batch_size": 4, "extra": {"c": "counts"}},
        "extra['c']",
        id="ops-extra-str",
    ),
    P(
        gc.fetch_operations,
        {"source": PATH, "batch_size": 4},
        "source=",
        id="ops-source-path",
    ),
    P(
        gc.cell_dataset,
        {"source": SOURCE, "batch_size": 0},
        "batch_size=0",
        id="dataset-batch_size-0",
    ),
    P(
        gc.cell_dataset,
        {"source": SOURCE, "batch_size": 4, "num_epochs": -1},
        "num_epochs=-1",
        id="dataset-num_epochs-neg",
    ),
    P(
        gc.cell_dataset,
        {"source": SOURCE, "batch_size": 4, "worker_count": -1},
        "worker_count=-1",
        id="dataset-worker_count-neg",
    ),
    P(
        gc.cell_dataset,
        {"source": SOURCE, "batch_size": 4, "worker_buffer_size": 0},
        "worker_buffer_size=0",
        id="dataset-worker_buffer_size-0",
    ),
    P(
        gc.cell_dataset,
        {"source": SOURCE, "batch_size": 4, "readahead_cells": -1},
        "readahead_cells=-1",
        id="dataset-readahead-neg",
    ),
    P(
        gc.cell_dataset,
        {"source": SOURCE, "batch_size": 4, "sampler": 7},
        "sampler=7",
        id="dataset-sampler-int",
    ),
    P(
        gc.cell_dataset,
        {"source": SOURCE, "batch_size": 4, "output": "csr"},
        "output='csr'",
        id="dataset-output-str",
    ),
    # -- blocks: splits, chunk alignment ------------------------------------
    P(
        gc.split_by_fraction,
        {"source": SOURCE, "fractions": {"a": -0.5, "b": 1.5}},
        "-0.5",
        id="split-fraction-neg",
    ),
    P(
        gc.split_by_fraction,
        {"source": SOURCE, "fractions": [0.5, 0.5]},
        "fractions=[0.5, 0.5]",
        id="split-fractions-list",
    ),
    P(
        gc.split_by_fraction,
        {"source": SOURCE, "fractions": {"a": 1.0}, "seed": "x"},
        "seed='x'",
        id="split-seed-str",
    ),
    P(
        gc.split_by_fraction,
        {"source": SOURCE, "fractions": {"a": 1.0}, "unit_cells": 0},
        "unit_cells=0",
        id="split-unit_cells-0",
    ),
    P(
        gc.split_by_fraction,
        {"source": SOURCE, "fractions": {"a": 1.0}, "by": "nope"},
        "'nope'",
        id="split-by-missing",
    ),
    P(
        gc.split_by_obs,
        {"source": SOURCE, "column": "nope", "holdout": {"v": ["B"]}},
        "'nope'",
        id="split_obs-column",
    ),
    P(
        gc.split_by_obs,
        {"source": SOURCE, "column": "cell_type", "holdout": ["B"]},
        "holdout=['B']",
        id="split_obs-holdout-list",
    ),
    P(
        gc.chunk_aligned,
        {"source": SOURCE, "chunks_per_block": 0},
        "chunks_per_block=0",
        id="aligned-chunks-0",
    ),
    P(gc.chunk_aligned, {"source": PATH}, "source=", id="aligned-source-path"),
    P(
        select,
        {"source": SOURCE, "where": {"nope": ["B"]}},
        "'nope'",
        id="select-where-missing",
    ),
    P(
        select,
        {"source": SOURCE, "cells": np.ones(3, bool)},
        "3",
        id="select-cells-length",
    ),
    P(read, {"source": SOURCE, "rows": [10**6]}, "1000000", id="read-rows-range"),
    # -- weighting, preshuffle (owned by 'preshuffle'), DataLoader ('loader') ----
    P(
        gc.WeightedBlockSampler,
        {"source": SOURCE, "weights": np.ones(3)},
        "weights",
        id="weighted-weights-length",
    ),
    P(
        gc.WeightedBlockSampler,
        {"source": SOURCE, "weights": WEIGHTS, "seed": "x"},
        "seed='x'",
        id="weighted-seed-str",
    ),
    P(
        gc.WeightedBlockSampler,
        {"source": SOURCE, "weights": WEIGHTS, "epoch_blocks": 0},
        "epoch_blocks=0",
        id="weighted-epoch_blocks-0",
    ),
    P(
        gc.block_weights,
        {"source": SOURCE, "cell_weights": np.ones(3)},
        "cell_weights",
        id="block_weights-length",
    ),
    P(
        gc.block_weights,
        {"source": SOURCE, "cell_weights": CELL_WEIGHTS, "reduce": "median"},
        "reduce='median'",
        id="block_weights-reduce",
    ),
    P(
        gc.balanced_block_weights,
        {"source": SOURCE, "column": "nope"},
        "'nope'",
        id="balanced-column",
    ),
    P(
        gc.balanced_block_weights,
        {"source": SOURCE, "column": "cell_type", "max_iterations": 0},
        "max_iterations=0",
        id="balanced-max_iterations-0",
    ),
    P(
        gc.expected_shares,
        {"source": SOURCE, "column": "cell_type", "weights": np.ones(3)},
        "weights",
        id="shares-weights-length",
    ),
    P(
        gc.preshuffle,
        {"inputs": PATH, "output_dir": OUT_DIR, "cells_per_file": 0, "progress": False},
        "cells_per_file=0",
        id="preshuffle-cells_per_file-0",
    ),
    P(
        gc.preshuffle,
        {"inputs": PATH, "output_dir": OUT_DIR, "seed": "x", "progress": False},
        "seed='x'",
        id="preshuffle-seed-str",
    ),
    P(
        gc.preshuffle,
        {
            "inputs": PATH,
            "output_dir": OUT_DIR,
            "compression": "zip",
            "progress": False,
        },
        "compression='zip'",
        id="preshuffle-compression",
    ),
    P(
        gc.DataLoader,
        {
            "data_source": SOURCE,
            "sampler": SAMPLER,
            "operations": OPS,
            "worker_count": -1,
        },
        "worker_count=-1",
        id="loader-worker_count-neg",
    ),
    P(
        gc.DataLoader,
        {"data_source": SOURCE, "sampler": SAMPLER, "operations": "fetch"},
        "operations='fetch'",
        id="loader-operations-str",
    ),
    P(
        gc.DataLoader,
        {"data_source": PATH, "sampler": SAMPLER, "operations": OPS},
        "data_source=",
        id="loader-data_source-path",
    ),
    P(densify_, {"num_genes": 0}, "num_genes=0", id="densify-num_genes-0"),
    # -- tokens ---------------------------------------------------------------
    P(
        tok.RankValueTokens,
        {"column_tokens": np.arange(12), "column_medians": np.ones(12), "length": 0},
        "length=0",
        id="rank-length-0",
    ),
    P(
        tok.RankValueTokens,
        {"column_tokens": np.arange(12), "column_medians": np.ones(11)},
        "column_medians",
        id="rank-medians-length",
    ),
    P(
        tok.RankValueTokens,
        {
            "column_tokens": np.arange(12),
            "column_medians": np.ones(12),
            "mlm_probability": 1.5,
        },
        "mlm_probability=1.5",
        id="rank-mlm-1.5",
    ),
    P(
        tok.RankValueTokens,
        {
            "column_tokens": np.arange(12),
            "column_medians": np.ones(12),
            "kernels": "cuda",
        },
        "kernels='cuda'",
        id="rank-kernels",
    ),
    P(
        tok.RankValueTokens,
        {"column_tokens": np.arange(12), "column_medians": np.ones(12), "threads": 0},
        "threads=0",
        id="rank-threads-0",
    ),
    P(
        tok.ValueBinTokens,
        {"column_tokens": np.arange(12), "n_bins": 1},
        "n_bins=1",
        id="bins-n_bins-1",
    ),
    P(
        tok.ValueBinTokens,
        {"column_tokens": np.arange(12), "length": -2},
        "length=-2",
        id="bins-length-neg",
    ),
    P(
        tok.ValueBinTokens,
        {"column_tokens": np.arange(12), "selection": "best"},
        "selection='best'",
        id="bins-selection",
    ),
    P(
        tok.ValueBinTokens,
        {"column_tokens": "abc"},
        "column_tokens='abc'",
        id="bins-column_tokens-str",
    ),
    P(
        tok.corpus_stats,
        {"source": SOURCE, "method": "median"},
        "method='median'",
        id="corpus-method",
    ),
    P(
        tok.corpus_stats,
        {"source": SOURCE, "chunk_cells": 0},
        "chunk_cells=0",
        id="corpus-chunk_cells-0",
    ),
    P(
        tok.corpus_stats,
        {"source": SOURCE, "target_sum": -1.0},
        "target_sum=-1.0",
        id="corpus-target_sum-neg",
    ),
    # -- synthetic ------------------------------------------------------------
    P(
        syn.write_tahoe_like,
        {"path": PATH, "n_cells": 0},
        "n_cells=0",
        id="tahoe-n_cells-0",
    ),
    P(
        syn.write_tahoe_like,
        {"path": PATH, "n_cells": 10, "n_genes": -1},
        "n_genes=-1",
        id="tahoe-n_genes-neg",
    ),
    P(
        syn.write_tahoe_like,
        {"path": PATH, "n_cells": 10, "seed": "x"},
        "seed='x'",
        id="tahoe-seed-str",
    ),
    P(
        syn.write_tahoe_like,
        {"path": PATH, "n_cells": 10, "compression": "zip"},
        "compression='zip'",
        id="tahoe-compression",
    ),
    P(
        syn.write_tahoe_like,
        {"path": PATH, "n_cells": 10, "mean_nnz": -3.0},
        "mean_nnz=-3.0",
        id="tahoe-mean_nnz-neg",
    ),
]


@pytest.fixture
def stand_ins(csr_paths, tmp_path):
    source = grain_cells.AnnDataSource(
        csr_paths, block_size=5, obs_columns=["cell_type", "plate"]
    )
    return {
        id(CELL_WEIGHTS): np.ones(source.num_cells),
        id(WEIGHTS): np.ones(len(source)),
        id(OUT_DIR): str(tmp_path / "shuffled"),
        id(OPS): grain_cells.fetch_operations(source, batch_size=5),
        id(SOURCE): source,
        id(SAMPLER): grain_cells.BlockSampler(len(source)),
        id(PATH): csr_paths[0],
    }


@pytest.mark.parametrize(("fn", "kwargs", "expected"), CASES)
def test_bad_argument_is_named(stand_ins, tmp_path, fn, kwargs, expected):
    kwargs = {k: stand_ins.get(id(v), v) for k, v in kwargs.items()}
    if fn is syn.write_tahoe_like:
        kwargs["path"] = str(tmp_path / "t.h5ad")
    with pytest.raises((TypeError, ValueError, KeyError, IndexError)) as info:
        fn(**kwargs)
    message = str(info.value)
    assert expected in message, f"{type(info.value).__name__}: {message}"
