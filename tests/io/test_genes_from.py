"""Genes aligned on a var column (`genes_from=`), as atlases ship them.

Like CELLxGENE Census 2.4: var names are gene symbols, one of which
(`PINX1`) names two genes, and the var column `feature_id` holds unique
Ensembl ids. The files list different genes in different orders (one a zarr
store, one with its ids as a categorical, as Census writes them). The value
stored at (global row r, gene k) is `r * 100 + k + 1`. Expected values come
from `anndata.concat` over the same files re-indexed on `feature_id`.
"""

from __future__ import annotations

import os
import pickle
import shutil

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.errors import (
    CheckpointMismatchError,
    GeneMismatchError,
    MissingColumnError,
    UnsupportedLayoutError,
)

# Census-shaped var names repeat (PINX1 twice) on purpose. anndata 0.13 warns
# about it from the caller's frame (skip_file_prefixes), so pyproject's
# "ignore::UserWarning:anndata.*" does not reach it there.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Variable names are not unique:UserWarning"
)

SYMBOLS = ["TP53", "EGFR", "MYC", "PINX1", "GAPDH", "CD4", "CD8A", "PINX1"]
IDS = [f"ENSG{k:011d}" for k in range(len(SYMBOLS))]  # gene k: SYMBOLS[k], IDS[k]
# Per file: cells, genes (k, stored order), whether feature_id is categorical,
# the format.
FILES = [
    (30, [0, 1, 2, 3, 4, 5, 7], True, "h5ad"),
    (25, [7, 4, 3, 0, 6, 2], False, "h5ad"),
    (20, [3, 6, 7, 0, 1, 2], True, "zarr"),
]
N_CELLS = sum(f[0] for f in FILES)
INNER = [IDS[k] for k in (0, 2, 3, 7)]
OUTER = [IDS[k] for k in (0, 1, 2, 3, 4, 5, 7, 6)]


def _adata(n, genes, categorical, offset, *, var_names=None) -> ad.AnnData:
    rng = np.random.default_rng(offset)
    mask = rng.random((n, len(genes))) < 0.5
    mask[::7] = False  # some empty rows
    i, j = np.nonzero(mask)
    values = ((i + offset) * 100 + np.asarray(genes)[j] + 1).astype(np.float32)
    x = sp.csr_matrix((values, (i, j)), shape=(n, len(genes)))
    ids = [IDS[k] for k in genes]
    var = pd.DataFrame(
        {
            "feature_id": pd.Categorical(ids) if categorical else ids,
            "feature_name": pd.Categorical([SYMBOLS[k] for k in genes]),
            "entrez": np.asarray(genes, np.int64) + 7000,
            "score": np.asarray(genes, np.float64) / 2,
        },
        index=pd.Index(
            var_names if var_names is not None else [SYMBOLS[k] for k in genes]
        ),
    )
    rows = np.arange(offset, offset + n)
    obs = pd.DataFrame({"idx": rows}, index=[f"c{r}" for r in rows])
    return ad.AnnData(X=x, obs=obs, var=var)


def _write(adata, path: str) -> str:
    if path.endswith(".zarr"):
        adata.write_zarr(path)
    else:
        adata.write_h5ad(path)
    return path


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    directory = tmp_path_factory.mktemp("census")
    out, offset = [], 0
    for f, (n, genes, categorical, kind) in enumerate(FILES):
        adata = _adata(n, genes, categorical, offset)
        out.append(_write(adata, str(directory / f"part{f}.{kind}")))
        offset += n
    return out


def _read(path: str) -> ad.AnnData:
    return ad.read_zarr(path) if path.endswith(".zarr") else ad.read_h5ad(path)


def _concat(paths, join: str, keys) -> np.ndarray:
    """anndata's concatenation re-indexed on feature_id, densified, over `keys`."""
    adatas = []
    for path in paths:
        adata = _read(path)
        del adata.raw  # the tests' raw is X
        adata.var_names = adata.var["feature_id"].astype(str).to_numpy()
        adatas.append(adata)
    joined = ad.concat(adatas, join=join, merge="first", fill_value=0)
    x = joined[:, list(keys)].X
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def _dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else np.asarray(x)


# -- values -------------------------------------------------------------------


@pytest.mark.parametrize(
    "join, keys",
    [
        pytest.param("inner", INNER, id="inner"),
        pytest.param("outer", OUTER, id="outer"),
    ],
)
def test_reads_equal_anndata_concat_on_feature_id(paths, join, keys):
    source = grain_cells.AnnDataSource(
        paths, genes_from="feature_id", join=join, block_size=4
    )
    np.testing.assert_array_equal(source.var_names, keys)
    assert source.genes_from == "feature_id"
    expected = _concat(paths, join, keys)
    rows = np.r_[0:N_CELLS, N_CELLS - 1, 0, 31, 31]
    np.testing.assert_array_equal(_dense(source.read(rows).X), expected[rows])
    cells = source.read_blocks([len(source) - 1, 3, 0])
    np.testing.assert_array_equal(_dense(cells.X), expected[cells.row_ids])


