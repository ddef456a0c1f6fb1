"""Start-up on compressed files: `indptr` streamed in pieces, chunk starts cached.

A source built without a `block_size` on a compressed CSR file cuts blocks
where chunks of `data` begin, which only `indptr` tells. The scan reads
`indptr` a few whole chunks at a time (never all of it at once), and its
answer is kept in `$GRAIN_CELLS_CACHE/chunk-starts/`, so a second start
opens no file for it. Blocks must be exactly those of the whole-`indptr`
computation (the golden orders of the compressed defaults rest on them).
"""

from __future__ import annotations

import os

import anndata
import h5py
import numpy as np
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.hdf5._chunks import ChunkedReader
from grain_cells.io import _matrix
from grain_cells.source import _chunk_grid
from grain_cells.synthetic import write_thin_atlas
from grain_cells.synthetic._thin import thin_rows

CHUNK = 1_000
N_THIN = 40_000


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test starts from an empty cache of its own."""
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def thin_gz(tmp_path_factory):
    path = tmp_path_factory.mktemp("thin_gz") / "thin.h5ad"
    return str(write_thin_atlas(path, N_THIN, compression="gzip", chunks=CHUNK))


@pytest.fixture(scope="module")
def sparse_gz(tmp_path_factory):
    """Empty rows first, in runs and last; rows wider than a chunk of `data`."""
    rng = np.random.default_rng(7)
    nnz = rng.choice([0, 0, 1, 3, 9, 25], size=500)
    nnz[:7] = 0
    nnz[-5:] = 0
    nnz[200] = 40  # one row spans several chunks of 11 values
    indptr = np.concatenate([[0], np.cumsum(nnz)])
    indices = np.concatenate([np.sort(rng.choice(60, k, replace=False)) for k in nnz])
    row = np.repeat(np.arange(nnz.size), nnz)
    x = sp.csr_matrix(((row + 1).astype(np.float32), indices, indptr), (500, 60))
    path = tmp_path_factory.mktemp("sparse_gz") / "sparse.h5ad"
    anndata.AnnData(x).write_h5ad(
        path, compression="gzip", compression_opts=4
    )  # anndata's own chunks, then rewritten with small ones below
    with h5py.File(path, "a") as f:
        del f["X"]
        anndata.io.write_elem(
            f, "X", x, dataset_kwargs={"chunks": (11,), "compression": "gzip"}
        )
    return str(path)


def _reference(path: str) -> np.ndarray:
    """The chunk starts from the whole `indptr`, as before the scan."""
    with h5py.File(path) as f:
        ptr = f["X/indptr"][:].astype(np.int64)
        length = f["X/data"].chunks[0]
    n = ptr.size - 1
    n_chunks = max(1, -(-int(ptr[-1]) // length))
    starts = np.unique(np.searchsorted(ptr[:-1], np.arange(n_chunks) * length))
    return np.union1d([0], starts[starts < n])


def _blocks(source):
    _, starts, stops = source.block_ranges(np.arange(len(source)))
    return np.stack([starts, stops])


@pytest.mark.parametrize("scan_rows", [1, 7, CHUNK, 4 * CHUNK + 3, 1 << 20])
def test_scan_in_pieces_finds_the_whole_indptr_starts(
    thin_gz, sparse_gz, scan_rows, monkeypatch
):
    monkeypatch.setattr(_matrix, "SCAN_ROWS", scan_rows)
    for path in (thin_gz, sparse_gz):
        got = grain_cells.AnnDataSource(path, block_size=16).chunk_starts()
        np.testing.assert_array_equal(got, _reference(path))


def test_construction_never_reads_indptr_whole(thin_gz, monkeypatch):
    """Counted through a hook: each read of indptr is a few chunks at most."""
    monkeypatch.setattr(_matrix, "SCAN_ROWS", 2 * CHUNK)
    reads, decodes = [], []
    read, decode = ChunkedReader.read, ChunkedReader._decode

    def spy_read(self, starts, stops, *args, **kwargs):
        if self.name.endswith("indptr"):
            reads.append(int((stops - starts).sum()))
        return read(self, starts, stops, *args, **kwargs)

    def spy_decode(self, k, *args, **kwargs):
        if self.name.endswith("indptr"):
            decodes.append(k)
        return decode(self, k, *args, **kwargs)

    monkeypatch.setattr(ChunkedReader, "read", spy_read)
    monkeypatch.setattr(ChunkedReader, "_decode", spy_decode)
    source = grain_cells.AnnDataSource(thin_gz)
    n_ptr_chunks = -(-(N_THIN + 1) // CHUNK)
    assert reads and max(reads) <= 2 * CHUNK
    # Each chunk of indptr decoded about once (the last entry's chunk twice).
    assert len(decodes) <= n_ptr_chunks + 2
    np.testing.assert_array_equal(np.unique(source.block_table.cell_offsets[:-1]), [0])


def test_second_start_opens_nothing_for_blocks(thin_gz, own_cache, monkeypatch):
    first = grain_cells.AnnDataSource(thin_gz)
    entries = os.listdir(own_cache / "chunk-starts")
    assert len(entries) == 1

    def fail(self):
        raise AssertionError("indptr scanned although the cache holds the starts")

    monkeypatch.setattr(_matrix.CsrReader, "chunk_starts", fail)
    second = grain_cells.AnnDataSource(thin_gz)
    np.testing.assert_array_equal(_blocks(second), _blocks(first))
    np.testing.assert_array_equal(second.chunk_starts(), _reference(thin_gz))
    aligned = grain_cells.chunk_aligned(second, chunks_per_block=2)
    assert len(aligned) > 0


def test_values_of_cached_blocks_are_the_cells(thin_gz, helpers):
    """A source started from the cache reads the right cells (row i encodes i)."""
    first = grain_cells.AnnDataSource(thin_gz)
    source = grain_cells.AnnDataSource(thin_gz)  # from the cache
    np.testing.assert_array_equal(_blocks(source), _blocks(first))
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=1, num_epochs=1),
        operations=grain_cells.fetch_operations(source, batch_size=64),
        worker_count=0,
    )
    ids = []
    for b in helpers.run(loader):
        rows = b["row_ids"][b["mask"]]
        ids.append(rows)
        r = int(np.flatnonzero(b["mask"])[0])
        i = int(b["row_ids"][r])
        _, indices, data = thin_rows(i, i + 1, 2000)
        lo, hi = b["indptr"][r], b["indptr"][r + 1]
        np.testing.assert_array_equal(b["indices"][lo:hi], indices)
        np.testing.assert_array_equal(b["data"][lo:hi], data)
    np.testing.assert_array_equal(np.sort(np.concatenate(ids)), np.arange(N_THIN))


def test_a_changed_file_is_scanned_again(tmp_path, monkeypatch):
    path = str(
        write_thin_atlas(tmp_path / "t.h5ad", 5_000, compression="gzip", chunks=500)
    )
    calls = []
    scan = _matrix.CsrReader.chunk_starts

    def counting(self):
        calls.append(1)
        return scan(self)

    monkeypatch.setattr(_matrix.CsrReader, "chunk_starts", counting)
    grain_cells.AnnDataSource(path)
    grain_cells.AnnDataSource(path)
    assert len(calls) == 1
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    grain_cells.AnnDataSource(path)
    assert len(calls) == 2


def test_a_bad_or_unwritable_cache_falls_back(thin_gz, own_cache, monkeypatch):
    first = grain_cells.AnnDataSource(thin_gz)
    (entry,) = (own_cache / "chunk-starts").iterdir()
    np.save(entry, np.array([5, 3, 1]))  # not sorted, not from 0
    again = grain_cells.AnnDataSource(thin_gz)
    np.testing.assert_array_equal(_blocks(again), _blocks(first))
    np.testing.assert_array_equal(np.load(entry), _reference(thin_gz))
    blocker = own_cache.parent / "not_a_folder"
    blocker.write_text("")
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(blocker))
    third = grain_cells.AnnDataSource(thin_gz)
    np.testing.assert_array_equal(_blocks(third), _blocks(first))
    assert _chunk_grid.cache_dir().startswith(str(blocker))


def test_blocks_of_every_cell_are_those_over_an_all_true_mask():
    # Without a selection, chunk-grid blocks come from the cuts alone (no
    # mask over every cell); they must be the blocks the mask gave.
    from listed_blocks import blocks_over_runs

    from grain_cells.source import BlockTable, _chunk_grid

    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = rng.integers(0, 40, int(rng.integers(1, 5)))
        n = int(sizes.sum())
        if n == 0:
            continue
        table = BlockTable.grid(sizes, int(rng.integers(1, 9)))
        starts = np.unique(rng.integers(0, n, int(rng.integers(0, 10))))
        starts = np.union1d(starts, [0])
        per_block = int(rng.integers(1, 4))
        got = _chunk_grid.chunk_aligned_blocks(table, starts, per_block)
        cuts = np.union1d(
            table.cell_offsets, _chunk_grid._every_nth_chunk(starts, table, per_block)
        )
        want = blocks_over_runs(np.ones(n, bool), cuts, table.block_size)
        _, got_starts, got_stops = got.ranges(np.arange(len(got)))
        np.testing.assert_array_equal(got_starts, want[0])
        np.testing.assert_array_equal(got_stops, want[1])
