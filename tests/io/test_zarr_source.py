"""AnnData zarr stores open as sources and read exactly what anndata reads.

Stores are written by anndata into a temporary folder: zarr v2 (anndata
0.12's default), v3 (`anndata.settings.zarr_write_format = 3`), v3 sharded
(`auto_shard_zarr_v3`) and a `.zarr.zip`. The value stored at (row i, gene
j) is `i * 100 + j + 1`, so a misplaced value shows; the oracle is
`anndata.read_zarr`.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import zarr

from grain_cells import AnnDataSource
from grain_cells.io._element_files import element_files
from grain_cells.io._file_set import OpenFiles
from grain_cells.io._range_reads import read_rows

N_OBS, N_VARS = 57, 9
OBS = ("cat", "nint", "nbool", "label", "num")


def value_matrix(n_obs=N_OBS, n_vars=N_VARS, seed=0, row0=0) -> sp.csr_matrix:
    """CSR with `(row0 + i) * 100 + j + 1` at (i, j), about half the entries."""
    rng = np.random.default_rng(seed)
    mask = rng.random((n_obs, n_vars)) < 0.5
    mask[::5] = False  # some empty rows
    i, j = np.nonzero(mask)
    return sp.csr_matrix(
        (((row0 + i) * 100 + j + 1).astype(np.float32), (i, j)), shape=(n_obs, n_vars)
    )


def make_adata(n_obs=N_OBS, *, dense=False, seed=0, row0=0, genes=None):
    """An AnnData with every encoding anndata writes for the io layer to read."""
    x = value_matrix(n_obs, N_VARS, seed, row0)
    rows = np.arange(n_obs)
    nint = pd.array(rows % 7, dtype="Int64")
    nint[rows % 4 == 1] = pd.NA
    nbool = pd.array(rows % 3 == 0, dtype="boolean")
    nbool[rows % 5 == 2] = pd.NA
    obs = pd.DataFrame(
        {
            "cat": pd.Categorical(np.array(["B", "T", "NK"])[rows % 3]),
            "nint": nint,
            "nbool": nbool,
            "label": [f"L{(row0 + i) % 4}" for i in rows],
            "num": (row0 + rows).astype(np.float64),
        },
        index=[f"cell{row0 + i}" for i in rows],
    )
    genes = genes or [f"g{j}" for j in range(N_VARS)]
    var = pd.DataFrame(index=pd.Index(genes, name="gene_id"))
    a = anndata.AnnData(
        X=x.toarray() if dense else x,
        obs=obs,
        var=var,
        layers={"counts": (x * 2).tocsr(), "dense": x.toarray() + 0.5},
        obsm={
            "emb": np.stack([row0 + rows, -(row0 + rows)], axis=1).astype(np.float32)
        },
    )
    raw = anndata.AnnData(
        X=sp.hstack([x, x[:, :2] * 3]).tocsr(),
        var=pd.DataFrame(index=[*genes, "extra0", "extra1"]),
    )
    a.raw = raw
    return a


@contextlib.contextmanager
def zarr_format(kind: str):
    """anndata's zarr settings for a store kind, for the writes inside."""
    with warnings.catch_warnings():
        # "v2 will not be the default", "this setting will be removed"...
        warnings.simplefilter("ignore")
        with anndata.settings.override(
            zarr_write_format=2 if kind in ("v2", "zip") else 3,
            auto_shard_zarr_v3=kind == "v3-sharded",
        ):
            yield


def write_store(adata, path, kind: str) -> str:
    """Writes `adata` as a zarr store of `kind`; returns its path."""
    path = os.fspath(path)
    with zarr_format(kind):
        if kind == "zip":
            path += ".zip"
            store = zarr.storage.ZipStore(path, mode="w")
            adata.write_zarr(store, convert_strings_to_categoricals=False)
            store.close()
        else:
            # "label" stays a string array (vlen-utf8 in v2, the string
            # dtype in v3, a nullable-string-array under pandas 3).
            adata.write_zarr(path, convert_strings_to_categoricals=False)
    return path


def read_oracle(path) -> anndata.AnnData:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if path.endswith(".zip"):
            store = zarr.storage.ZipStore(path, mode="r")
            try:
                return anndata.read_zarr(store).to_memory()
            finally:
                store.close()
        return anndata.read_zarr(path)


KINDS = ["v2", "v3", "v3-sharded", "zip"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Per kind: (path, oracle AnnData) of a CSR store."""
    out = {}
    root = tmp_path_factory.mktemp("zarr_stores")
    for kind in KINDS:
        path = write_store(make_adata(), root / f"{kind}.zarr", kind)
        out[kind] = (path, read_oracle(path))
    return out


def dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def random_rows(n, seed=0, size=20) -> np.ndarray:
    return np.random.default_rng(seed).choice(n, size=size, replace=False)


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

    from grain_cells.storage._identity import source_identity

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


def write_chunked(path, kind: str, *, dense: bool = False, compressors=None) -> str:
    """A store of 200 cells whose X has small chunks (sharded: 2 shards)."""
    path = os.fspath(path)
    adata = make_adata(200, dense=dense)
    kwargs = {"chunks": (8, N_VARS) if dense else (16,)}
    if compressors is not None:
        kwargs["compressors"] = compressors
    with zarr_format(kind):
        adata.write_zarr(path)
        group = zarr.open_group(path, mode="r+", use_consolidated=False)
        anndata.io.write_elem(group, "X", adata.X, dataset_kwargs=kwargs)
        zarr.consolidate_metadata(path)
    return path


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


def test_missing_layer_lists_the_stores_matrices(stores):
    from grain_cells.errors import MissingColumnError

    path, _ = stores["v3"]
    with pytest.raises(MissingColumnError, match=re.escape(path)) as e:
        AnnDataSource(path, layer="nope")
    assert "layers/counts" in str(e.value) and "raw/X" in str(e.value)


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
