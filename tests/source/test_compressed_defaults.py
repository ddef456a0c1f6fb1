"""Compressed files need no tuning: blocks along the chunk grid, 64 per fetch.

The conftest files (values encode row and gene) are rewritten with X in gzip
chunks of 11 values, so a chunk holds about three cells. Built without a
`block_size`, a source over them has blocks of `n` chunks
(`grain_cells.source._chunk_grid`) and its loaders read 64 blocks per fetch;
uncompressed files and a user's `block_size` / `fetch_factor` keep the old
defaults (16 and 16) exactly. Values are checked against `anndata.read_h5ad`.
"""

from __future__ import annotations

import anndata
import h5py
import numpy as np
import pytest
from conftest import OBS, Truth, close_iterator

import grain_cells
from grain_cells.pipeline import _config as pipeline_config
from grain_cells.source import _chunk_grid as chunk_grid

CHUNK = 11


@pytest.fixture(scope="module")
def gz_paths(csr_paths, tmp_path_factory):
    directory = tmp_path_factory.mktemp("gz_defaults")
    out = []
    for p in csr_paths:
        dst = directory / p.rsplit("/", 1)[-1]
        with h5py.File(p) as f_in, h5py.File(dst, "w") as f_out:
            for key in f_in:
                if key != "X":
                    f_in.copy(f_in[key], f_out, key)
            for k, v in f_in.attrs.items():
                f_out.attrs[k] = v
            anndata.io.write_elem(
                f_out,
                "X",
                anndata.io.read_elem(f_in["X"]),
                dataset_kwargs={"chunks": (CHUNK,), "compression": "gzip"},
            )
        out.append(str(dst))
    return out


def _loader(source, *, worker_count=0, **kwargs):
    return grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=3, num_epochs=1),
        operations=grain_cells.fetch_operations(source, batch_size=4, seed=3, **kwargs),
        worker_count=worker_count,
    )


def _epoch(loader):
    iterator = iter(loader)
    try:
        return list(iterator)
    finally:
        close_iterator(iterator)


def _chunk_of_rows(paths, source):
    """Global row -> (file, chunk of `data` holding the row's first value)."""
    parts = []
    for f, path in enumerate(paths):
        with h5py.File(path) as h:
            indptr = h["X/indptr"][:]
        chunk = np.minimum(indptr[:-1], max(indptr[-1] - 1, 0)) // CHUNK
        parts.append(np.stack([np.full(chunk.size, f), chunk], axis=1))
    return np.concatenate(parts)


def test_compressed_source_blocks_follow_chunks(gz_paths):
    source = grain_cells.AnnDataSource(gz_paths, obs_columns=OBS)
    # 88 decoded bytes a chunk: 4 chunks per block fit the fetch budget.
    chosen = chunk_grid.compressed_defaults(
        source.num_cells, source.chunk_starts(), CHUNK * 8
    )
    assert chosen.chunks_per_block == 4
    assert source.block_size == chosen.block_size == 16
    assert source.fetch_blocks == 64
    _, starts, stops = source.block_ranges(np.arange(len(source)))
    np.testing.assert_array_equal(starts[1:], stops[:-1])  # every cell once
    assert starts[0] == 0 and stops[-1] == source.num_cells
    where = _chunk_of_rows(gz_paths, source)
    first, last = where[starts], where[stops - 1]
    assert (first[:, 0] == last[:, 0]).all()  # never across files
    assert (last[:, 1] - first[:, 1] < 4).all()  # at most 4 chunks of cells
    # The same blocks as grain_cells.chunk_aligned with those settings.
    grid = grain_cells.AnnDataSource(gz_paths, block_size=16, obs_columns=OBS)
    aligned = grain_cells.chunk_aligned(grid, chunks_per_block=4)
    _, a_starts, a_stops = aligned.block_ranges(np.arange(len(aligned)))
    np.testing.assert_array_equal(starts, a_starts)
    np.testing.assert_array_equal(stops, a_stops)


