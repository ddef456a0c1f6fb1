"""CSR chunks zarr never wrote because they hold only the fill value.

anndata writes with zarr's `write_empty_chunks=False`: a chunk of `X/indices`
whose values are all 0 (cells that express only gene 0) or of `X/data` whose
values are all 0 (stored zeros) is left out, and `anndata.read_zarr` reads it
as zeros. Such a store is valid and is read equal to anndata; a missing chunk
of `indices` that makes a row store column 0 twice is not what anndata
writes, and is refused as damaged.
"""

from __future__ import annotations

import os
import pathlib

import anndata
import numpy as np
import pytest
import scipy.sparse as sp
import zarr
from zarr_copies import layout_params, write_store

import grain_cells
from grain_cells import errors

N_OBS, N_VARS = 100, 12
ONLY_GENE_0 = range(20, 60)  # 40 values in a row, all in column 0
STORED_ZEROS = range(64, 96)  # 32 values in a row, all 0.0, in column 5
LAYOUTS = layout_params("zarr-v2", "zarr-v3", "zarr-v3-sharded")


def _matrix() -> sp.csr_matrix:
    rows, cols, vals = [], [], []
    for i in range(N_OBS):
        if i in ONLY_GENE_0:
            picked = [(0, i + 1.0)]
        elif i in STORED_ZEROS:
            picked = [(5, 0.0)]
        else:
            picked = [(i % N_VARS, i + 1.0), ((i + 5) % N_VARS, 100.0 * i + 1)]
        for j, v in sorted(picked):
            rows.append(i)
            cols.append(j)
            vals.append(v)
    x = sp.csr_matrix((np.array(vals, np.float32), (rows, cols)), shape=(N_OBS, N_VARS))
    assert x.nnz == len(vals)  # the stored zeros stay stored
    return x


def _chunk_files(path, array: str) -> list[pathlib.Path]:
    root = pathlib.Path(path) / array
    return [
        p
        for p in root.rglob("*")
        if p.is_file() and p.name not in {".zarray", ".zattrs", "zarr.json"}
    ]


def _missing_chunks(path, array: str) -> int:
    """How many (inner) chunks of `array` zarr did not write."""
    a = zarr.open_array(pathlib.Path(path) / array, mode="r")
    return a.nchunks - a.nchunks_initialized


@pytest.mark.parametrize(
    "codecs", [{}, {"compressors": None}], ids=["compressed", "uncompressed"]
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_fill_chunks_of_a_valid_store_are_read_as_anndata_reads_them(
    tmp_path, layout, codecs
):
    """Compressed chunks are decoded whole; uncompressed ones are read by
    byte range (`grain_cells.zarr._reads.RangeReader._read_raw`): both paths fill."""
    x = _matrix()
    path = write_store(
        anndata.AnnData(X=x), tmp_path / "a.zarr", layout, chunk=16, **codecs
    )
    if layout == "zarr-v3-sharded":  # inner chunks marked empty in the index
        for name in ("indices", "data"):
            group = zarr.open_group(path, mode="r")
            array = group[f"X/{name}"]
            stored = np.asarray(array[:])
            empty = [
                k
                for k in range(-(-stored.size // 16))
                if not stored[16 * k : 16 * (k + 1)].any()
            ]
            assert empty, name  # some inner chunk is all zeros
    else:
        assert _missing_chunks(path, "X/indices") >= 2
        assert _missing_chunks(path, "X/data") >= 1
    oracle = anndata.read_zarr(path).X
    np.testing.assert_array_equal(oracle.toarray(), x.toarray())
    source = grain_cells.AnnDataSource(path, block_size=4)
    cells = source.read(np.arange(N_OBS))
    np.testing.assert_array_equal(cells.X.toarray(), oracle.toarray())
    np.testing.assert_array_equal(cells.X.indptr, oracle.indptr)
    np.testing.assert_array_equal(cells.X.indices, oracle.indices)
    np.testing.assert_array_equal(cells.X.data, oracle.data)
    # Reads of a few rows that start inside the missing chunks, too.
    rows = np.array([25, 26, 44, 71, 72, 97])
    part = source.read(rows)
    np.testing.assert_array_equal(part.X.toarray(), oracle[rows].toarray())
    source.close()


def _damage_indices(path, layout) -> str:
    """Deletes the first `indices` chunk (sharded: the first shard, every
    inner chunk of it), which rows of two values each share."""
    del layout
    array = zarr.open_group(path, mode="r")["X/indices"]
    key = array.metadata.encode_chunk_key((0,))
    victim = pathlib.Path(path) / "X" / "indices" / key
    assert victim.exists(), victim
    os.remove(victim)
    return key


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_lost_indices_chunk_that_repeats_column_0_is_refused(tmp_path, layout):
    """Rows 0-7 store two columns each; read as fill values both would be
    column 0, which anndata never writes: the store is damaged."""
    x = _matrix()
    path = write_store(anndata.AnnData(X=x), tmp_path / "a.zarr", layout, chunk=16)
    key = _damage_indices(path, layout)
    source = grain_cells.AnnDataSource(path, block_size=4)
    with pytest.raises(errors.CorruptChunkError) as e:
        source.read(np.arange(N_OBS))
    message = str(e.value)
    assert path in message and "X/indices" in message
    assert f"X/indices/{key}" in message or repr(f"X/indices/{key}") in message
    assert "column 0" in message and "rewrite or re-copy" in message
    assert "row 0" in message
    source.close()
