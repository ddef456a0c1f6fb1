"""`preshuffle` carries layers, raw, obsm, varm, varp and uns (`keep=`), and
writes grouped copies (`group_by=`).

Inputs are written by anndata; the value at (global row i, gene j) is
`i * 100 + j + 1` in X, its negative in `layers/counts`, `i * 1000 + j` in
the dense `layers/dense` and `i + k / 10` in `obsm/X_pca[:, k]`; raw has
more genes than var. The oracle is `anndata.read_h5ad` of each part,
compared with `anndata.concat` of the inputs taken in the part's cell order.
"""

from __future__ import annotations

import warnings

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from grain_cells import errors
from grain_cells.preshuffle import preshuffle

SIZES = (83, 64)
N_GENES = 7
N_RAW = 9
LABELS = ["B", "T", "NK", "Mono"]


def layer_names(adata) -> set:
    """Names of the layers (anndata >= 0.13 also lists X under the key None)."""
    return {k for k in adata.layers if k is not None}


def write_inputs(directory) -> list[str]:
    rng = np.random.default_rng(3)
    paths, offset = [], 0
    for f, n in enumerate(SIZES):
        rows = np.arange(offset, offset + n)
        mask = rng.random((n, N_RAW)) < 0.4
        i, j = np.nonzero(mask)
        raw = sp.csr_matrix(
            (((i + offset) * 100 + j + 1).astype(np.float32), (i, j)),
            shape=(n, N_RAW),
        )
        x = raw[:, :N_GENES].tocsr()
        # Labels interleaved within the file: every label in every stretch.
        labels = pd.Categorical(rng.choice(LABELS, n), categories=LABELS)
        obs = pd.DataFrame(
            {"cell_type": labels, "idx": rows},
            index=[f"cell{r}" for r in rows],
        )
        var = pd.DataFrame(
            {"symbol": [f"S{j}" for j in range(N_GENES)]},
            index=[f"g{j}" for j in range(N_GENES)],
        )
        adata = anndata.AnnData(X=x, obs=obs, var=var)
        adata.layers["counts"] = -x
        adata.layers["dense"] = (
            rows[:, None] * 1000 + np.arange(N_GENES)[None, :]
        ).astype(np.float64)
        adata.obsm["X_pca"] = (rows[:, None] + np.arange(3)[None, :] / 10).astype(
            np.float32
        )
        adata.obsm["meta"] = pd.DataFrame({"doubled": rows * 2}, index=adata.obs_names)
        adata.varm["PCs"] = np.arange(N_GENES * 2, dtype=np.float64).reshape(-1, 2)
        adata.uns["title"] = "atlas"
        adata.uns["colors"] = np.array(["red", "blue"], dtype=object)
        raw_adata = anndata.AnnData(
            X=raw, var=pd.DataFrame(index=[f"g{j}" for j in range(N_RAW)])
        )
        raw_adata.obs_names = adata.obs_names
        adata.raw = raw_adata
        adata.obsp["distances"] = sp.eye(n, format="csr")
        path = directory / f"in{f}.h5ad"
        adata.write_h5ad(path)
        paths.append(str(path))
        offset += n
    return paths


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("carry_inputs"))


@pytest.fixture(scope="module")
def whole(inputs):
    adatas = [anndata.read_h5ad(p) for p in inputs]
    merged = anndata.concat(adatas, merge="first")
    raws = anndata.concat([a.raw.to_adata() for a in adatas])
    return merged, raws


def _dense(x):
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def _read_parts(paths):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # anndata's own
        return [anndata.read_h5ad(p) for p in paths]


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="one-part"),
        # Many windows per matrix, two parts.
        pytest.param(
            {"memory_budget_bytes": 2_000, "cells_per_file": 60}, id="windows"
        ),
    ],
)
def test_layers_raw_obsm_var_and_uns_follow_the_cells(inputs, whole, tmp_path, kwargs):
    merged, raws = whole
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parts = preshuffle(inputs, tmp_path / "out", seed=1, progress=False, **kwargs)
    seen = []
    for part in _read_parts(parts):
        rows = merged.obs_names.get_indexer(part.obs_names)
        assert (rows >= 0).all()
        seen.append(rows)
        np.testing.assert_array_equal(part.obs["idx"].to_numpy(), rows)
        want = merged[rows]
        np.testing.assert_array_equal(_dense(part.X), _dense(want.X))
        assert layer_names(part) == {"counts", "dense"}
        np.testing.assert_array_equal(
            _dense(part.layers["counts"]), _dense(want.layers["counts"])
        )
        assert sp.issparse(part.layers["counts"])
        np.testing.assert_array_equal(part.layers["dense"], want.layers["dense"])
        assert set(part.obsm) == {"X_pca", "meta"}
        np.testing.assert_array_equal(part.obsm["X_pca"], want.obsm["X_pca"])
        np.testing.assert_array_equal(part.obsm["meta"]["doubled"].to_numpy(), rows * 2)
        # raw: its own (wider) genes, rows permuted with X.
        assert part.raw is not None and part.raw.shape == (rows.size, N_RAW)
        np.testing.assert_array_equal(_dense(part.raw.X), _dense(raws.X[rows]))
        assert list(part.raw.var_names) == [f"g{j}" for j in range(N_RAW)]
        # var, varm and uns unchanged.
        pd.testing.assert_frame_equal(part.var, merged.var, check_dtype=False)
        assert list(part.var["symbol"]) == [f"S{j}" for j in range(N_GENES)]
        np.testing.assert_array_equal(
            part.varm["PCs"], np.arange(N_GENES * 2).reshape(-1, 2)
        )
        assert part.uns["title"] == "atlas"
        assert list(part.uns["colors"]) == ["red", "blue"]
        assert len(part.obsp) == 0
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(sum(SIZES)))
    # What the default leaves is said once, by name.
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(said) == 1 and "obsp/distances" in said[0], said