@pytest.mark.parametrize("worker_count", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_default_loader_reads_every_cell_once(gz_paths, worker_count):
    source = grain_cells.AnnDataSource(gz_paths, obs_columns=OBS)
    fetch = pipeline_config.default_fetch_factor(source, 4)
    assert fetch * 4 // source.block_size == 64  # 64 blocks per fetch
    batches = _epoch(_loader(source, worker_count=worker_count))
    truth = Truth(source, gz_paths)
    rows = []
    for b in batches:
        real = b["mask"]
        ids = b["row_ids"][real]
        n = int(real.sum())
        x = np.zeros((n, source.num_genes), np.float32)
        indptr = b["indptr"]
        for r in range(n):
            x[r, b["indices"][indptr[r] : indptr[r + 1]]] = b["data"][
                indptr[r] : indptr[r + 1]
            ]
        np.testing.assert_array_equal(x, truth.x(ids))
        np.testing.assert_array_equal(b["obs/idx"][real], ids)
        rows.append(ids)
    rows = np.concatenate(rows)
    np.testing.assert_array_equal(np.sort(rows), np.arange(source.num_cells))


def _row_sequence(source, **kwargs):
    return np.concatenate([b["row_ids"] for b in _epoch(_loader(source, **kwargs))])


def test_uncompressed_defaults_unchanged(csr_paths):
    source = grain_cells.AnnDataSource(csr_paths, obs_columns=OBS)
    assert source.block_size == 16 and source.fetch_blocks is None
    assert len(source) == sum(-(-n // 16) for n in (97, 130, 61))
    explicit = grain_cells.AnnDataSource(csr_paths, block_size=16, obs_columns=OBS)
    np.testing.assert_array_equal(
        _row_sequence(source), _row_sequence(explicit, fetch_factor=16)
    )


def test_given_block_size_keeps_control(gz_paths):
    source = grain_cells.AnnDataSource(gz_paths, block_size=5, obs_columns=OBS)
    assert source.fetch_blocks is None
    assert len(source) == sum(-(-n // 5) for n in (97, 130, 61))  # the grid
    assert pipeline_config.default_fetch_factor(source, 4) == 16
    np.testing.assert_array_equal(
        _row_sequence(source), _row_sequence(source, fetch_factor=16)
    )
    # Views keep the default fetch of the source they come from.
    chosen = grain_cells.AnnDataSource(gz_paths, obs_columns=OBS)
    view = chosen.select(where={"cell_type": ["B", "T"]})
    assert view.fetch_blocks == 64


@pytest.mark.parametrize(
    ("batch", "block", "blocks", "fetch"),
    [
        pytest.param(64, 16, 64, 16, id="uncompressed-shape"),
        pytest.param(64, 208, 64, 208, id="atlas-chunks"),
        pytest.param(128, 208, 64, 104, id="batch-128"),
        pytest.param(100, 112, 64, 84, id="odd-batch"),  # 75 whole blocks
        pytest.param(4, 16, 64, 256, id="small-batch"),
    ],
)
def test_default_fetch_factor(batch, block, blocks, fetch):
    assert chunk_grid.default_fetch_factor(batch, block, blocks) == fetch
    per_fetch = batch * fetch / block
    assert per_fetch == int(per_fetch) and per_fetch >= blocks


@pytest.mark.parametrize(
    ("chunk_bytes", "per_chunk", "n", "block_size"),
    [
        # ~81 cells a chunk: 2 or 4 chunks a block would hold fetches of
        # 164 or 327 minibatches of 64, past a worker's 128 slots.
        pytest.param(131_072 * 8, 81, 1, 112, id="1MiB-chunks-81-cells"),
        pytest.param(131_072 * 8, 40, 2, 112, id="1MiB-chunks-40-cells"),
        pytest.param(39_063 * 8, 24, 4, 128, id="atlas-400k-chunks"),
        pytest.param(4 << 20, 20, 1, 32, id="4MiB-chunks-over-budget"),
        pytest.param(88, 3, 4, 16, id="tiny-chunks"),
    ],
)
def test_chunks_per_block_within_budget(chunk_bytes, per_chunk, n, block_size):
    starts = np.arange(0, 100 * per_chunk, per_chunk)
    chosen = chunk_grid.compressed_defaults(100 * per_chunk, starts, chunk_bytes)
    assert (chosen.chunks_per_block, chosen.block_size) == (n, block_size)
    assert chosen.fetch_blocks == 64
    assert chosen.block_size >= 1.25 * n * per_chunk
    if n > 1:
        fetch_bytes = chunk_grid.DEFAULT_BLOCKS_PER_FETCH * n * chosen.chunk_bytes
        assert fetch_bytes <= chunk_grid.FETCH_BUDGET_BYTES
        assert 64 * n * per_chunk <= chunk_grid.MAX_FETCH_CELLS


def test_read_threads_argument(csr_paths):
    assert grain_cells.AnnDataSource(csr_paths).read_threads == "auto"
    assert grain_cells.AnnDataSource(csr_paths, read_threads=3).read_threads == 3
    with pytest.raises(
        ValueError,
        match="read_threads must be a non-negative int or 'auto', got "
        "read_threads='many'",
    ):
        grain_cells.AnnDataSource(csr_paths, read_threads="many")


@pytest.mark.parametrize("per_chunk", [3_000, 30_000])
def test_chunks_larger_than_a_fetch_are_cut(per_chunk):
    """A small file written with big chunks (one chunk of thousands of cells)
    got blocks of ~1.25 chunks and 64 of them per fetch: thousands of
    minibatches a fetch, which stalled a worker's ring for minutes."""
    starts = np.arange(0, 2 * per_chunk, per_chunk)
    chosen = chunk_grid.compressed_defaults(2 * per_chunk, starts, 88)
    assert chosen.block_size <= chunk_grid.MAX_BLOCK_CELLS
    fetch = chunk_grid.default_fetch_factor(64, chosen.block_size, chosen.fetch_blocks)
    # Blocks hold up to 1.25x their expected cells: the nominal fetch (full
    # blocks) stays within that of the cap; before, 3,760 minibatches.
    assert fetch * 64 <= 1.5 * chunk_grid.MAX_FETCH_CELLS


def test_whole_file_chunk_reads_in_one_worker_epoch(csr_paths, tmp_path):
    """One gzip chunk holds the whole file: the default loader with 2 workers
    finishes its epoch (it stalled before the fetch was capped)."""
    src = csr_paths[0]
    dst = tmp_path / "one_chunk.h5ad"
    with h5py.File(src) as f_in, h5py.File(dst, "w") as f_out:
        for key in f_in:
            if key != "X":
                f_in.copy(f_in[key], f_out, key)
        for k, v in f_in.attrs.items():
            f_out.attrs[k] = v
        x = anndata.io.read_elem(f_in["X"])
        anndata.io.write_elem(
            f_out,
            "X",
            x,
            dataset_kwargs={"chunks": (max(1, x.nnz),), "compression": "gzip"},
        )
    source = grain_cells.AnnDataSource(str(dst))
    fetch = pipeline_config.default_fetch_factor(source, 4)
    assert fetch * 4 <= 1.5 * chunk_grid.MAX_FETCH_CELLS
    rows = np.concatenate([b["row_ids"][b["mask"]] for b in _epoch(_loader(source))])
    np.testing.assert_array_equal(np.sort(rows), np.arange(source.num_cells))