def test_gene_list_of_ensembl_ids_with_outer_join(paths):
    genes = [IDS[7], IDS[6], IDS[3], IDS[1]]  # the two PINX1 genes apart
    source = grain_cells.AnnDataSource(
        paths, genes_from="feature_id", join="outer", genes=genes
    )
    np.testing.assert_array_equal(source.var_names, genes)
    assert source.num_genes_stored == len(OUTER)
    rows = np.arange(N_CELLS)
    np.testing.assert_array_equal(
        _dense(source.read(rows).X), _concat(paths, "outer", genes)
    )


def test_loader_equals_anndata_concat_on_feature_id(paths):
    source = grain_cells.AnnDataSource(
        paths,
        genes_from="feature_id",
        join="outer",
        block_size=4,
        obs_columns=["idx"],
    )
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=1),
        operations=grain_cells.fetch_operations(
            source,
            batch_size=8,
            fetch_factor=2,
            output=grain_cells.DenseOutput(),
            seed=1,
        ),
        worker_count=0,
    )
    expected = _concat(paths, "outer", source.var_names)
    seen = []
    for batch in loader:
        real = batch["mask"]
        rows = batch["row_ids"][real]
        np.testing.assert_array_equal(batch["X"][real], expected[rows])
        np.testing.assert_array_equal(batch["obs/idx"][real], rows)
        seen.append(rows)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(N_CELLS))


def test_loader_in_one_call_passes_genes_from(paths):
    loader = grain_cells.loader(
        paths,
        batch_size=8,
        genes_from="feature_id",
        join="inner",
        obs_columns=["idx"],
        output=grain_cells.DenseOutput(),
        worker_count=0,
        seed=2,
    )
    expected = _concat(paths, "inner", INNER)
    seen = []
    for batch in loader:
        real = batch["mask"]
        rows = batch["row_ids"][real]
        np.testing.assert_array_equal(batch["X"][real], expected[rows])
        seen.append(rows)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(N_CELLS))


def test_exact_join_on_ids_of_files_named_differently(tmp_path):
    """One file's var names are symbols, the other's Ensembl ids: the same genes."""
    genes = [0, 1, 2, 3, 4, 5, 6, 7]
    a = _write(_adata(10, genes, True, 0), str(tmp_path / "symbols.h5ad"))
    b = _write(_adata(12, genes, False, 10, var_names=IDS), str(tmp_path / "ids.zarr"))
    with pytest.raises(GeneMismatchError):
        grain_cells.AnnDataSource([a, b])
    source = grain_cells.AnnDataSource([a, b], genes_from="feature_id")
    np.testing.assert_array_equal(source.var_names, IDS)
    expected = _concat([a, b], "inner", IDS)
    np.testing.assert_array_equal(_dense(source.read(np.arange(22)).X), expected)


def test_raw_beside_x_keys_raw_var_by_the_same_column(tmp_path):
    paths, offset = [], 0
    for f, (n, genes, categorical, _kind) in enumerate(FILES[:2]):
        adata = _adata(n, genes, categorical, offset)
        adata.raw = adata
        paths.append(_write(adata, str(tmp_path / f"raw{f}.h5ad")))
        offset += n
    source = grain_cells.AnnDataSource(
        paths, genes_from="feature_id", join="outer", block_size=4
    )
    ops = grain_cells.fetch_operations(
        source,
        batch_size=8,
        fetch_factor=2,
        seed=1,
        extra={"raw": grain_cells.Layer("raw", grain_cells.DenseOutput())},
    )
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=1),
        operations=ops,
        worker_count=0,
    )
    expected = _concat(paths, "outer", source.var_names)
    for batch in loader:
        real = batch["mask"]
        np.testing.assert_array_equal(
            batch["raw/X"][real], expected[batch["row_ids"][real]]
        )


def test_integer_column_keys_read_as_text(paths):
    source = grain_cells.AnnDataSource(paths, genes_from="entrez", join="inner")
    np.testing.assert_array_equal(source.var_names, ["7000", "7002", "7003", "7007"])


# -- errors -------------------------------------------------------------------


def test_file_without_the_column_names_file_column_and_fix(tmp_path, paths):
    bare = _adata(6, [0, 1, 2], False, 500)
    bare.var = bare.var.drop(columns=["feature_id"])
    path = _write(bare, str(tmp_path / "bare.h5ad"))
    with pytest.raises(MissingColumnError) as e:
        grain_cells.AnnDataSource(
            [paths[0], path], genes_from="feature_id", join="outer"
        )
    message = str(e.value)
    assert path in message and "'feature_id'" in message
    assert "feature_name" in message and "entrez" in message  # what it has
    assert "genes_from" in message


@pytest.mark.parametrize("join", ["exact", "inner", "outer"])
def test_duplicate_keys_name_file_column_values_and_count(paths, join):
    with pytest.raises(GeneMismatchError) as e:
        grain_cells.AnnDataSource(paths, genes_from="feature_name", join=join)
    message = str(e.value)
    assert paths[0] in message and "'feature_name'" in message
    assert "PINX1" in message and "1 value" in message
    assert "Ensembl" in message


