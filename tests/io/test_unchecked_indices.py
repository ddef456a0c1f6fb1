"""`check_indices=False` skips the column check, never the bound of a gene map.

A column index outside the matrix in a source whose genes are mapped (a
`genes` selection, `join='inner'/'outer'`) raises IndexError on the per-file
read; the many-file read of local uncompressed files (`io._direct_csr`) must
raise it too, not clip the index onto the last gene (a value in another gene,
silently). Files are written by anndata; one index is then overwritten.
"""

from __future__ import annotations

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.io import _direct_csr

GENES = 5


def _paths(tmp_path) -> list[str]:
    out = []
    for f in range(2):
        x = np.arange(1, 1 + 4 * GENES, dtype=np.float32).reshape(4, GENES)
        path = str(tmp_path / f"f{f}.h5ad")
        anndata.AnnData(
            X=sp.csr_matrix(x),
            obs=pd.DataFrame(index=[f"c{f}_{r}" for r in range(4)]),
            var=pd.DataFrame(index=[f"g{j}" for j in range(GENES)]),
        ).write_h5ad(path)
        out.append(path)
    with h5py.File(out[1], "r+") as h:
        h["X/indices"][0] = GENES + 3  # a column outside the matrix
    return out


def test_unchecked_bad_index_raises_on_the_many_file_read(tmp_path, monkeypatch):
    paths = _paths(tmp_path)
    calls = []
    real = _direct_csr.read

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(_direct_csr, "read", counting)
    source = grain_cells.AnnDataSource(paths, genes=["g4", "g0"], check_indices=False)
    with pytest.raises(IndexError):
        source.read(np.arange(8))  # both files: one many-file read
    assert calls == [True]  # the many-file read served it


def test_unchecked_bad_index_raises_on_the_per_file_read(tmp_path):
    source = grain_cells.AnnDataSource(
        _paths(tmp_path), genes=["g4", "g0"], check_indices=False
    )
    with pytest.raises(IndexError):
        source.read(np.arange(4, 8))  # the second file alone
