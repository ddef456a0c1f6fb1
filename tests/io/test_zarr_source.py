"""AnnData zarr stores open as sources and read exactly what anndata reads.

Every store kind (`zarr_stores.KINDS`), chunked and sharded stores read
across chunks, each codec anndata and annbatch write, CSR and dense X,
layers, raw, obsm, every obs encoding, and lists mixing `.h5ad` files and
stores; `anndata.read_zarr` is the oracle.
"""

from __future__ import annotations

import os

import anndata
import numpy as np
import pandas as pd
import pytest
import zarr
from zarr_stores import (
    KINDS,
    N_OBS,
    N_VARS,
    OBS,
    dense,
    make_adata,
    random_rows,
    read_oracle,
    write_chunked,
    write_store,
)

from grain_cells import AnnDataSource
from grain_cells.io._file_set import OpenFiles, element_files
from grain_cells.io._range_reads import read_rows


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Per kind: (path, oracle AnnData) of a CSR store."""
    out = {}
    root = tmp_path_factory.mktemp("zarr_stores")
    for kind in KINDS:
        path = write_store(make_adata(), root / f"{kind}.zarr", kind)
        out[kind] = (path, read_oracle(path))
    return out


def decoded(source, cells, name) -> np.ndarray:
    """An obs column as read, with codes turned back into labels."""
    values = cells.obs[name]
    cats = source.categories.get(name)
    if cats is None:
        return values
    return np.array([None if c < 0 else cats[c] for c in values.tolist()], object)


def expected_obs(adata, name, rows) -> np.ndarray:
    col = adata.obs[name].iloc[rows]
    if isinstance(col.dtype, pd.CategoricalDtype) or col.dtype == object:
        return np.array([None if pd.isna(v) else v for v in col], object)
    if pd.api.types.is_bool_dtype(col.dtype):
        return np.array([None if pd.isna(v) else bool(v) for v in col], object)
    if pd.api.types.is_string_dtype(col.dtype):
        return np.array([None if pd.isna(v) else v for v in col], object)
    return col.to_numpy(dtype=np.float64, na_value=np.nan)


@pytest.mark.parametrize("kind", KINDS)
def test_csr_x_and_obs_equal_anndata(stores, kind):
    path, adata = stores[kind]
    source = AnnDataSource(path, obs_columns=OBS, block_size=8)
    assert len(source.paths) == 1 and source.num_cells == N_OBS
    assert list(source.var_names) == list(adata.var_names)
    rows = random_rows(N_OBS)
    cells = source.read(rows)
    np.testing.assert_array_equal(dense(cells.X), dense(adata.X[rows]))
    for name in OBS:
        got, want = decoded(source, cells, name), expected_obs(adata, name, rows)
        if name == "nbool":  # factorised booleans: labels are bools
            got = np.array([None if v is None else bool(v) for v in got], object)
        if want.dtype == object:
            assert got.tolist() == want.tolist(), name
        else:
            np.testing.assert_array_equal(got.astype(np.float64), want, err_msg=name)
    # Blocks through Grain's record protocol.
    block = source.read_blocks([3])
    lo = 3 * 8
    np.testing.assert_array_equal(dense(block.X), dense(adata.X[lo : lo + 8]))


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
@pytest.mark.parametrize("kind", ["v2", "v3-sharded"])
@pytest.mark.parametrize("layer", ["counts", "dense", "raw"])
def test_layers_and_raw_equal_anndata(stores, kind, layer):
    path, adata = stores[kind]
    source = AnnDataSource(path, layer=layer, block_size=8)
    if layer == "raw":
        want, names = adata.raw.X, adata.raw.var_names
    else:
        want, names = adata.layers[layer], adata.var_names
    assert list(source.var_names) == list(names)
    rows = random_rows(N_OBS, seed=1)
    np.testing.assert_array_equal(dense(source.read(rows).X), dense(want[rows]))


@pytest.mark.parametrize("kind", ["v2", "v3"])
def test_obsm_equals_anndata(stores, kind):
    path, adata = stores[kind]
    source = AnnDataSource(path)
    files = element_files(source.files, "obsm/emb")
    handles = OpenFiles(files, 0)
    try:
        rows = random_rows(N_OBS, seed=2)
        got = read_rows(handles, source.cell_offsets, rows).X
    finally:
        handles.close()
    np.testing.assert_array_equal(dense(got), adata.obsm["emb"][rows])


@pytest.mark.parametrize("kind", ["v2", "v3"])
def test_dense_x_equals_anndata(tmp_path, kind):
    path = write_store(make_adata(dense=True), tmp_path / "d.zarr", kind)
    adata = read_oracle(path)
    source = AnnDataSource(path, block_size=8)
    assert not source.is_sparse
    rows = random_rows(N_OBS, seed=3)
    np.testing.assert_array_equal(dense(source.read(rows).X), adata.X[rows])


def test_mixed_h5ad_and_zarr(tmp_path):
    """One source over an .h5ad and two stores: rows, genes and categories align."""
    a = make_adata(30, row0=0)
    b = make_adata(25, seed=1, row0=30)
    c = make_adata(
        20, seed=2, row0=55, genes=[f"g{j}" for j in reversed(range(N_VARS))]
    )
    c.obs["cat"] = c.obs["cat"].cat.reorder_categories(["T", "NK", "B"])
    pa = os.fspath(tmp_path / "a.h5ad")
    a.write_h5ad(pa)
    pb = write_store(b, tmp_path / "b.zarr", "v2")
    pc = write_store(c, tmp_path / "c.zarr", "v3")
    source = AnnDataSource(
        [pa, pb, pc], obs_columns=("cat", "num"), join="outer", block_size=8
    )
    assert source.num_cells == 75
    whole = anndata.concat([a, b, c], join="outer")
    rows = random_rows(75, seed=4, size=40)
    cells = source.read(rows)
    want = whole[rows][:, list(source.var_names)].X
    np.testing.assert_array_equal(dense(cells.X), dense(want))
    labels = source.categories["cat"][cells.obs["cat"]]
    assert labels.tolist() == whole.obs["cat"].iloc[rows].tolist()
    np.testing.assert_array_equal(cells.obs["num"], rows.astype(np.float64))
    # A gene selection over the mixed list.
    picked = AnnDataSource([pa, pc], join="inner", genes=["g3", "g0"])
    got = dense(picked.read(np.array([0, 29, 30, 49])).X)
    both = anndata.concat([a, c], join="inner")[[0, 29, 30, 49]][:, ["g3", "g0"]]
    np.testing.assert_array_equal(got, dense(both.X))


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
@pytest.mark.parametrize("dense_x", [False, True], ids=["csr", "dense"])
@pytest.mark.parametrize("kind", ["v2", "v3-sharded"])
def test_chunked_store_reads_across_chunks(tmp_path, kind, dense_x):
    """Rows spanning many (inner) chunks and shards read exactly; default
    blocks (no block_size) start where chunks start."""
    path = write_chunked(tmp_path / "c.zarr", kind, dense=dense_x)
    x = zarr.open_group(path, mode="r")["X" if dense_x else "X/data"]
    assert x.chunks[0] in (8, 16)
    adata = read_oracle(path)
    source = AnnDataSource(path)
    assert source.file_info(0).chunk_bytes is not None  # compressed: chunk grid
    starts = source.chunk_starts()
    assert starts.size > 10
    _, block_starts, _ = source.block_ranges(np.arange(len(source)))
    assert set(block_starts.tolist()) <= set(starts.tolist())
    rows = np.random.default_rng(5).permutation(200)
    np.testing.assert_array_equal(dense(source.read(rows).X), dense(adata.X[rows]))
    got = source.read_blocks(np.arange(len(source)))
    np.testing.assert_array_equal(dense(got.X), dense(adata.X))


def _codecs(name):
    import numcodecs
    import zarr.codecs as zc

    return {
        "v2-gzip": [numcodecs.GZip(level=1)],
        "v2-lz4": [numcodecs.LZ4()],
        "v2-zstd": [numcodecs.Zstd(level=1)],
        "v3-gzip-crc32c": [zc.GzipCodec(level=1), zc.Crc32cCodec()],
        "v3-blosc": [zc.BloscCodec(cname="lz4")],
    }[name]


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
@pytest.mark.parametrize(
    ("kind", "codecs"),
    [
        ("v2", "v2-gzip"),
        ("v2", "v2-lz4"),
        ("v2", "v2-zstd"),
        ("v3-sharded", "v3-gzip-crc32c"),
        ("v3", "v3-blosc"),
    ],
)
def test_codecs(tmp_path, kind, codecs):
    path = write_chunked(tmp_path / "c.zarr", kind, compressors=_codecs(codecs))
    adata = read_oracle(path)
    source = AnnDataSource(path, block_size=16)
    rows = np.random.default_rng(6).permutation(200)[:80]
    np.testing.assert_array_equal(dense(source.read(rows).X), dense(adata.X[rows]))


def test_source_pickles_without_handles(stores):
    """Workers get the source by pickle and open the store themselves."""
    import pickle

    path, adata = stores["v3-sharded"]
    source = AnnDataSource(path, obs_columns=("cat",), block_size=8)
    source.read([0])  # handles open in this process
    copy = pickle.loads(pickle.dumps(source))
    rows = random_rows(N_OBS, seed=7)
    np.testing.assert_array_equal(dense(copy.read(rows).X), dense(adata.X[rows]))
    assert repr(copy) == repr(source)