def test_genes_named_by_symbol_under_genes_from_point_at_the_keys(paths):
    with pytest.raises(MissingColumnError) as e:
        grain_cells.AnnDataSource(
            paths, genes_from="feature_id", join="outer", genes=["TP53", IDS[2]]
        )
    message = str(e.value)
    assert "['TP53']" in message
    assert "genes_from='feature_id'" in message and IDS[0] in message


def test_missing_keys_are_an_error(tmp_path):
    adata = _adata(6, [0, 1, 2], True, 0)
    adata.var["feature_id"] = pd.Categorical([IDS[0], None, IDS[2]])
    path = _write(adata, str(tmp_path / "gap.h5ad"))
    with pytest.raises(
        GeneMismatchError, match=r"gap\.h5ad.*'feature_id'.*1 .*missing"
    ):
        grain_cells.AnnDataSource(path, genes_from="feature_id")


def test_float_column_is_refused(paths):
    with pytest.raises(UnsupportedLayoutError, match=r"'score'.*float64"):
        grain_cells.AnnDataSource(paths, genes_from="score", join="outer")


def test_bad_genes_from_argument(paths):
    with pytest.raises(TypeError, match="genes_from must be a string or None"):
        grain_cells.AnnDataSource(paths, genes_from=3)


# -- identity -----------------------------------------------------------------


def test_repr_names_the_column_and_survives_pickling(tmp_path):
    """Files whose var names are their ids: the same genes, another configuration."""
    path = _write(
        _adata(10, list(range(8)), True, 0, var_names=IDS), str(tmp_path / "a.h5ad")
    )
    plain = grain_cells.AnnDataSource(path, block_size=4)
    keyed = grain_cells.AnnDataSource(path, block_size=4, genes_from="feature_id")
    np.testing.assert_array_equal(plain.var_names, keyed.var_names)
    assert repr(plain).endswith("genes=all)")
    assert repr(keyed).endswith("genes=all, genes_from='feature_id')")
    clone = pickle.loads(pickle.dumps(keyed))
    assert repr(clone) == repr(keyed) and clone.genes_from == "feature_id"


def test_checkpoint_refused_under_another_alignment(tmp_path):
    path = _write(
        _adata(10, list(range(8)), True, 0, var_names=IDS), str(tmp_path / "a.h5ad")
    )

    def loader(**kwargs):
        source = grain_cells.AnnDataSource(path, block_size=2, **kwargs)
        return grain_cells.DataLoader(
            data_source=source,
            sampler=grain_cells.BlockSampler(source, seed=1),
            operations=grain_cells.fetch_operations(
                source, batch_size=2, fetch_factor=2, seed=1
            ),
            worker_count=0,
        )

    it = iter(loader())
    next(it)
    state = it.get_state()
    iter(loader()).set_state(state)  # the same configuration restores
    with pytest.raises(CheckpointMismatchError, match="genes_from"):
        iter(loader(genes_from="feature_id")).set_state(state)


@pytest.mark.slow
def test_files_in_a_bucket(paths, tmp_path):
    """The same keys and values from s3:// objects (a local S3 server)."""
    pytest.importorskip("obstore", reason="obstore is not installed")
    from grain_cells.testing import ServedFolder

    (tmp_path / "cells").mkdir()
    urls = []
    for path in paths:
        name = os.path.basename(path)
        copy = shutil.copytree if os.path.isdir(path) else shutil.copyfile
        copy(path, tmp_path / "cells" / name)
        urls.append(f"s3://cells/{name}")
    local = grain_cells.AnnDataSource(paths, genes_from="feature_id", join="outer")
    try:
        stack = ServedFolder(tmp_path, rtt_s=0).start()
    except RuntimeError as e:
        pytest.skip(f"cannot start the local S3 server on loopback: {e}")
    try:
        remote = grain_cells.AnnDataSource(
            urls,
            genes_from="feature_id",
            join="outer",
            storage_options=stack.storage_options(),
        )
        np.testing.assert_array_equal(remote.var_names, OUTER)
        rows = np.arange(N_CELLS)
        np.testing.assert_array_equal(
            _dense(remote.read(rows).X), _dense(local.read(rows).X)
        )
    finally:
        stack.stop()


def test_files_of_one_gene_list_share_one_array_while_built(tmp_path, monkeypatch):
    """Issue 33's collections of 10^5 files: one gene list held, not one per file."""
    from grain_cells.io import _file_set

    adata = _adata(6, [0, 1, 2, 3, 4, 5, 6, 7], True, 0)
    paths = [_write(adata, str(tmp_path / f"same{i}.h5ad")) for i in range(3)]
    paths.append(_write(_adata(6, [1, 0, 2], True, 6), str(tmp_path / "other.h5ad")))
    seen = []

    def align(paths, names, *args):
        seen.extend(names)
        return align_genes(paths, names, *args)

    align_genes = _file_set.align_genes
    monkeypatch.setattr(_file_set, "align_genes", align)
    grain_cells.AnnDataSource(paths, genes_from="feature_id", join="outer")
    assert seen[0] is seen[1] is seen[2]
    assert seen[3] is not seen[0]
    np.testing.assert_array_equal(seen[3], [IDS[1], IDS[0], IDS[2]])
