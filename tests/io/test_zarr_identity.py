"""A zarr store's identity: rewritten stores are detected, copies restore.

A store rewritten under a source raises `SourceChangedError` when a process
opens it, at `verify_files()`, and at the next read of a process that has it
open; a copy of a store has the checkpoint identity of the original, an
`.h5ad` of the same cells does not (`grain_cells.io._identity`).
"""

from __future__ import annotations

import os
import re

import pytest
from zarr_stores import make_adata, write_store, zarr_format

from grain_cells import AnnDataSource


def test_store_rewritten_is_detected(tmp_path):
    from grain_cells.errors import SourceChangedError

    path = write_store(make_adata(), tmp_path / "s.zarr", "v2")
    source = AnnDataSource(path, block_size=8)
    source.read([1])
    source.close()
    other = make_adata()
    other.X.data += 1  # same shapes and nnz, other values: only chunks change
    with zarr_format("v2"):
        other.write_zarr(path)
    with pytest.raises(SourceChangedError, match=re.escape(path)) as e:
        source.read([2])
    assert "zarr store" in str(e.value)
    with pytest.raises(SourceChangedError, match=re.escape(path)):
        source.verify_files()


@pytest.mark.parametrize("kind", ["v2", "v3", "zip"])
def test_store_rewritten_while_open_is_detected_at_the_next_read(tmp_path, kind):
    from grain_cells.errors import SourceChangedError

    adata = make_adata()
    path = write_store(adata, tmp_path / "s.zarr", kind)
    source = AnnDataSource(path, block_size=8)
    source.read([1])  # this process has the store open
    adata.X.data += 1
    if kind == "zip":
        os.remove(path)
    write_store(adata, tmp_path / "s.zarr", kind)
    with pytest.raises(SourceChangedError, match=re.escape(path)) as e:
        source.read([2])
    assert "at a read" in str(e.value)


def test_store_identity_is_location_free(tmp_path):
    """A copy of a store has the checkpoint identity of the original; an
    .h5ad of the same cells does not (identity is the stored file's)."""
    import shutil

    from grain_cells.io._identity import source_identity

    adata = make_adata()
    path = write_store(adata, tmp_path / "s.zarr", "v3")
    copy = os.fspath(tmp_path / "copy.zarr")
    shutil.copytree(path, copy)
    h5 = os.fspath(tmp_path / "s.h5ad")
    adata.write_h5ad(h5)
    ids = [source_identity(AnnDataSource(p, block_size=8)) for p in (path, copy, h5)]
    assert ids[0] == ids[1]
    assert ids[0]["files"][0]["format"] == "zarr"
    assert ids[0] != ids[2] and "format" not in ids[2]["files"][0]
    other = write_store(make_adata(seed=9), tmp_path / "o.zarr", "v3")
    assert source_identity(AnnDataSource(other, block_size=8)) != ids[0]
