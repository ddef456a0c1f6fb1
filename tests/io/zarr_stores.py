"""Small AnnData zarr stores for tests, written by anndata itself.

Stores are zarr v2 (anndata 0.12's default), v3
(`anndata.settings.zarr_write_format = 3`), v3 sharded (`auto_shard_zarr_v3`)
or a `.zarr.zip`. The value stored at (row i, gene j) is `i * 100 + j + 1`,
so a misplaced value shows; the oracle is `anndata.read_zarr`
(`read_oracle`). Imported by the `tests/io/test_zarr_*.py` modules.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import anndata
import numpy as np
import pandas as pd
import scipy.sparse as sp
import zarr

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


def dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def random_rows(n, seed=0, size=20) -> np.ndarray:
    return np.random.default_rng(seed).choice(n, size=size, replace=False)
