"""Files with different genes and obs columns read as one aligned source.

Three files over genes g0..g16, each with its own subset and order of genes.
The value stored at (global row r, gene gk) is `r * 100 + k + 1`, so a value
in the wrong row or column shows up in every comparison. Expected values
come from `anndata.concat` over the same files, never from the generator.
"""

from __future__ import annotations

import pickle

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.errors import GeneMismatchError, MissingColumnError
from grain_cells.io._matrix import RowBuffer

# Per file: cells, var names (in stored order), cell_type categories (in
# order), and obs columns it lacks.
FILES = [
    (40, [f"g{k}" for k in range(12)], ["B", "T", "NK"], ()),
    (
        33,
        [f"g{k}" for k in (15, 3, 1, 12, 0, 7, 9, 5, 13, 2, 4, 6, 8, 10, 11)],
        ["NK", "B", "T"],
        ("donor",),
    ),
    (27, [f"g{k}" for k in (2, 16, 0, 5, 11, 1, 3, 7, 4)], ["T", "DC", "B"], ("age",)),
]
N_CELLS = sum(f[0] for f in FILES)
INNER = ["g0", "g1", "g2", "g3", "g4", "g5", "g7", "g11"]
OUTER = [f"g{k}" for k in range(12)] + ["g15", "g12", "g13", "g16"]


def _adata(f: int, offset: int, dense: bool) -> ad.AnnData:
    n, genes, types, lacks = FILES[f]
    rng = np.random.default_rng(f)
    mask = rng.random((n, len(genes))) < 0.4
    mask[::9] = False  # some empty rows
    i, j = np.nonzero(mask)
    k = np.array([int(g[1:]) for g in genes])[j]
    values = ((i + offset) * 100 + k + 1).astype(np.float32)
    x = sp.csr_matrix((values, (i, j)), shape=(n, len(genes)))
    rows = np.arange(offset, offset + n)
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(
                [types[r % len(types)] for r in rows], categories=types
            ),
            "idx": rows.astype(np.int64),
            "donor": pd.Categorical([f"d{r % 2}" for r in rows]),
            "age": (rows % 7).astype(np.int64),
        },
        index=[f"f{f}-{r}" for r in rows],
    )
    obs = obs.drop(columns=list(lacks))
    return ad.AnnData(
        X=x.toarray() if dense else x, obs=obs, var=pd.DataFrame(index=genes)
    )


def _write(directory, kind: str = "csr") -> list[str]:
    paths, offset = [], 0
    for f in range(len(FILES)):
        paths.append(str(directory / f"{kind}{f}.h5ad"))
        _adata(f, offset, kind == "dense").write_h5ad(paths[-1])
        offset += FILES[f][0]
    return paths


@pytest.fixture(scope="module", params=["csr", "dense"])
def files(request, tmp_path_factory):
    return request.param, _write(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def csr_files(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("csr"))


def _concat(paths, join: str, genes) -> np.ndarray:
    """anndata's concatenation of the files, densified, over `genes`."""
    joined = ad.concat([ad.read_h5ad(p) for p in paths], join=join, fill_value=0)
    x = joined[:, list(genes)].X
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def _dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else x


# -- genes --------------------------------------------------------------------


@pytest.mark.parametrize(
    "join, var_names",
    [
        pytest.param("inner", INNER, id="inner"),
        pytest.param("outer", OUTER, id="outer"),
    ],
)
def test_reads_equal_anndata_concat(files, join, var_names):
    kind, paths = files
    source = grain_cells.AnnDataSource(paths, join=join, block_size=8)
    np.testing.assert_array_equal(source.var_names, var_names)
    assert source.num_genes == len(var_names)
    expected = _concat(paths, join, source.var_names)
    rng = np.random.default_rng(0)
    for rows in (
        np.arange(N_CELLS),
        rng.integers(0, N_CELLS, 80),  # repeats, every file
        np.array([N_CELLS - 1, 0, 45, 45]),
    ):
        cells = source.read(rows)
        np.testing.assert_array_equal(_dense(cells.X), expected[rows])
        assert cells.X.dtype == np.float32
        if kind == "csr":
            assert cells.X.has_sorted_indices
    cells = source.read_ranges([75, 2, 40], [90, 9, 41])
    np.testing.assert_array_equal(_dense(cells.X), expected[np.r_[75:90, 2:9, 40]])
    cells = source.read_blocks([len(source) - 1, 5, 0])
    np.testing.assert_array_equal(_dense(cells.X), expected[cells.row_ids])


@pytest.mark.parametrize("join", ["inner", "outer"])
def test_empty_rows_and_empty_reads(csr_files, join):
    """Rows 0, 9, 18, ... of each file store nothing (also as the last row read)."""
    source = grain_cells.AnnDataSource(csr_files, join=join, genes=INNER[::-1])
    expected = _concat(csr_files, join, INNER[::-1])
    for rows in ([0], [9, 0], [8, 9], [7, 8, 9, 40], [40 + 27], []):
        cells = source.read(np.asarray(rows, np.int64))
        np.testing.assert_array_equal(cells.X.toarray(), expected[rows])


def _densify(batch, n_genes) -> np.ndarray:
    if "X" in batch:
        return batch["X"]
    x = np.zeros((batch["values"].shape[0], n_genes), np.float32)
    rows = np.repeat(np.arange(x.shape[0]), batch["values"].shape[1])
    np.add.at(x, (rows, batch["indices"].ravel()), batch["values"].ravel())
    return x


def _check_loader(source, paths, join, output, worker_count) -> None:
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=1),
        operations=grain_cells.fetch_operations(
            source, batch_size=8, fetch_factor=2, output=output, seed=1
        ),
        worker_count=worker_count,
    )
    expected = _concat(paths, join, source.var_names)
    seen = []
    for batch in loader:
        real = batch["mask"]
        rows = batch["row_ids"][real]
        x = _densify(batch, source.num_genes)
        np.testing.assert_array_equal(x[real], expected[rows])
        np.testing.assert_array_equal(batch["obs/idx"][real], rows)
        seen.append(rows)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(N_CELLS))


