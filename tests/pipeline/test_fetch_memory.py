"""A fetch that would pass the per-worker memory budget is named at build time.

The estimate comes from the files' metadata (stored values per cell, value
and index bytes), checked here against anndata's own count of the matrix.
"""

from __future__ import annotations

import anndata
import numpy as np
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.pipeline import _config

N_OBS = 1_000


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    x = sp.random(N_OBS, 50, density=0.1, format="csr", dtype=np.float32, rng=0)
    out = str(tmp_path_factory.mktemp("fetch_memory") / "a.h5ad")
    anndata.AnnData(X=x).write_h5ad(out)
    return out


@pytest.mark.parametrize("entry", ["loader", "fetch_operations"])
def test_a_fetch_over_the_budget_warns_with_the_fix(path, entry, monkeypatch):
    nnz = anndata.read_h5ad(path).X.nnz
    # 1,024 cells asked, the file's 1,000 held; decoded rows (4-byte values,
    # 4-byte indices) and as much again formatted.
    held = 2 * nnz * 8
    monkeypatch.setattr(_config, "FETCH_MEMORY_BUDGET", held // 3, raising=False)
    source = grain_cells.AnnDataSource(path, block_size=16)
    build = {
        "loader": lambda **k: grain_cells.loader(source, **k),
        "fetch_operations": lambda **k: grain_cells.fetch_operations(source, **k),
    }[entry]
    with pytest.warns(UserWarning) as seen:
        build(batch_size=64, fetch_factor=16)
    (message,) = [str(w.message) for w in seen]
    assert message.startswith("batch_size=64, fetch_factor=16: each worker")
    assert f"about {held / 2**30:.2f} GiB for a fetch of about {N_OBS} cells" in message
    assert "Pass a smaller fetch_factor (e.g. fetch_factor=4)" in message
    build(batch_size=64, fetch_factor=4)  # within the budget: silent