def test_keep_names_what_is_carried(inputs, whole, tmp_path):
    merged, _ = whole
    with warnings.catch_warnings():
        # An explicit keep warns of nothing (anndata 0.13's own deprecation
        # noise under pandas 3 aside).
        warnings.simplefilter("error", UserWarning)
        (only,) = preshuffle(
            inputs,
            tmp_path / "a",
            keep=["layers/counts", "obsm/X_pca"],
            progress=False,
        )
        (bare,) = preshuffle(inputs, tmp_path / "b", keep=(), progress=False)
    only, bare = _read_parts([only, bare])
    rows = merged.obs_names.get_indexer(only.obs_names)
    assert layer_names(only) == {"counts"} and set(only.obsm) == {"X_pca"}
    assert only.raw is None and len(only.uns) == 0 and len(only.varm) == 0
    np.testing.assert_array_equal(
        _dense(only.layers["counts"]), _dense(merged.layers["counts"][rows])
    )
    assert not layer_names(bare) and len(bare.obsm) == 0 and bare.raw is None


@pytest.mark.parametrize(
    "keep, error, match",
    [
        pytest.param(
            ["layers/nope"], errors.MissingColumnError, "no layers/nope", id="missing"
        ),
        pytest.param(["bogus"], ValueError, "not an element", id="unknown"),
        pytest.param("layers", TypeError, "keep must be", id="a-string"),
        pytest.param(["obsp"], ValueError, "not an element", id="obsp"),
    ],
)
def test_bad_keep(inputs, tmp_path, keep, error, match):
    with pytest.raises(error, match=match):
        preshuffle(inputs, tmp_path / "out", keep=keep, progress=False)


def test_a_layer_as_x_carries_the_others(inputs, whole, tmp_path):
    merged, _ = whole
    said = r"X \(the output's X is layers/counts\)"
    # Inside: anndata 0.13 reads a pandas option that pandas 3 deprecates.
    with pytest.warns(UserWarning, match=said), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        (part,) = preshuffle(inputs, tmp_path / "out", layer="counts", progress=False)
    (part,) = _read_parts([part])
    rows = merged.obs_names.get_indexer(part.obs_names)
    np.testing.assert_array_equal(_dense(part.X), _dense(merged.layers["counts"][rows]))
    assert layer_names(part) == {"dense"}


def test_group_by_writes_each_label_contiguously_and_shuffled(inputs, whole, tmp_path):
    merged, _ = whole
    parts = preshuffle(
        inputs,
        tmp_path / "out",
        group_by="cell_type",
        keep=(),
        seed=5,
        cells_per_file=50,
        progress=False,
    )
    again = preshuffle(
        inputs,
        tmp_path / "again",
        group_by="cell_type",
        keep=(),
        seed=5,
        cells_per_file=50,
        progress=False,
    )
    cells = pd.concat([p.obs for p in _read_parts(parts)])
    assert list(cells.index) == list(
        pd.concat([p.obs for p in _read_parts(again)]).index
    )
    labels = cells["cell_type"].astype(str).to_numpy()
    # One run per label, in category order; every input cell exactly once.
    changes = np.flatnonzero(labels[1:] != labels[:-1])
    assert list(labels[np.r_[0, changes + 1]]) == [
        c for c in LABELS if c in set(labels)
    ]
    assert sorted(cells["idx"]) == list(range(sum(SIZES)))
    for label in LABELS:  # shuffled within the label, mixing both inputs
        idx = cells["idx"].to_numpy()[labels == label]
        assert not (np.diff(idx) > 0).all()
        assert (idx < SIZES[0]).any() and (idx >= SIZES[0]).any()
    # The X rows are those cells' rows.
    part = _read_parts(parts[:1])[0]
    rows = merged.obs_names.get_indexer(part.obs_names)
    np.testing.assert_array_equal(_dense(part.X), _dense(merged.X[rows]))


def test_group_by_errors(inputs, tmp_path):
    with pytest.raises(errors.MissingColumnError, match=r"group_by=\['donor'\]"):
        preshuffle(inputs, tmp_path / "a", group_by="donor", progress=False)
    with pytest.raises(TypeError, match="group_by must be"):
        preshuffle(inputs, tmp_path / "b", group_by=["cell_type", 2], progress=False)