@pytest.mark.parametrize(
    "output",
    [
        pytest.param(grain_cells.DenseOutput(), id="dense-output"),
        pytest.param(grain_cells.PaddedSparseOutput(width=20), id="padded-sparse"),
    ],
)
@pytest.mark.parametrize("join", ["inner", "outer"])
def test_loader_outputs_equal_anndata_concat(files, join, output):
    _kind, paths = files
    source = grain_cells.AnnDataSource(
        paths, join=join, block_size=4, obs_columns=["idx"]
    )
    _check_loader(source, paths, join, output, worker_count=0)


@pytest.mark.slow
def test_loader_with_workers_outer_join(csr_files):
    source = grain_cells.AnnDataSource(
        csr_files, join="outer", block_size=4, obs_columns=["idx"]
    )
    _check_loader(source, csr_files, "outer", grain_cells.DenseOutput(), 2)


def test_gene_list_with_genes_missing_from_some_files(files):
    _kind, paths = files
    genes = ["g13", "g0", "g16", "g5", "g12", "g8"]  # g16 only in the last file
    source = grain_cells.AnnDataSource(paths, join="outer", genes=genes)
    np.testing.assert_array_equal(source.var_names, genes)
    assert source.num_genes_stored == len(OUTER)
    expected = _concat(paths, "outer", genes)
    rows = np.random.default_rng(1).permutation(N_CELLS)
    np.testing.assert_array_equal(_dense(source.read(rows).X), expected[rows])
    _check_loader(
        grain_cells.AnnDataSource(
            paths, join="outer", genes=genes, block_size=4, obs_columns=["idx"]
        ),
        paths,
        "outer",
        grain_cells.PaddedSparseOutput(width=6),
        worker_count=0,
    )


@pytest.mark.parametrize(
    "genes",
    [
        pytest.param(np.array([15, 0, 12]), id="positions"),
        pytest.param(np.isin(OUTER, ["g3", "g16"]), id="mask"),
    ],
)
def test_gene_positions_and_masks_index_the_aligned_genes(csr_files, genes):
    source = grain_cells.AnnDataSource(csr_files, join="outer", genes=genes)
    want = np.asarray(OUTER)[genes]
    np.testing.assert_array_equal(source.var_names, want)
    expected = _concat(csr_files, "outer", want)
    np.testing.assert_array_equal(source.read(np.arange(N_CELLS)).X.toarray(), expected)


def test_inner_join_gene_list_names_the_file_that_lacks_a_gene(csr_files):
    source = grain_cells.AnnDataSource(csr_files, join="inner", genes=["g7", "g0"])
    np.testing.assert_array_equal(source.var_names, ["g7", "g0"])
    with pytest.raises(MissingColumnError) as e:
        grain_cells.AnnDataSource(csr_files, join="inner", genes=["g0", "g9"])
    message = str(e.value)
    assert message.startswith(csr_files[2]) and "['g9']" in message
    assert "join='outer'" in message


