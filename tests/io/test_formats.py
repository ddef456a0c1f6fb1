"""Files of every layout open and read exactly; no input yields wrong values.

Values encode their position: the value stored at (row i, gene j) is
`i * 100 + j + 1`, so any misplaced, shifted, dropped or doubled value shows
up. The oracle is `anndata.read_h5ad` wherever anndata reads the layout.
This module covers what is *in* a file (dtypes, encodings, legacy layouts);
`test_formats_storage.py` covers how HDF5 stores it (user blocks, links,
virtual datasets, filters, locks).
"""

from __future__ import annotations

import importlib.util
import os
import re
import warnings

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells import AnnDataSource, CsrOutput, DenseOutput, PaddedSparseOutput
from grain_cells.errors import AnnDataFormatError, UnsupportedLayoutError

N_OBS, N_VARS = 23, 7


def value_matrix(n_obs=N_OBS, n_vars=N_VARS, seed=0) -> sp.csr_matrix:
    """CSR with value `i * 100 + j + 1` at (i, j), about half the entries."""
    rng = np.random.default_rng(seed)
    mask = rng.random((n_obs, n_vars)) < 0.5
    mask[::5] = False  # some empty rows
    i, j = np.nonzero(mask)
    x = sp.csr_matrix(
        ((i * 100 + j + 1).astype(np.float32), (i, j)), shape=(n_obs, n_vars)
    )
    x.sort_indices()
    return x


def make_adata(x=None, **obs) -> anndata.AnnData:
    x = value_matrix() if x is None else x
    n_obs, n_vars = x.shape
    return anndata.AnnData(
        X=x,
        obs=pd.DataFrame(obs, index=[f"cell{i}" for i in range(n_obs)]),
        var=pd.DataFrame(index=[f"g{j}" for j in range(n_vars)]),
    )


