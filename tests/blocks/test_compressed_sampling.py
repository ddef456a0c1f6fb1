"""Chunk-aware blocks (`grain_cells.chunk_aligned`) on compressed files.

The conftest files (values encode row and gene) are rewritten with X in
gzip chunks of 11 values (CSR) or 6 rows (dense), so chunks hold a few cells
and blocks of 5 would straddle them.
"""

from __future__ import annotations

import anndata
import grain
import h5py
import numpy as np
import pytest
from grain import sharding

import grain_cells


def _rewrite(src_paths, directory, kwargs) -> list[str]:
    out = []
    for p in src_paths:
        dst = directory / p.rsplit("/", 1)[-1]
        with h5py.File(p) as f_in, h5py.File(dst, "w") as f_out:
            for key in f_in:
                if key != "X":
                    f_in.copy(f_in[key], f_out, key)
            for k, v in f_in.attrs.items():
                f_out.attrs[k] = v
            anndata.io.write_elem(
                f_out, "X", anndata.io.read_elem(f_in["X"]), dataset_kwargs=kwargs
            )
        out.append(str(dst))
    return out


@pytest.fixture(scope="module")
def gz_paths(csr_paths, tmp_path_factory):
    kwargs = {"chunks": (11,), "compression": "gzip"}
    return _rewrite(csr_paths, tmp_path_factory.mktemp("gz"), kwargs)


@pytest.fixture(scope="module")
def gz_dense_paths(dense_paths, tmp_path_factory):
    kwargs = {"chunks": (6, 12), "compression": "gzip", "shuffle": True}
    return _rewrite(dense_paths, tmp_path_factory.mktemp("gzd"), kwargs)


def _aligned(paths, block_size=5, **kwargs):
    source = grain_cells.AnnDataSource(
        paths, block_size=block_size, obs_columns=["plate", "cell_type", "idx"]
    )
    return source, grain_cells.chunk_aligned(source, **kwargs)


def _blocks(source):
    _, starts, stops = source.block_ranges(np.arange(len(source)))
    return starts, stops


def _file_blocks(source, paths, starts, stops):
    """Per file: block starts and stops in its rows, and each row's chunk of 11."""
    offsets = source.cell_offsets
    for f, path in enumerate(paths):
        with h5py.File(path) as h:
            indptr = h["X/indptr"][:]
        lo, hi = offsets[f], offsets[f + 1]
        sel = (starts >= lo) & (starts < hi)
        chunk_of_row = np.minimum(indptr[:-1], max(indptr[-1] - 1, 0)) // 11
        yield starts[sel] - lo, stops[sel] - lo, hi - lo, chunk_of_row


def test_blocks_follow_the_chunk_grid(gz_paths):
    source, aligned = _aligned(gz_paths)
    starts, stops = _blocks(aligned)
    # Every cell once, in order, blocks of 1 to block_size cells.
    np.testing.assert_array_equal(starts[1:], stops[:-1])
    assert starts[0] == 0 and stops[-1] == source.num_cells
    assert ((stops - starts) >= 1).all() and ((stops - starts) <= 5).all()
    for a, b, n_rows, chunk_of_row in _file_blocks(source, gz_paths, starts, stops):
        assert (b <= n_rows).all()  # never across files
        # A block's cells start their values in one chunk ...
        assert (chunk_of_row[a] == chunk_of_row[b - 1]).all()
        # ... and a new chunk starts a new block.
        new_chunk = np.flatnonzero(np.diff(chunk_of_row) != 0) + 1
        assert np.isin(new_chunk, a).all()
    assert grain_cells.blocks.mean_cells_per_chunk(source) == pytest.approx(
        source.num_cells / (np.unique(np.r_[source.cell_offsets[:-1], starts]).size),
        rel=0.5,
    )


def test_chunks_per_block_cuts_at_every_nth_chunk_of_each_file(gz_paths):
    source, aligned = _aligned(gz_paths, block_size=40, chunks_per_block=3)
    starts, stops = _blocks(aligned)
    np.testing.assert_array_equal(starts[1:], stops[:-1])
    assert starts[0] == 0 and stops[-1] == source.num_cells
    for a, b, _, chunk_of_row in _file_blocks(source, gz_paths, starts, stops):
        # Chunks 0-2, 3-5, ... of each file: a block's cells start their
        # values in one group of three chunks, and each group starts a block.
        group = chunk_of_row // 3
        assert (group[a] == group[b - 1]).all()
        np.testing.assert_array_equal(
            a, np.flatnonzero(np.r_[True, np.diff(group) != 0])
        )
    # Fewer, larger blocks than one chunk per block; the same cells.
    _, one = _aligned(gz_paths, block_size=40)
    assert len(aligned) < len(one)
    np.testing.assert_array_equal(
        aligned.read_blocks(np.arange(len(aligned))).row_ids,
        np.arange(source.num_cells),
    )
    with pytest.raises(ValueError, match="chunks_per_block"):
        grain_cells.chunk_aligned(source, chunks_per_block=0)


