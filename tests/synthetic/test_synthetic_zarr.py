"""The synthetic maker's zarr stores: the h5ad's cells, anndata's layouts."""

from __future__ import annotations

import anndata
import numpy as np
import pytest
import zarr

from grain_cells.synthetic import (
    ZARR_LAYOUTS,
    cached_tahoe_like,
    cached_tahoe_like_zarr,
    write_tahoe_like,
    write_tahoe_like_zarr,
)

SMALL = {"n_genes": 300, "mean_nnz": 40.0, "chunk_cells": 250}
N_CELLS = 600


@pytest.fixture(scope="module")
def h5ad(tmp_path_factory):
    path = tmp_path_factory.mktemp("synthetic_zarr") / "small.h5ad"
    return anndata.read_h5ad(write_tahoe_like(path, N_CELLS, **SMALL))


def _same(a, b):
    assert a.shape == b.shape
    np.testing.assert_array_equal(a.X.indptr, b.X.indptr)
    np.testing.assert_array_equal(a.X.indices, b.X.indices)
    np.testing.assert_array_equal(a.X.data, b.X.data)
    assert a.obs.equals(b.obs) and a.var.equals(b.var)


@pytest.mark.parametrize("compressed", [True, False], ids=["default", "raw"])
@pytest.mark.parametrize("layout", ZARR_LAYOUTS)
def test_store_holds_the_h5ad_cells_in_anndata_layout(
    h5ad, tmp_path, layout, compressed
):
    path = write_tahoe_like_zarr(
        tmp_path / "s.zarr", N_CELLS, layout=layout, compressed=compressed, **SMALL
    )
    _same(anndata.read_zarr(path), h5ad)
    root = zarr.open_group(path, mode="r")
    assert root.metadata.zarr_format == (2 if layout == "v2" else 3)
    assert "X" in root.metadata.consolidated_metadata.metadata  # lists X
    for name in ("data", "indices", "indptr"):
        array = root["X"][name]
        # what zarr picks for anndata's create_array of the full-size array
        assert (array.shards is not None) == (layout == "v3-sharded")
        assert bool(array.compressors) == compressed
    assert not list(tmp_path.glob(".*h5ad"))  # the temporary h5ad is gone


def test_cached_store_is_made_once_from_the_cached_h5ad(tmp_path):
    path = cached_tahoe_like_zarr(N_CELLS, cache_dir=tmp_path, **SMALL)
    h5ad = cached_tahoe_like(N_CELLS, cache_dir=tmp_path, **SMALL)
    assert path.name == f"{h5ad.stem}-v3-sharded-default.zarr"
    assert path.parent == h5ad.parent
    stamp = (path / "zarr.json").stat().st_mtime_ns
    again = cached_tahoe_like_zarr(N_CELLS, cache_dir=tmp_path, **SMALL)
    assert again == path and (path / "zarr.json").stat().st_mtime_ns == stamp
    raw = cached_tahoe_like_zarr(N_CELLS, cache_dir=tmp_path, compressed=False, **SMALL)
    assert raw.name.endswith("-v3-sharded-raw.zarr")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    _same(anndata.read_zarr(raw), anndata.read_h5ad(h5ad))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"layout": "v4"}, "layout must be one of", id="layout"),
        pytest.param(
            {"compressed": "yes"}, "compressed must be a bool", id="compressed"
        ),
        pytest.param({"compression": "gzip"}, "shape only the .h5ad", id="h5ad-codec"),
        pytest.param({"dense": True}, "shape only the .h5ad", id="dense"),
    ],
)
def test_bad_arguments_are_named(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        write_tahoe_like_zarr(tmp_path / "s.zarr", 10, **kwargs)
    with pytest.raises(ValueError, match=match):
        cached_tahoe_like_zarr(10, cache_dir=tmp_path, **kwargs)
    assert not list(tmp_path.iterdir())
