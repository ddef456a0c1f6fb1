"""Several matrices per minibatch (layers, raw/X, obsm) and numeric obs as floats.

Two files written by anndata, where X is the normalised counts, the
`counts` layer the raw counts (both encode row and gene), `raw` holds 15
genes (a superset of X's 12) whose values encode row and gene too, and
`obsm["X_pca"]` is `[n, 5]` with entry (i, k) = i * 10 + k. Every minibatch
is compared with `anndata.read_h5ad` for its `row_ids`.
"""

from __future__ import annotations

import os
import pathlib
import warnings

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells

SIZES = (45, 38)
N_GENES = 12
N_RAW = 15


def _write(directory) -> list[str]:
    rng = np.random.default_rng(1)
    paths, offset = [], 0
    for f, n in enumerate(SIZES):
        rows = np.arange(offset, offset + n)
        mask = rng.random((n, N_RAW)) < 0.4
        raw = (rows[:, None] * 100 + np.arange(N_RAW)[None, :] + 1) * mask
        counts = raw[:, :N_GENES].astype(np.float32)
        totals = np.maximum(counts.sum(1, keepdims=True), 1)
        adata = anndata.AnnData(
            X=sp.csr_matrix((counts / totals).astype(np.float32)),
            obs=pd.DataFrame(
                {
                    "cell_type": pd.Categorical(rng.choice(["B", "T"], n)),
                    "n_counts": counts.sum(1).astype(np.int64),
                    "score": rng.random(n),
                },
                index=[f"c{r}" for r in rows],
            ),
            var=pd.DataFrame(index=[f"g{j}" for j in range(N_GENES)]),
            layers={"counts": sp.csr_matrix(counts)},
            obsm={"X_pca": (rows[:, None] * 10 + np.arange(5)[None, :]).astype(float)},
        )
        adata.raw = anndata.AnnData(
            X=sp.csr_matrix(raw.astype(np.float32)),
            var=pd.DataFrame(index=[f"g{j}" for j in range(N_RAW)]),
        )
        path = str(directory / f"m{f}.h5ad")
        adata.write_h5ad(path)
        paths.append(path)
        offset += n
    return paths


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("matrices"))


@pytest.fixture(scope="module")
def truth(paths):
    adatas = [anndata.read_h5ad(p) for p in paths]
    return {
        "X": np.concatenate([a.X.toarray() for a in adatas]),
        "counts": np.concatenate([a.layers["counts"].toarray() for a in adatas]),
        "raw": np.concatenate([a.raw.X.toarray() for a in adatas]),
        "pca": np.concatenate([a.obsm["X_pca"] for a in adatas]),
        "obs": pd.concat([a.obs for a in adatas]),
    }


def csr_rows(batch, prefix, n_genes):
    indptr = batch[f"{prefix}indptr"]
    return sp.csr_matrix(
        (batch[f"{prefix}data"], batch[f"{prefix}indices"], indptr),
        shape=(indptr.size - 1, n_genes),
    ).toarray()


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_layers_raw_obsm_equal_anndata(paths, truth, helpers, workers):
    source = grain_cells.AnnDataSource(
        paths, block_size=4, obs_columns=["cell_type", "n_counts", "score"]
    )
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=1),
        operations=grain_cells.fetch_operations(
            source,
            batch_size=8,
            fetch_factor=2,
            seed=1,
            extra={
                "counts": grain_cells.Layer("counts", grain_cells.DenseOutput()),
                "raw": grain_cells.Layer("raw"),
                "pca": grain_cells.Obsm("X_pca"),
            },
            numeric_obs="float32",
        ),
        worker_count=workers,
    )
    seen = []
    for batch in helpers.run(loader):
        real = batch["mask"]
        rows = batch["row_ids"][real]
        seen += rows.tolist()
        np.testing.assert_array_equal(
            csr_rows(batch, "", N_GENES)[real], truth["X"][rows]
        )
        np.testing.assert_array_equal(batch["counts/X"][real], truth["counts"][rows])
        assert not batch["counts/X"][~real].any()
        np.testing.assert_array_equal(
            csr_rows(batch, "raw/", N_RAW)[real], truth["raw"][rows]
        )
        np.testing.assert_array_equal(batch["pca"][real], truth["pca"][rows])
        assert batch["pca"].shape == (8, 5) and batch["pca"].dtype == np.float32
        obs = truth["obs"].iloc[rows]
        assert batch["obs/n_counts"].dtype == np.float32
        np.testing.assert_array_equal(batch["obs/n_counts"][real], obs["n_counts"])
        np.testing.assert_allclose(
            batch["obs/score"][real], obs["score"].to_numpy(), rtol=0
        )
        codes = batch["obs/cell_type"][real]
        assert batch["obs/cell_type"].dtype == np.int32
        np.testing.assert_array_equal(
            source.categories["cell_type"][codes], obs["cell_type"].astype(str)
        )
    assert sorted(seen) == list(range(sum(SIZES)))