def as_dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def oracle(path, layer=None) -> anndata.AnnData:
    """The file as anndata reads it (legacy-format warnings silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adata = anndata.read_h5ad(path)
    if layer == "raw":
        return adata.raw.to_adata()
    return adata


def loader_outputs(source, output, worker_count=0) -> tuple[np.ndarray, dict]:
    """Every cell through a shuffled loader: dense X by row id, and obs batches."""
    sampler = grain_cells.BlockSampler(len(source), seed=3, num_epochs=1)
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=grain_cells.fetch_operations(
            source, batch_size=4, fetch_factor=2, output=output, seed=3
        ),
        worker_count=worker_count,
    )
    dense = np.full((source.num_cells, source.num_genes), np.nan)
    obs: dict[str, list] = {}
    iterator = iter(loader)
    try:
        for batch in iterator:
            batch = {k: np.array(v) for k, v in batch.items()}
            keep = batch["mask"]
            rows = batch["row_ids"][keep]
            dense[rows] = batch_dense(batch, output, source.num_genes)[keep]
            for k, v in batch.items():
                if k.startswith("obs/"):
                    obs.setdefault(k[4:], []).append((rows, v[keep], v.dtype))
    finally:
        iterator.close()
    assert not np.isnan(dense).any(), "some cells never came out"
    return dense, obs


def batch_dense(batch, output, n_genes) -> np.ndarray:
    m = batch["mask"].size
    if isinstance(output, DenseOutput):
        return batch["X"].astype(np.float64)
    out = np.zeros((m, n_genes))
    if isinstance(output, CsrOutput):
        rows = np.repeat(np.arange(m), np.diff(batch["indptr"]))
        np.add.at(out, (rows, batch["indices"]), batch["data"])
        return out
    rows = np.repeat(np.arange(m), output.width).reshape(m, output.width)
    np.add.at(out, (rows, batch["indices"]), batch["values"])  # as densify
    return out


OUTPUTS = [
    pytest.param(CsrOutput(), id="csr"),
    pytest.param(PaddedSparseOutput(width=N_VARS + 2), id="padded"),
    pytest.param(DenseOutput(), id="dense"),
]


def assert_every_format(path, expected, **kwargs):
    """read() and every output format give `expected` (dense, by row)."""
    source = AnnDataSource(path, block_size=4, **kwargs)
    rows = np.arange(source.num_cells)[::-1]
    got = source.read(rows).X
    np.testing.assert_array_equal(as_dense(got), expected[rows])
    for output in (CsrOutput(), PaddedSparseOutput(width=N_VARS + 2), DenseOutput()):
        dense, _ = loader_outputs(source, output)
        np.testing.assert_array_equal(dense, expected, err_msg=repr(output))
    return source


# -- 1: obs columns keep their dtype ------------------------------------------------


@pytest.mark.parametrize(
    "worker_count",
    [0, pytest.param(2, marks=pytest.mark.slow)],  # workers start
)
def test_obs_dtypes_survive_minibatches(tmp_path, worker_count):
    path = tmp_path / "x.h5ad"
    i = np.arange(N_OBS)
    make_adata(
        big=(3_000_000_285 + i).astype(np.int64),  # does not fit int32
        u16=(65_000 + i).astype(np.uint16),
        i8=(i - 10).astype(np.int8),
        f32=(i / 3).astype(np.float32),
        f64=i * 1e300,
        label=pd.Categorical([f"c{k % 3}" for k in i]),
        flag=i % 2 == 0,
    ).write_h5ad(path)
    columns = ["big", "u16", "i8", "f32", "f64", "label", "flag"]
    source = AnnDataSource(path, block_size=4, obs_columns=columns)
    _, obs = loader_outputs(source, CsrOutput(), worker_count)
    truth = oracle(path).obs
    expected_dtypes = {
        "big": np.int64,
        "u16": np.uint16,
        "i8": np.int8,
        "f32": np.float32,
        "f64": np.float64,
        "label": np.int32,  # codes
        "flag": np.int32,  # codes into [False, True]
    }
    for column, parts in obs.items():
        for rows, values, dtype in parts:
            assert dtype == expected_dtypes[column], column
            cats = source.categories[column]
            got = values if cats is None else cats[values]
            np.testing.assert_array_equal(
                got, truth[column].to_numpy()[rows], err_msg=column
            )
    cells = source.read([N_OBS - 1])
    assert cells.obs["big"].dtype == np.int64
    assert int(cells.obs["big"][0]) == 3_000_000_285 + N_OBS - 1


# -- 6: a duplicate column index within a row means the sum --------------------------


def test_duplicate_column_indices_sum_everywhere(tmp_path):
    x = value_matrix()
    # Row 1 stores gene 2 twice and gene 4 three times; anndata writes it as is.
    rows = [x[r] for r in range(N_OBS)]
    data = np.concatenate([r.data for r in rows[:1]] + [[5.0, 7.0, 1.0, 2.0, 4.0]])
    indices = np.concatenate([r.indices for r in rows[:1]] + [[2, 4, 2, 4, 4]])
    data = np.concatenate([data, *(r.data for r in rows[2:])]).astype(np.float32)
    indices = np.concatenate([indices, *(r.indices for r in rows[2:])])
    lengths = [rows[0].nnz, 5, *(r.nnz for r in rows[2:])]
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    dup = sp.csr_matrix((data, indices, indptr), shape=x.shape)
    assert not dup.has_canonical_format
    path = tmp_path / "dup.h5ad"
    make_adata(dup).write_h5ad(path)
    expected = as_dense(oracle(path).X)
    assert expected[1, 2] == 6.0 and expected[1, 4] == 13.0  # anndata sums
    source = assert_every_format(path, expected)
    # densify (on the accelerator) adds a padded row's duplicates too.
    op = grain_cells.fetch_operations(
        source,
        batch_size=4,
        fetch_factor=1,
        shuffle=False,
        output=PaddedSparseOutput(8),
    )[-1]
    batch = op.flat_map(np.asarray([source[0]]))[0]
    np.testing.assert_array_equal(batch["row_ids"], np.arange(4))
    dense = grain_cells.densify(batch["values"], batch["indices"], N_VARS)
    np.testing.assert_array_equal(np.asarray(dense), expected[:4])


# -- 9: ambiguous gene names ----------------------------------------------------------


def test_genes_naming_a_repeated_var_name_is_refused(tmp_path):
    path = tmp_path / "x.h5ad"
    adata = make_adata()
    adata.var_names = ["a", "b", "a", "c", "d", "c", "a"]
    adata.write_h5ad(path)
    with pytest.raises(ValueError, match=re.escape(str(path))) as e:
        AnnDataSource(path, genes=["b", "a"])
    assert "'a' at positions [0, 2, 6]" in str(e.value)
    source = AnnDataSource(path, genes=["d", "b"])  # unique names still work
    np.testing.assert_array_equal(
        as_dense(source.read(np.arange(N_OBS)).X), value_matrix().toarray()[:, [4, 1]]
    )


# -- files of anndata >= 0.11 (nullable strings, the default under pandas 3) ---------


def write_nullable_strings(path):
    """A file whose index and string columns are nullable-string-array groups."""
    adata = make_adata(
        donor=pd.array(
            [f"d{i % 4}" if i % 7 else None for i in range(N_OBS)], "string"
        ),
    )
    adata.obs_names = pd.Index(adata.obs_names, dtype="string")
    adata.var_names = pd.Index(adata.var_names, dtype="string")
    settings = anndata.settings
    if hasattr(settings, "allow_write_nullable_strings"):  # anndata < 0.13: opt in
        with settings.override(allow_write_nullable_strings=True):
            adata.write_h5ad(path)
    else:
        adata.write_h5ad(path)
    with h5py.File(path) as f:
        assert f["obs/_index"].attrs["encoding-type"] == "nullable-string-array"
        assert f["var/_index"].attrs["encoding-type"] == "nullable-string-array"


def test_nullable_string_index_and_columns(tmp_path):
    path = tmp_path / "s.h5ad"
    write_nullable_strings(path)
    source = assert_every_format(path, value_matrix().toarray(), obs_columns=["donor"])
    truth = oracle(path)
    np.testing.assert_array_equal(source.var_names, truth.var_names.to_numpy(str))
    codes = source.read(np.arange(N_OBS)).obs["donor"]
    labels = np.array(
        [source.categories["donor"][c] if c >= 0 else None for c in codes]
    )
    expected = truth.obs["donor"].to_numpy(dtype=object)
    expected[pd.isna(expected)] = None
    np.testing.assert_array_equal(labels, expected)


# -- files of anndata < 0.7 ------------------------------------------------------------


def write_legacy(path):
    """The anndata < 0.7 layout (as scanpy's pbmc68k_reduced), written by h5py.

    X dense; obs and var compound datasets whose first field is the index;
    categorical obs as int8 codes with labels in `uns/<col>_categories`;
    raw as `raw.X` (an `h5sparse_format` csr group) and `raw.var`.
    """
    x = value_matrix()
    raw = value_matrix(seed=1).multiply(10).tocsr().astype(np.float32)
    rng = np.random.default_rng(0)
    obs = np.zeros(
        N_OBS,
        [("index", "S8"), ("louvain", "i1"), ("n_genes", "<i8"), ("pm", "<f4")],
    )
    obs["index"] = [f"cell{i}".encode() for i in range(N_OBS)]
    obs["louvain"] = rng.integers(0, 3, N_OBS)
    obs["n_genes"] = 3_000_000_000 + np.arange(N_OBS)
    obs["pm"] = np.arange(N_OBS) / 8
    var = np.zeros(N_VARS, [("index", "S4"), ("means", "<f4")])
    var["index"] = [f"g{j}".encode() for j in range(N_VARS)]
    with h5py.File(path, "w") as f:
        f["X"] = x.toarray()
        f["obs"] = obs
        f["var"] = var
        f["raw.var"] = np.array(var["index"], dtype=[("index", "S4")])
        g = f.create_group("raw.X")
        g.attrs["h5sparse_format"] = "csr"
        g.attrs["h5sparse_shape"] = np.array(raw.shape)
        g["data"], g["indices"], g["indptr"] = raw.data, raw.indices, raw.indptr
        f["uns/louvain_categories"] = np.array([b"T", b"B", b"NK"])
    return x.toarray(), raw.toarray()


def assert_legacy_file_reads(path, x, raw):
    truth = oracle(path)
    columns = list(truth.obs.columns)
    source = assert_every_format(path, as_dense(truth.X), obs_columns=columns)
    np.testing.assert_array_equal(as_dense(truth.X), x)
    np.testing.assert_array_equal(source.var_names, truth.var_names.to_numpy(str))
    cells = source.read(np.arange(truth.n_obs))
    for column in columns:
        expected = truth.obs[column]
        cats = source.categories[column]
        if isinstance(expected.dtype, pd.CategoricalDtype):
            np.testing.assert_array_equal(cats, expected.cat.categories.to_numpy())
            np.testing.assert_array_equal(cells.obs[column], expected.cat.codes)
        else:
            assert cats is None
            np.testing.assert_array_equal(cells.obs[column], expected.to_numpy())
            assert cells.obs[column].dtype == expected.dtype
    raw_truth = oracle(path, layer="raw")
    np.testing.assert_array_equal(as_dense(raw_truth.X), raw)
    raw_source = assert_every_format(path, raw, layer="raw")
    np.testing.assert_array_equal(
        raw_source.var_names, raw_truth.var_names.to_numpy(str)
    )


def test_anndata_pre_0_7_layout(tmp_path):
    path = tmp_path / "legacy.h5ad"
    x, raw = write_legacy(path)
    assert_legacy_file_reads(path, x, raw)
    source = AnnDataSource(path, obs_columns=["louvain"])
    assert source.categories["louvain"].tolist() == ["T", "B", "NK"]


def test_scanpy_bundled_pbmc68k_reduced():
    """scanpy <= 1.11 bundles it in the anndata < 0.7 layout, 1.12 re-saved it."""
    spec = importlib.util.find_spec("scanpy")
    if spec is None:
        pytest.skip("scanpy is not installed: its bundled pbmc68k_reduced is untested")
    path = os.path.join(
        spec.submodule_search_locations[0], "datasets", "10x_pbmc68k_reduced.h5ad"
    )
    truth = oracle(path)
    columns = ["bulk_labels", "n_genes", "percent_mito", "phase", "louvain"]
    source = AnnDataSource(path, block_size=16, obs_columns=columns)
    rows = np.arange(truth.n_obs)[::-3]
    cells = source.read(rows)
    np.testing.assert_array_equal(cells.X, as_dense(truth.X)[rows])
    for column in columns:
        expected = truth.obs[column].to_numpy()[rows]
        cats = source.categories[column]
        got = cells.obs[column] if cats is None else cats[cells.obs[column]]
        np.testing.assert_array_equal(got, expected, err_msg=column)
    raw = AnnDataSource(path, layer="raw").read(rows).X
    np.testing.assert_array_equal(raw.toarray(), truth.raw.X[rows].toarray())


# -- hand-rolled writers ------------------------------------------------------------


def test_categorical_group_without_encoding_attributes(tmp_path):
    path = tmp_path / "x.h5ad"
    codes = np.arange(N_OBS) % 3 - (np.arange(N_OBS) == 4)  # row 4: missing (-1)
    make_adata(kind=pd.Categorical.from_codes(codes, ["x", "y", "z"])).write_h5ad(path)
    with h5py.File(path, "r+") as f:
        for key in list(f["obs/kind"].attrs):
            del f["obs/kind"].attrs[key]
    source = AnnDataSource(path, obs_columns=["kind"])
    assert source.categories["kind"].tolist() == ["x", "y", "z"]
    np.testing.assert_array_equal(source.read(np.arange(N_OBS)).obs["kind"], codes)


# -- values stored big-endian or as float16 -------------------------------------------


@pytest.mark.parametrize(
    "dtypes",
    [
        pytest.param(
            {"data": ">f4", "indices": ">i4", "indptr": ">i8"}, id="big-endian"
        ),
        pytest.param({"data": "<f2"}, id="float16"),
        pytest.param({"data": ">f2"}, id="float16-big-endian"),
        pytest.param({"data": ">i2"}, id="int16-big-endian"),
    ],
)
@pytest.mark.parametrize("layout", ["csr", "dense"])
def test_byte_order_and_half_precision(tmp_path, dtypes, layout):
    x = value_matrix(n_obs=N_OBS, n_vars=N_VARS)
    x.data = x.data / 100 if dtypes["data"].endswith("f2") else x.data
    path = tmp_path / "x.h5ad"
    make_adata(x if layout == "csr" else x.toarray()).write_h5ad(path)
    with h5py.File(path, "r+") as f:
        names = dtypes if layout == "csr" else {"": dtypes["data"]}
        for name, dtype in names.items():
            key = f"X/{name}" if name else "X"
            values = f[key][()]
            del f[key]
            f.create_dataset(key, data=values.astype(dtype), chunks=True)
    with h5py.File(path) as f:  # the values as stored, through h5py
        stored = f["X/data" if layout == "csr" else "X"][()].astype(np.float64)
    if layout == "csr":
        expected = sp.csr_matrix((stored, x.indices, x.indptr), x.shape).toarray()
    else:
        expected = stored
    source = assert_every_format(path, expected)
    assert source.dtype.isnative
    assert source.dtype == (np.float32 if "f" in dtypes["data"] else np.int16)


# -- MuData ---------------------------------------------------------------------------


def test_h5mu_is_refused_naming_its_modalities(tmp_path):
    path = tmp_path / "x.h5mu"
    with h5py.File(path, "w", userblock_size=512) as f:  # as mudata writes it
        f.attrs["encoding-type"] = "MuData"
        f.attrs["encoding-version"] = "0.1.0"
        anndata.io.write_elem(f, "obs", pd.DataFrame(index=[f"c{i}" for i in range(5)]))
        anndata.io.write_elem(f, "var", pd.DataFrame(index=["g0", "p0"]))
        mod = f.create_group("mod")
        anndata.io.write_elem(mod, "rna", make_adata(value_matrix(5, 1)))
        anndata.io.write_elem(mod, "prot", make_adata(value_matrix(5, 1)))
    with pytest.raises(UnsupportedLayoutError, match=re.escape(str(path))) as e:
        AnnDataSource(path)
    message = str(e.value)
    assert "MuData" in message and "['prot', 'rna']" in message
    assert "read_elem(f['mod/prot'])" in message


def test_errors_subclass_the_format_error():
    assert issubclass(UnsupportedLayoutError, AnnDataFormatError)
