"""A file evicted by the open-file bound and opened again is not inspected
again while its `stat` is unchanged (`grain_cells.io._file_lru.Checked`)."""

from __future__ import annotations

import os

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.errors import SourceChangedError
from grain_cells.io import _open_file as file_set

CELLS = 8


def _write(path, k: int) -> None:
    rows = np.arange(k * CELLS, (k + 1) * CELLS)
    x = sp.csr_matrix(
        ((rows + 1).astype(np.float32), (np.arange(CELLS), rows % 4)), shape=(CELLS, 4)
    )
    obs = pd.DataFrame(
        {"kind": pd.Categorical(np.where(rows % 3, "a", "b")), "n": rows},
        index=[f"c{r}" for r in rows],
    )
    anndata.AnnData(x, obs=obs, var=pd.DataFrame(index=list("wxyz"))).write_h5ad(path)


@pytest.fixture
def paths(tmp_path) -> list[str]:
    out = [str(tmp_path / f"f{k}.h5ad") for k in range(3)]
    for k, p in enumerate(out):
        _write(p, k)
    return out


@pytest.fixture
def inspections(monkeypatch):
    calls = []
    real = file_set.inspect_element

    def counting(f, element):
        calls.append(element)
        return real(f, element)

    monkeypatch.setattr(file_set, "inspect_element", counting)
    return calls


def _rows(file: int) -> np.ndarray:
    return np.arange(file * CELLS, (file + 1) * CELLS)


def test_a_reopened_file_is_not_inspected_again(paths, inspections):
    source = grain_cells.AnnDataSource(
        paths, block_size=2, obs_columns=["kind", "n"], max_open_files=1
    )
    adatas = [anndata.read_h5ad(p) for p in paths]
    for _ in range(3):
        for k in range(3):
            cells = source.read(_rows(k))
            np.testing.assert_array_equal(cells.X.toarray(), adatas[k].X.toarray())
            np.testing.assert_array_equal(cells.obs["n"], adatas[k].obs["n"])
            kinds = np.asarray(source.categories["kind"])[cells.obs["kind"]]
            np.testing.assert_array_equal(kinds, adatas[k].obs["kind"].to_numpy())
    assert len(inspections) == 3  # once per file, though opened 9 times
    source.close()


def test_a_file_changed_while_evicted_is_refused_at_its_reopen(paths, inspections):
    source = grain_cells.AnnDataSource(
        paths, block_size=2, obs_columns=["kind"], max_open_files=1
    )
    source.read(_rows(0))
    source.read(_rows(1))  # file 0 closed
    st = os.stat(paths[0])
    with h5py.File(paths[0], "r+") as f:
        f["X/data"][0] = 99.0
    os.utime(paths[0], ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(SourceChangedError, match=r"f0\.h5ad"):
        source.read(_rows(0))
    source.close()