@pytest.mark.slow  # compiles the token kernels (~6 s)
def test_token_output_for_a_layer(paths, truth, helpers):
    """Tokens from raw counts beside normalised X: any output fits a layer."""
    source = grain_cells.AnnDataSource(paths, block_size=4)
    vocab = grain_cells.tokens.GeneVocabulary.from_genes(source.var_names)
    bins = grain_cells.tokens.ValueBinTokens.for_source(
        source, vocab, length=6, n_bins=5
    )
    ops = grain_cells.fetch_operations(
        source,
        batch_size=8,
        fetch_factor=2,
        extra={"tok": grain_cells.Layer("counts", bins)},
    )
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source)),
        operations=ops,
    )
    batch = helpers.run(loader, 1)[0]
    for i, r in enumerate(batch["row_ids"]):
        x = truth["counts"][r]
        top = sorted(np.flatnonzero(x), key=lambda j: (-x[j], j))[:5]
        expected = [vocab.special("cls")] + [vocab[f"g{j}"] for j in top]
        assert batch["tok/gene_ids"][i][: len(expected)].tolist() == expected


@pytest.mark.parametrize(
    "spec, error, message",
    [
        pytest.param(
            grain_cells.Obsm("X_umap"),
            grain_cells.errors.MissingColumnError,
            r"m0\.h5ad: obsm has no array 'X_umap'; it has \['X_pca'\]",
            id="obsm",
        ),
        pytest.param(
            grain_cells.Layer("spliced"),
            grain_cells.errors.MissingColumnError,
            "spliced",
            id="layer",
        ),
        pytest.param("counts", TypeError, "Layer or grain_cells.Obsm", id="type"),
    ],
)
def test_missing_extra_matrix(paths, spec, error, message):
    source = grain_cells.AnnDataSource(paths, block_size=4)
    with pytest.raises(error, match=message):
        grain_cells.fetch_operations(
            source, batch_size=8, fetch_factor=2, extra={"m": spec}
        )


def test_extra_matrices_through_cell_dataset(paths, truth):
    source = grain_cells.AnnDataSource(paths, block_size=4)
    ds = grain_cells.cell_dataset(
        source,
        batch_size=8,
        fetch_factor=2,
        extra={"pca": grain_cells.Obsm("X_pca"), "counts": grain_cells.Layer("counts")},
    )
    seen = 0
    for batch in ds:
        real = batch["mask"]
        rows = batch["row_ids"][real]
        np.testing.assert_array_equal(batch["pca"][real], truth["pca"][rows])
        np.testing.assert_array_equal(
            csr_rows(batch, "counts/", N_GENES)[real], truth["counts"][rows]
        )
        seen += rows.size
    assert seen == sum(SIZES)


def _legacy_obsm(path, n: int) -> dict[str, np.ndarray]:
    """Replaces `obsm` by one compound dataset, as anndata < 0.7 wrote it.

    Fields `X_pca` (float32, 5 columns, (i, k) = i * 10 + k + 0.5) and
    `X_umap` (float64, 2 columns, (i, k) = -(i * 10 + k)); returns them.
    """
    rows = np.arange(n)[:, None]
    fields = {
        "X_pca": (rows * 10 + np.arange(5) + 0.5).astype(np.float32),
        "X_umap": -(rows * 10 + np.arange(2)).astype(np.float64),
    }
    table = np.empty(n, [(k, v.dtype, (v.shape[1],)) for k, v in fields.items()])
    for k, v in fields.items():
        table[k] = v
    with h5py.File(path, "r+") as f:
        del f["obsm"]
        f.create_dataset("obsm", data=table)
    return fields


def _pbmc68k_reduced() -> str:
    """scanpy's bundled file written by anndata < 0.7 (obsm compound)."""
    pytest.importorskip("scanpy", reason="scanpy is not installed")
    import scanpy.datasets

    folder = pathlib.Path(scanpy.datasets.__file__).parent
    path = folder / "10x_pbmc68k_reduced.h5ad"
    if not path.exists():
        pytest.skip(f"{path} is not bundled with this scanpy")
    return str(path)


def test_compound_obsm_written_by_old_anndata(tmp_path):
    paths = _write(tmp_path)
    truth = [_legacy_obsm(p, n) for p, n in zip(paths, SIZES, strict=True)]
    with h5py.File(paths[0]) as f:
        assert isinstance(f["obsm"], h5py.Dataset) and f["obsm"].dtype.names
    source = grain_cells.AnnDataSource(paths, block_size=4)
    ds = grain_cells.cell_dataset(
        source,
        batch_size=8,
        fetch_factor=2,
        extra={
            "pca": grain_cells.Obsm("X_pca"),
            "umap": grain_cells.Obsm("X_umap", dtype="float64"),
        },
    )
    pca = np.concatenate([t["X_pca"] for t in truth])
    umap = np.concatenate([t["X_umap"] for t in truth])
    seen = 0
    for batch in ds:
        real = batch["mask"]
        rows = batch["row_ids"][real]
        np.testing.assert_array_equal(batch["pca"][real], pca[rows])
        np.testing.assert_array_equal(batch["umap"][real], umap[rows])
        assert batch["umap"].dtype == np.float64 and batch["umap"].shape == (8, 2)
        seen += rows.size
    assert seen == sum(SIZES)
    with pytest.raises(
        grain_cells.errors.MissingColumnError,
        match=r"m0\.h5ad: obsm has no array 'X_tsne'; it has \['X_pca', 'X_umap'\]",
    ):
        grain_cells.fetch_operations(
            source, batch_size=8, extra={"t": grain_cells.Obsm("X_tsne")}
        )