def test_dense_blocks_follow_row_chunks(gz_dense_paths):
    source, aligned = _aligned(gz_dense_paths)
    starts, stops = _blocks(aligned)
    local = (
        starts
        - source.cell_offsets[
            np.searchsorted(source.cell_offsets, starts, side="right") - 1
        ]
    )
    local_stops = local + (stops - starts)
    assert (local // 6 == (local_stops - 1) // 6).all()  # never across chunks
    # 6-row chunks become blocks of 5 + 1 cells (block_size=5).
    assert np.isin(np.arange(0, 97, 6), local[: np.searchsorted(starts, 97)]).all()
    assert ((stops - starts) <= 5).all()


def test_on_a_view_keeps_only_its_cells(gz_paths):
    source, _ = _aligned(gz_paths)
    view = source.select(where={"cell_type": ["B", "T"]})
    aligned = grain_cells.chunk_aligned(view)
    assert aligned.num_selected_cells == view.num_selected_cells
    np.testing.assert_array_equal(
        aligned.read_blocks(np.arange(len(aligned))).row_ids,
        view.read_blocks(np.arange(len(view))).row_ids,
    )


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_loader_exactly_once_with_anndata_values(gz_paths, helpers, workers):
    source, aligned = _aligned(gz_paths)
    loader = grain_cells.DataLoader(
        data_source=aligned,
        sampler=grain_cells.BlockSampler(aligned, seed=1, num_epochs=1),
        operations=grain_cells.fetch_operations(aligned, batch_size=4, fetch_factor=5),
        worker_count=workers,
    )
    batches = helpers.run(loader)
    ids = np.concatenate([b["row_ids"][b["mask"]] for b in batches])
    np.testing.assert_array_equal(np.sort(ids), np.arange(helpers.N_CELLS))
    truth = helpers.Truth(source, gz_paths)
    for b in batches:
        m = b["mask"]
        x = np.zeros((m.size, helpers.N_GENES), np.float32)
        for r in range(m.size):
            lo, hi = b["indptr"][r], b["indptr"][r + 1]
            x[r, b["indices"][lo:hi]] = b["data"][lo:hi]
        np.testing.assert_array_equal(x[m], truth.x(b["row_ids"][m]))
        np.testing.assert_array_equal(b["obs/idx"][m], b["row_ids"][m])


def test_shards_partition_the_aligned_blocks(gz_paths):
    _, aligned = _aligned(gz_paths)
    seen = []
    for i in range(3):
        sampler = grain_cells.BlockSampler(
            aligned,
            seed=0,
            num_epochs=1,
            shard_options=sharding.ShardOptions(i, 3, drop_remainder=True),
        )
        seen.append([sampler[p].record_key for p in range(i, sampler.epoch_length, 3)])
    keys = np.concatenate(seen)
    skipped = grain_cells.BlockSampler(
        aligned,
        seed=0,
        num_epochs=1,
        shard_options=sharding.ShardOptions(0, 3, drop_remainder=True),
    ).skipped_blocks(0)
    np.testing.assert_array_equal(
        np.sort(np.concatenate([keys, skipped])), np.arange(len(aligned))
    )


def test_weighted_sampling_on_aligned_blocks(gz_paths):
    _, aligned = _aligned(gz_paths)
    weights = grain_cells.balanced_block_weights(aligned, "plate")
    sampler = grain_cells.WeightedBlockSampler(
        aligned, weights, epoch_cells=400, seed=0
    )
    keys = np.array([sampler[p].record_key for p in range(sampler.epoch_length)])
    assert keys.min() >= 0 and keys.max() < len(aligned)


@pytest.mark.slow
def test_resume_is_exact(gz_paths):
    _, aligned = _aligned(gz_paths)
    loader = grain_cells.DataLoader(
        data_source=aligned,
        sampler=grain_cells.BlockSampler(aligned, seed=2, num_epochs=1),
        operations=grain_cells.fetch_operations(aligned, batch_size=4, fetch_factor=5),
    )
    grain.experimental.assert_equal_output_after_checkpoint(loader)