def test_gene_in_no_file_is_an_error(csr_files):
    with pytest.raises(MissingColumnError, match=r"in no file's var.*\['nope'\]"):
        grain_cells.AnnDataSource(csr_files, join="outer", genes=["g0", "nope"])


def test_exact_join_names_first_differing_genes(csr_files):
    with pytest.raises(GeneMismatchError) as e:
        grain_cells.AnnDataSource(csr_files)
    message = str(e.value)
    assert message.startswith(csr_files[1])
    assert "position 0: 'g0' in " + csr_files[0] in message
    assert "'g15' in " + csr_files[1] in message
    assert "join='inner' or join='outer'" in message
    # A gene list does not relax the exact join.
    with pytest.raises(GeneMismatchError):
        grain_cells.AnnDataSource(csr_files, genes=["g0"])


def test_inner_join_without_common_genes(tmp_path):
    a, b = _adata(0, 0, False), _adata(0, 40, False)
    b.var_names = [f"x{k}" for k in range(b.n_vars)]
    paths = [str(tmp_path / "a.h5ad"), str(tmp_path / "b.h5ad")]
    a.write_h5ad(paths[0])
    b.write_h5ad(paths[1])
    with pytest.raises(GeneMismatchError, match="no gene is in every file") as e:
        grain_cells.AnnDataSource(paths, join="inner")
    assert paths[0] in str(e.value) and paths[1] in str(e.value)
    assert "'x0'" in str(e.value)
    outer = grain_cells.AnnDataSource(paths, join="outer")
    assert outer.num_genes == 2 * a.n_vars


def test_repeated_var_names_refused_when_joining_by_name(tmp_path):
    a = _adata(0, 0, False)
    a.var_names = ["g0"] * 2 + [f"g{k}" for k in range(2, a.n_vars)]
    path = str(tmp_path / "dup.h5ad")
    a.write_h5ad(path)
    with pytest.raises(GeneMismatchError, match=r"not unique.*\['g0'\]") as e:
        grain_cells.AnnDataSource(path, join="outer")
    assert str(e.value).startswith(path)
    assert "genes_from=" in str(e.value)  # the fix: a unique column, not renaming
    assert grain_cells.AnnDataSource(path).num_genes == a.n_vars  # exact: by position


def test_unknown_join():
    with pytest.raises(ValueError, match=r"join=.*'left'"):
        grain_cells.AnnDataSource("unused.h5ad", join="left")


def test_same_genes_need_no_remapping(tmp_path):
    """Files whose genes are the output's are read as stored, for any join."""
    paths = []
    for f in range(2):
        paths.append(str(tmp_path / f"{f}.h5ad"))
        _adata(0, 40 * f, False).write_h5ad(paths[-1])
    for join in ("exact", "inner", "outer"):
        source = grain_cells.AnnDataSource(paths, join=join)
        assert all(source.file_column_map(i) is None for i in range(2))
        buf = RowBuffer()
        fetched = source.fetch_ranges([0, 40], [30, 70], buf)
        stored = buf.get("indices", (1,), fetched.csr.indices.dtype)
        assert np.shares_memory(fetched.csr.indices, stored)
    source = grain_cells.AnnDataSource(paths, join="outer", genes=["g3", "g1"])
    np.testing.assert_array_equal(source.file_column_map(0)[:4], [-1, 1, -1, 0])


def test_repr_changes_with_join_and_genes_and_survives_pickling(csr_files):
    def make(**kwargs):
        return grain_cells.AnnDataSource(csr_files, block_size=8, **kwargs)

    reprs = {
        "inner": repr(make(join="inner")),
        "outer": repr(make(join="outer")),
        "genes": repr(make(join="outer", genes=["g0", "g12"])),
        "order": repr(make(join="outer", genes=["g12", "g0"])),
        "fill": repr(make(join="outer", obs_missing="fill")),
    }
    assert len(set(reprs.values())) == len(reprs)
    source = make(join="outer", genes=["g0", "g12"])
    assert repr(source) == reprs["genes"]
    clone = pickle.loads(pickle.dumps(source))
    assert repr(clone) == repr(source)
    rows = np.arange(0, N_CELLS, 3)
    np.testing.assert_array_equal(
        clone.read(rows).X.toarray(), source.read(rows).X.toarray()
    )


