"""Paths that are not AnnData zarr stores get errors naming the store.

A directory that is no store, a file that is no store, an array at a
store's root, a store without obs/var, MuData, no X, CSC X, a missing
layer, a sparse obsm array: each refused by name, as for `.h5ad` files.
"""

from __future__ import annotations

import os
import re

import anndata
import pytest
import zarr
from zarr_stores import make_adata, write_store, zarr_format

from grain_cells import AnnDataSource
from grain_cells.io._file_set import element_files


def test_directory_that_is_not_a_store(tmp_path):
    from grain_cells.errors import AnnDataFormatError

    path = tmp_path / "plain"
    path.mkdir()
    (path / "notes.txt").write_text("x")
    with pytest.raises(AnnDataFormatError, match=re.escape(os.fspath(path))) as e:
        AnnDataSource(path)
    assert "not a zarr store" in str(e.value) and "notes.txt" in str(e.value)


@pytest.mark.parametrize(
    "what",
    [
        "not-anndata",
        "mudata",
        "no-x",
        "csc",
        "garbage",
        "bad-zip",
        "array-v2",
        "array-v3",
    ],
)
def test_bad_stores_are_refused_by_name(tmp_path, what):
    from grain_cells.errors import (
        AnnDataFormatError,
        MissingColumnError,
        UnsupportedLayoutError,
    )

    path = os.fspath(tmp_path / f"{what}.zarr")
    if what in ("garbage", "bad-zip"):
        path += ".zip" if what == "bad-zip" else ""
        with open(path, "wb") as f:
            f.write(b"not a store")
        error, words = AnnDataFormatError, "neither a zip archive"
    elif what.startswith("array"):
        zarr.create_array(path, shape=(3,), dtype="i4", zarr_format=int(what[-1]))
        error, words = AnnDataFormatError, "a zarr array at its root"
    elif what == "not-anndata":
        g = zarr.open_group(path, mode="w", zarr_format=2)
        g.create_array("numbers", shape=(4,), dtype="i4")
        error, words = AnnDataFormatError, "a zarr store but not AnnData"
    elif what == "mudata":
        g = zarr.open_group(path, mode="w", zarr_format=2)
        g.attrs["encoding-type"] = "MuData"
        with zarr_format("v2"):
            anndata.io.write_elem(g.create_group("mod"), "rna", make_adata())
        error, words = UnsupportedLayoutError, "MuData"
    elif what == "no-x":
        a = make_adata()
        a.X = None
        write_store(a, path, "v2")
        error, words = MissingColumnError, "has no X"
    else:
        a = make_adata()
        a.X = a.X.tocsc()
        write_store(a, path, "v3")
        error, words = UnsupportedLayoutError, "csc_matrix"
    with pytest.raises(error, match=re.escape(path)) as e:
        AnnDataSource(path)
    assert words in str(e.value)


def test_sparse_obsm_is_refused_by_name(tmp_path):
    """As for .h5ad: obsm arrays read as extra matrices are dense."""
    from grain_cells.errors import AnnDataFormatError

    adata = make_adata()
    adata.obsm["sparse"] = adata.X.copy()
    path = write_store(adata, tmp_path / "s.zarr", "v3")
    source = AnnDataSource(path, block_size=8)
    with pytest.raises(AnnDataFormatError, match=re.escape(path)) as e:
        element_files(source.files, "obsm/sparse")
    assert "obsm/sparse" in str(e.value) and "csr_matrix" in str(e.value)


def test_missing_layer_lists_the_stores_matrices(tmp_path):
    from grain_cells.errors import MissingColumnError

    path = write_store(make_adata(), tmp_path / "s.zarr", "v3")
    with pytest.raises(MissingColumnError, match=re.escape(path)) as e:
        AnnDataSource(path, layer="nope")
    assert "layers/counts" in str(e.value) and "raw/X" in str(e.value)


@pytest.mark.parametrize("column", ["cat", "num"])
def test_obs_read_through_stale_consolidated_metadata_is_refused(tmp_path, column):
    """An obs array changed after consolidation: refused, never misread."""
    import json
    import pathlib

    from grain_cells.errors import AnnDataFormatError

    path = write_store(make_adata(), tmp_path / "a.zarr", "v2")  # consolidated
    array = "codes" if column == "cat" else None
    doc = pathlib.Path(path, "obs", column, *([array] if array else []), ".zarray")
    meta = json.loads(doc.read_text())
    meta["shape"] = [meta["shape"][0] - 1]  # the array's own document moved on
    doc.write_text(json.dumps(meta))
    with pytest.raises(AnnDataFormatError, match="consolidated metadata of /obs/") as e:
        AnnDataSource(path, obs_columns=[column])
    assert path in str(e.value) and "shape" in str(e.value)