def test_obsm_of_scanpy_pbmc68k_reduced():
    path = _pbmc68k_reduced()
    with warnings.catch_warnings():  # the oracle warns of the old format
        warnings.simplefilter("ignore")
        adata = anndata.read_h5ad(path)
    source = grain_cells.AnnDataSource(path, block_size=16)
    ds = grain_cells.cell_dataset(
        source,
        batch_size=32,
        fetch_factor=4,
        extra={
            "pca": grain_cells.Obsm("X_pca"),
            "umap": grain_cells.Obsm("X_umap", dtype="float64"),
            "raw": grain_cells.Layer("raw", grain_cells.DenseOutput()),
        },
    )
    seen = 0
    for batch in ds:
        real = batch["mask"]
        rows = batch["row_ids"][real]
        np.testing.assert_array_equal(batch["pca"][real], adata.obsm["X_pca"][rows])
        np.testing.assert_array_equal(batch["umap"][real], adata.obsm["X_umap"][rows])
        np.testing.assert_array_equal(batch["raw/X"][real], adata.raw.X[rows].toarray())
        seen += rows.size
    assert seen == adata.n_obs


def _replace_with_other_cells(path: str, tmp_path) -> None:
    """Writes a file of other values over `path` (a new inode, same shape)."""
    other = tmp_path / "other"
    other.mkdir(exist_ok=True)
    adata = anndata.read_h5ad(path)
    adata.layers["counts"] = adata.layers["counts"] * 2
    adata.obsm["X_pca"] = adata.obsm["X_pca"] + 1
    adata.write_h5ad(other / "m.h5ad")
    os.replace(other / "m.h5ad", path)


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(grain_cells.Layer("counts"), id="layer"),
        pytest.param(grain_cells.Obsm("X_pca"), id="obsm"),
    ],
)
def test_file_changed_before_extra_matrices_are_opened(tmp_path, spec):
    """An extra matrix reads the files the source was built on, or refuses."""
    paths = _write(tmp_path)
    source = grain_cells.AnnDataSource(paths, block_size=4)
    _replace_with_other_cells(paths[1], tmp_path)
    with pytest.raises(
        grain_cells.errors.SourceChangedError, match=r"m1\.h5ad: changed since"
    ):
        grain_cells.fetch_operations(
            source, batch_size=8, fetch_factor=2, extra={"m": spec}
        )


def test_file_changed_under_extra_matrix_readers(tmp_path):
    """Readers built on the old file refuse to read the new one."""
    from grain_cells.pipeline._fetch import readers

    paths = _write(tmp_path)
    source = grain_cells.AnnDataSource(paths, block_size=4)
    extra = readers(
        source,
        {"counts": grain_cells.Layer("counts"), "pca": grain_cells.Obsm("X_pca")},
    )
    _replace_with_other_cells(paths[1], tmp_path)
    starts, stops = np.array([0, SIZES[0] + 3]), np.array([2, SIZES[0] + 9])
    with pytest.raises(grain_cells.errors.SourceChangedError, match=r"m1\.h5ad"):
        extra["counts"].fetch(starts, stops, None, 0)
    with pytest.raises(grain_cells.errors.SourceChangedError, match=r"m1\.h5ad"):
        extra["pca"].fetch(starts, stops)


def test_compound_obsm_fields_read_or_refused_by_name(tmp_path):
    """A scalar field reads as one column; a 2-D or text field is refused."""
    paths = _write(tmp_path)[:1]
    n = SIZES[0]
    table = np.empty(n, [("score", "f4"), ("grid", "f4", (2, 3)), ("tag", "S4")])
    table["score"] = np.arange(n) + 0.25
    with h5py.File(paths[0], "r+") as f:
        del f["obsm"]
        f.create_dataset("obsm", data=table)
    source = grain_cells.AnnDataSource(paths, block_size=4)
    ds = grain_cells.cell_dataset(
        source, batch_size=8, fetch_factor=2, extra={"s": grain_cells.Obsm("score")}
    )
    for batch in ds:
        real = batch["mask"]
        assert batch["s"].shape == (8, 1)
        np.testing.assert_array_equal(
            batch["s"][real, 0], batch["row_ids"][real] + 0.25
        )
    for field, found in [("grid", r"shape \(2, 3\)"), ("tag", r"\|S4 values")]:
        with pytest.raises(
            grain_cells.errors.AnnDataFormatError,
            match=rf"m0\.h5ad: obsm is a compound dataset \(anndata < 0\.7\) whose "
            rf"field '{field}' holds .*{found}.*Rewrite the file",
        ):
            grain_cells.fetch_operations(
                source, batch_size=8, extra={"x": grain_cells.Obsm(field)}
            )