def test_default_repr_names_its_options(tmp_path):
    """A source's repr names its files, options and genes (no checkpoint
    compares it: stamps identify the data by content)."""
    path = tmp_path / "a.h5ad"
    _adata(0, 0, False).write_h5ad(path)
    source = grain_cells.AnnDataSource(path, block_size=8, obs_columns=["idx"])
    assert repr(source) == (
        f"AnnDataSource(files=[{str(path)!r} (40 cells)], layer=None, "
        "block_size=8, obs_columns=['idx'], obs_missing='error', genes=all)"
    )


# -- obs ----------------------------------------------------------------------


def _labels(paths, column) -> np.ndarray:
    return np.concatenate(
        [ad.read_h5ad(p).obs[column].astype(str).to_numpy() for p in paths]
    )


def test_same_category_same_code_in_every_file(csr_files):
    source = grain_cells.AnnDataSource(
        csr_files, join="outer", obs_columns=["cell_type"]
    )
    # The first file's categories in order, then new ones as they appear.
    np.testing.assert_array_equal(
        source.categories["cell_type"], ["B", "T", "NK", "DC"]
    )
    codes = source.read(np.arange(N_CELLS)).obs["cell_type"]
    labels = _labels(csr_files, "cell_type")
    np.testing.assert_array_equal(source.categories["cell_type"][codes], labels)
    for label in ("B", "T", "NK", "DC"):
        assert np.unique(codes[labels == label]).size == 1
    np.testing.assert_array_equal(source.obs_values("cell_type"), codes)


def test_missing_obs_column_is_an_error_by_default(csr_files):
    with pytest.raises(MissingColumnError) as e:
        grain_cells.AnnDataSource(csr_files, join="outer", obs_columns=["donor"])
    message = str(e.value)
    assert message.startswith(csr_files[1])
    assert "['donor']" in message and "obs_missing='fill'" in message


def test_missing_obs_column_filled(files):
    _kind, paths = files
    source = grain_cells.AnnDataSource(
        paths,
        join="outer",
        obs_columns=["donor", "age", "idx"],
        obs_missing="fill",
        block_size=4,
    )
    in_b = np.arange(40, 73)
    in_c = np.arange(73, N_CELLS)
    obs = source.read(np.arange(N_CELLS)).obs
    donor = obs["donor"]
    assert (donor[in_b] == -1).all()
    have = np.setdiff1d(np.arange(N_CELLS), in_b)
    np.testing.assert_array_equal(
        source.categories["donor"][donor[have]], _labels([paths[0], paths[2]], "donor")
    )
    assert source.categories["age"] is None
    assert obs["age"].dtype == np.float64  # int64 with NaN where missing
    assert np.isnan(obs["age"][in_c]).all()
    np.testing.assert_array_equal(obs["age"][:73], np.arange(73) % 7)
    assert obs["idx"].dtype == np.int64  # present everywhere: unchanged
    # The dtype does not depend on which files a read touches.
    assert source.read([0, 1]).obs["age"].dtype == np.float64
    np.testing.assert_array_equal(source.obs_values("donor"), donor)
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=0),
        operations=grain_cells.fetch_operations(source, batch_size=8, fetch_factor=2),
    )
    for batch in loader:
        real = batch["mask"]
        rows = batch["row_ids"][real]
        np.testing.assert_array_equal(batch["obs/donor"][real], donor[rows])
        np.testing.assert_array_equal(batch["obs/age"][real], obs["age"][rows])


def test_obs_column_in_no_file_is_an_error_even_when_filling(csr_files):
    with pytest.raises(MissingColumnError, match="'nope' is in none of the files"):
        grain_cells.AnnDataSource(
            csr_files, join="outer", obs_columns=["nope"], obs_missing="fill"
        )


def test_obs_column_of_two_kinds_names_both_files(tmp_path):
    a, b = _adata(0, 0, False), _adata(0, 40, False)
    b.obs["cell_type"] = np.arange(b.n_obs, dtype=np.float64)
    paths = [str(tmp_path / "a.h5ad"), str(tmp_path / "b.h5ad")]
    a.write_h5ad(paths[0])
    b.write_h5ad(paths[1])
    with pytest.raises(grain_cells.errors.AnnDataFormatError) as e:
        grain_cells.AnnDataSource(paths, obs_columns=["cell_type"])
    message = str(e.value)
    assert f"categorical in {paths[0]}" in message
    assert f"numeric in {paths[1]}" in message


def test_unknown_obs_missing():
    with pytest.raises(ValueError, match=r"obs_missing=.*'zero'"):
        grain_cells.AnnDataSource("unused.h5ad", obs_missing="zero")
