"""AnnDataSource reads every storage variant anndata writes, exactly."""

from __future__ import annotations

import dataclasses
import pickle

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.hdf5 import _reads as hdf5_reads
from grain_cells.io._file_set import FileSet

N_OBS, N_VARS = 230, 37


def _frame(n_obs: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    obs = pd.DataFrame(index=[f"cell{i}" for i in range(n_obs)])
    obs["cell_type"] = pd.Categorical(rng.choice(["B", "T", "NK"], n_obs))
    obs["flag"] = rng.random(n_obs) < 0.5
    obs["idx"] = np.arange(n_obs, dtype=np.int64)
    obs["score"] = np.arange(n_obs) / 2.0
    obs["donor"] = rng.choice(["d1", "d2"], n_obs).astype(object)
    nullable = pd.array(np.arange(n_obs), dtype="Int64")
    nullable[::7] = pd.NA
    obs["count"] = nullable
    return obs


def _matrix(n_obs: int, n_vars: int, seed: int) -> sp.csr_matrix:
    """CSR whose stored value at (i, j) is i * 100 + j + 1; some rows empty."""
    rng = np.random.default_rng(seed)
    mask = rng.random((n_obs, n_vars)) < 0.3
    mask[::11] = False
    rows, cols = np.nonzero(mask)
    values = (rows * 100 + cols + 1).astype(np.float32)
    return sp.csr_matrix((values, (rows, cols)), shape=(n_obs, n_vars))


def _adata(n_obs=N_OBS, n_vars=N_VARS, seed=0) -> ad.AnnData:
    var = pd.DataFrame(index=[f"g{j}" for j in range(n_vars)])
    return ad.AnnData(_matrix(n_obs, n_vars, seed), obs=_frame(n_obs, seed), var=var)


def _write(path, kind: str):
    a = _adata()
    kwargs = {}
    if kind == "dense":
        a.X = a.X.toarray()
    elif kind == "dense-gzip":
        a.X = a.X.toarray()
        kwargs["compression"] = "gzip"
    elif kind in ("gzip", "lzf"):
        kwargs["compression"] = kind
    elif kind == "layer":
        a.layers["counts"] = a.X * 2
        a.X = sp.csr_matrix(a.X.shape, dtype=np.float32)
    elif kind == "raw":
        a.raw = a
        a.X = sp.csr_matrix(a.X.shape, dtype=np.float32)
    elif kind == "float64":
        a.X = a.X.astype(np.float64)
    elif kind == "int32":
        a.X = a.X.astype(np.int32)
    a.write_h5ad(path, **kwargs)
    return {"layer": "counts", "raw": "raw"}.get(kind)


def _expected(path, layer, rows):
    a = ad.read_h5ad(path)
    m = a.X if layer is None else (a.raw.X if layer == "raw" else a.layers[layer])
    m = m[rows]
    return m.toarray() if sp.issparse(m) else np.asarray(m)


KINDS = [
    "csr",
    "gzip",
    "lzf",
    "dense",
    "dense-gzip",
    "layer",
    "raw",
    "float64",
    "int32",
]


@pytest.fixture(scope="module", params=KINDS)
def written(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / f"{request.param}.h5ad"
    layer = _write(path, request.param)
    return request.param, path, layer


def _dense(x):
    return x.toarray() if sp.issparse(x) else x


def test_reads_equal_anndata(written):
    _kind, path, layer = written
    source = grain_cells.AnnDataSource(path, layer=layer, obs_columns=["idx"])
    rng = np.random.default_rng(1)
    for rows in (
        rng.integers(0, N_OBS, 50),
        np.arange(N_OBS),
        np.array([5, 5, 0]),
        rng.permutation(N_OBS)[:17],
    ):
        cells = source.read(rows)
        np.testing.assert_array_equal(_dense(cells.X), _expected(path, layer, rows))
        assert cells.X.dtype == _expected(path, layer, rows[:1]).dtype
        np.testing.assert_array_equal(cells.row_ids, rows)
        np.testing.assert_array_equal(cells.obs["idx"], rows)


def test_reads_equal_after_pickling(written):
    _kind, path, layer = written
    source = grain_cells.AnnDataSource(path, layer=layer)
    source.read([0])  # opened here: the pickle must not carry handles
    clone = pickle.loads(pickle.dumps(source))
    rows = np.random.default_rng(2).integers(0, N_OBS, 40)
    np.testing.assert_array_equal(
        _dense(clone.read(rows).X), _expected(path, layer, rows)
    )
    assert repr(clone) == repr(source)


def test_direct_path_used_for_uncompressed(written):
    kind, path, layer = written
    source = grain_cells.AnnDataSource(path, layer=layer)
    reader = source._file(0).reader
    assert reader.direct == (kind not in ("gzip", "lzf", "dense-gzip"))


def test_read_ranges_and_blocks(tmp_path):
    path = tmp_path / "a.h5ad"
    _write(path, "csr")
    source = grain_cells.AnnDataSource(path, block_size=7)
    cells = source.read_ranges([50, 3, 100], [60, 4, 100])
    rows = np.r_[50:60, 3]
    np.testing.assert_array_equal(cells.row_ids, rows)
    np.testing.assert_array_equal(cells.X.toarray(), _expected(path, None, rows))
    blocks = source.read_blocks([32, 0])  # block 32 is the short last one
    np.testing.assert_array_equal(blocks.row_ids, np.r_[224:230, 0:7])
    assert len(source) == -(-N_OBS // 7)
    assert source[32] == grain_cells.source.Block(32, 0, 224, 230, source.source_id)


def test_several_files_concatenate_with_harmonised_categories(tmp_path):
    paths = []
    for i, n in enumerate([40, 65, 31]):
        a = _adata(n, N_VARS, seed=i)
        if i == 1:  # different category order and an extra category
            a.obs["cell_type"] = pd.Categorical(
                np.where(np.arange(n) % 3 == 0, "DC", a.obs["cell_type"].astype(str)),
                categories=["T", "NK", "DC", "B"],
            )
        paths.append(tmp_path / f"f{i}.h5ad")
        a.write_h5ad(paths[-1])
    source = grain_cells.AnnDataSource(
        paths, obs_columns=["cell_type", "idx"], block_size=16
    )
    assert source.num_cells == 136
    np.testing.assert_array_equal(source.cell_offsets, [0, 40, 105, 136])
    # 3 + 5 + 2 blocks: blocks never straddle files.
    assert len(source) == 10
    assert source[3] == grain_cells.source.Block(3, 1, 40, 56, source.source_id)
    rows = np.arange(136)[::-1]
    cells = source.read(rows)
    labels = source.categories["cell_type"][cells.obs["cell_type"]]
    want = np.concatenate(
        [ad.read_h5ad(p).obs["cell_type"].astype(str).to_numpy() for p in paths]
    )[rows]
    np.testing.assert_array_equal(labels, want)
    mats = sp.vstack([ad.read_h5ad(p).X for p in paths]).tocsr()
    np.testing.assert_array_equal(cells.X.toarray(), mats[rows].toarray())
    np.testing.assert_array_equal(
        source.obs_values("idx"), np.concatenate([np.arange(n) for n in (40, 65, 31)])
    )


@pytest.mark.parametrize(
    "genes",
    [
        pytest.param(["g30", "g2", "g7"], id="names-reordered"),
        pytest.param(np.arange(N_VARS) % 3 == 0, id="mask"),
        pytest.param(np.array([4, 0, 36]), id="positions"),
    ],
)
@pytest.mark.parametrize("kind", ["csr", "dense"])
def test_gene_subset(tmp_path, genes, kind):
    path = tmp_path / "a.h5ad"
    _write(path, kind)
    source = grain_cells.AnnDataSource(path, genes=genes)
    names = np.array([f"g{j}" for j in range(N_VARS)])
    if isinstance(genes, np.ndarray) and genes.dtype == bool:
        cols = np.flatnonzero(genes)
    elif isinstance(genes, np.ndarray):
        cols = genes
    else:
        cols = np.array([int(g[1:]) for g in genes])
    np.testing.assert_array_equal(source.var_names, names[cols])
    rows = np.random.default_rng(3).integers(0, N_OBS, 60)
    got = _dense(source.read(rows).X)
    np.testing.assert_array_equal(got, _expected(path, None, rows)[:, cols])


def test_obs_encodings(tmp_path):
    path = tmp_path / "a.h5ad"
    a = _adata()
    a.write_h5ad(path)
    cols = ["cell_type", "flag", "idx", "score", "donor", "count"]
    source = grain_cells.AnnDataSource(path, obs_columns=cols)
    rows = np.arange(N_OBS)
    obs = source.read(rows).obs
    cats = source.categories
    np.testing.assert_array_equal(
        cats["cell_type"][obs["cell_type"]], a.obs["cell_type"].astype(str)
    )
    np.testing.assert_array_equal(obs["cell_type"], a.obs["cell_type"].cat.codes)
    np.testing.assert_array_equal(cats["flag"][obs["flag"]], a.obs["flag"])
    np.testing.assert_array_equal(obs["idx"], rows)
    np.testing.assert_array_equal(obs["score"], rows / 2.0)
    np.testing.assert_array_equal(cats["donor"][obs["donor"]], a.obs["donor"])
    want = a.obs["count"].to_numpy(dtype=np.float64, na_value=np.nan)
    np.testing.assert_array_equal(obs["count"], want)
    assert cats["idx"] is None and cats["count"] is None


def test_plain_obs_columns_read_as_anndata_reads_them(tmp_path, monkeypatch):
    """Numeric arrays and string categoricals are read with h5py alone (no
    anndata or pandas in Grain workers); codes, dtypes and labels equal what
    the column becomes through `anndata.io.read_elem`, and every other
    encoding is left to it."""
    import h5py

    from grain_cells.io import _frames as frames
    from grain_cells.io import _obs as obs_columns

    n = 300
    rng = np.random.default_rng(0)
    obs = pd.DataFrame(index=[f"c{i}" for i in range(n)])
    obs["small"] = pd.Categorical(rng.choice(["a", "b", "c"], n))
    obs["wide"] = pd.Categorical([f"g{i % 200}" for i in range(n)])  # int16 codes
    obs["missing"] = pd.Categorical(rng.choice(["x", "y", None], n))
    obs["ordered"] = pd.Categorical(
        rng.choice(["lo", "hi"], n), categories=["lo", "hi"], ordered=True
    )
    obs["unicode"] = pd.Categorical(rng.choice(["β-cell", "T cell", ""], n))
    obs["strings"] = rng.choice(["p", "q"], n)  # written as a categorical
    obs["i64"] = np.arange(n, dtype=np.int64)
    obs["f32"] = rng.random(n).astype(np.float32)
    obs["u8"] = (np.arange(n) % 7).astype(np.uint8)
    fallback = {
        "num_cat": pd.Categorical(rng.choice([1, 2, 3], n)),
        "flag": rng.random(n) > 0.5,
        "nullable": pd.array(np.arange(n), dtype="Int64"),
    }
    for name, values in fallback.items():
        obs[name] = values
    path = tmp_path / "obs.h5ad"
    ad.AnnData(sp.csr_matrix((n, 3), dtype=np.float32), obs=obs).write_h5ad(path)

    def through_anndata(f, name):
        raise AssertionError(f"{name} was read through anndata")

    with h5py.File(path) as f:
        for name in obs.columns:
            kind = obs_columns.obs_column_kinds(f, [name])[name]  # metadata alone
            if name in fallback:  # left to anndata's reader
                assert kind is None, name
                continue
            with monkeypatch.context() as m:  # read by the format alone
                m.setattr(obs_columns, "read_obs_values", through_anndata)
                plain = obs_columns.read_obs_column(f, name)
            want = obs_columns._to_column(
                str(path), name, frames.frame_column(f, "obs", name)
            )
            assert plain.values.dtype == want.values.dtype, name
            np.testing.assert_array_equal(plain.values, want.values, err_msg=name)
            if want.categories is None:
                assert plain.categories is None, name
            else:
                assert plain.categories.dtype == want.categories.dtype, name
                assert list(plain.categories) == list(want.categories), name
            assert kind[1] == want.values.dtype, name
            if want.categories is None:
                assert kind[0] is None, name
            else:
                assert kind[0].dtype == want.categories.dtype, name
                assert list(kind[0]) == list(want.categories), name


def test_positional_and_h5py_paths_agree(tmp_path, monkeypatch):
    path = tmp_path / "a.h5ad"
    _write(path, "csr")
    fast = grain_cells.AnnDataSource(path)
    fast.read([0])  # opens the file (lazily) before the patch
    monkeypatch.setattr(hdf5_reads, "byte_layout", lambda ds, path: None)
    slow = grain_cells.AnnDataSource(path)
    assert fast._file(0).reader.direct and not slow._file(0).reader.direct
    rows = np.random.default_rng(4).integers(0, N_OBS, 100)
    np.testing.assert_array_equal(
        fast.read(rows).X.toarray(), slow.read(rows).X.toarray()
    )


def test_multi_chunk_uncompressed_dataset(tmp_path):
    """Ranges that cross HDF5 chunk boundaries read right on the direct path."""
    import h5py

    path = tmp_path / "a.h5ad"
    a = _adata(2000, 60, seed=5)
    a.write_h5ad(path)
    with h5py.File(path, "r+") as f:  # rewrite data/indices with tiny chunks
        for name in ("data", "indices"):
            values = f["X"][name][:]
            del f["X"][name]
            f["X"].create_dataset(name, data=values, chunks=(97,), maxshape=(None,))
    source = grain_cells.AnnDataSource(path, block_size=13)
    reader = source._file(0).reader
    assert reader.direct
    rows = np.random.default_rng(6).permutation(2000)[:700]
    np.testing.assert_array_equal(source.read(rows).X.toarray(), a.X[rows].toarray())


def test_repr_is_stable_and_describes_source(tmp_path):
    path = tmp_path / "a.h5ad"
    _write(path, "csr")
    a = grain_cells.AnnDataSource(path, block_size=8, obs_columns=["idx"])
    b = grain_cells.AnnDataSource(path, block_size=8, obs_columns=["idx"])
    c = grain_cells.AnnDataSource(path, block_size=16, obs_columns=["idx"])
    assert repr(a) == repr(b) != repr(c)
    assert f"{N_OBS} cells" in repr(a) and "block_size=8" in repr(a)


def test_files_is_the_file_set_the_source_reads(tmp_path):
    path = tmp_path / "a.h5ad"
    _write(path, "csr")
    source = grain_cells.AnnDataSource(path, block_size=8, obs_columns=["idx"])
    try:
        files = source.files
        assert isinstance(files, FileSet)
        assert files.paths == source.paths and files.obs_names == ("idx",)
        assert files.num_genes == source.num_genes == N_VARS
        assert files.infos[0] == source.file_info(0)
        with pytest.raises(dataclasses.FrozenInstanceError):
            files.paths = ()
        # A view, and a pickled copy, read the same files.
        view = source.with_blocks([8], [16])
        assert view.files is files
        assert pickle.loads(pickle.dumps(view)).files.paths == files.paths
    finally:
        source.close()


def test_anndata_07_legacy_categoricals(tmp_path):
    """obs written the anndata 0.7 way: codes with a reference to __categories."""
    import h5py

    path = tmp_path / "legacy.h5ad"
    n = 30
    a = _adata(n, 5)
    a.obs = pd.DataFrame(index=a.obs_names)
    a.write_h5ad(path)
    text = h5py.special_dtype(vlen=str)
    with h5py.File(path, "r+") as f:
        del f["obs"]
        obs = f.create_group("obs")
        obs.attrs["_index"] = "_index"
        obs.attrs["column-order"] = np.array(["cell_type", "n"], dtype=object).astype(
            text
        )
        obs.attrs["encoding-type"] = "dataframe"
        obs.attrs["encoding-version"] = "0.1.0"
        obs.create_dataset(
            "_index", data=np.array(a.obs_names, dtype=object), dtype=text
        )
        cats = obs.create_group("__categories").create_dataset(
            "cell_type", data=np.array(["B", "NK", "T"], dtype=object), dtype=text
        )
        codes = obs.create_dataset("cell_type", data=(np.arange(n) % 3).astype(np.int8))
        codes.attrs["categories"] = cats.ref
        obs.create_dataset("n", data=np.arange(n))
    source = grain_cells.AnnDataSource(path, obs_columns=["cell_type", "n"])
    cells = source.read(np.arange(n)[::-1])
    np.testing.assert_array_equal(source.categories["cell_type"], ["B", "NK", "T"])
    np.testing.assert_array_equal(cells.obs["cell_type"], (np.arange(n) % 3)[::-1])
    np.testing.assert_array_equal(cells.obs["n"], np.arange(n)[::-1])


def test_files_with_different_dtypes_share_one_fetch(tmp_path):
    """float32/int32 and float64/int64 files read together, values exact."""
    a = _adata(50, N_VARS, seed=1)
    b = _adata(40, N_VARS, seed=2)
    b.X = b.X.astype(np.float64)
    b.X.indices = b.X.indices.astype(np.int64)
    b.X.indptr = b.X.indptr.astype(np.int64)
    paths = [tmp_path / "a.h5ad", tmp_path / "b.h5ad"]
    a.write_h5ad(paths[0])
    b.write_h5ad(paths[1])
    source = grain_cells.AnnDataSource(paths, block_size=8)
    assert source.dtype == np.float64
    rows = np.r_[45:50, 50:60, 0:3]
    cells = source.read(rows)
    want = sp.vstack([a.X, b.X]).tocsr()[rows].toarray()
    np.testing.assert_array_equal(cells.X.toarray(), want)
