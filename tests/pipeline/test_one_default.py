"""One default for every spelling of the loader (issue 35, item 1).

Given no `block_size` and no `fetch_factor`, the five spellings

* `grain_cells.loader(path, ...)`,
* `grain_cells.loader(AnnDataSource(path), ...)`,
* `grain_cells.DataLoader(..., operations=fetch_operations(source, ...))`,
* the card's `grain.DataLoader(..., operations=fetch_operations(source, ...))`,
* `grain_cells.cell_dataset(source, ...)`,

choose the same blocks (those `AnnDataSource(path)` chooses: 16 cells on an
uncompressed file, along the chunk grid of a compressed one) and the same
fetch (`fetch_factor`, blocks per fetch), and yield every cell once per
epoch, the same minibatches in the same order. `loader(path)` used to take
16-cell blocks on compressed files, half the card's cells/s on an atlas.

Files: a plate-free matrix of `N_OBS` cells where the value at (row i, gene
j) is `i * 100 + j + 1`, written uncompressed, gzip-compressed with small
chunks (`CHUNK` values, about 32 cells) and as a zstd zarr store of the same
chunks; the values of one spelling are checked against anndata's reads.
"""

from __future__ import annotations

import warnings

import anndata
import grain
import h5py
import numpy as np
import pytest
import scipy.sparse as sp
from zarr_copies import write_store

import grain_cells

N_OBS, N_VARS = 6_000, 30
BATCH = 64
CHUNK = 64  # values per chunk of X's data and indices: about 32 cells


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one_default")
    rng = np.random.default_rng(0)
    nnz = rng.integers(0, 5, N_OBS)
    rows = np.repeat(np.arange(N_OBS), nnz)
    cols = np.concatenate([np.sort(rng.choice(N_VARS, k, replace=False)) for k in nnz])
    values = (rows * 100 + cols + 1).astype(np.float32)
    x = sp.csr_matrix((values, (rows, cols)), shape=(N_OBS, N_VARS))
    adata = anndata.AnnData(X=x)
    plain = str(folder / "plain.h5ad")
    adata.write_h5ad(plain)
    gzip = str(folder / "gzip.h5ad")
    adata.write_h5ad(gzip)
    with h5py.File(gzip, "a") as f:  # X again, gzip in small chunks
        del f["X"]
        anndata.io.write_elem(
            f, "X", x, dataset_kwargs={"compression": "gzip", "chunks": (CHUNK,)}
        )
    store = write_store(adata, folder / "store.zarr", "zarr-v3", chunk=CHUNK)
    return {"h5ad": plain, "gzip-h5ad": gzip, "zarr": store}


def _spelled(spelling: str, path: str):
    """(source, fetch config, blocks per fetch, loader) of one spelling."""
    if spelling == "loader(path)":
        loader = grain_cells.loader(path, batch_size=BATCH, seed=0)
        return loader.dataset.source, loader.dataset.split.config, None, loader
    source = grain_cells.AnnDataSource(path)
    if spelling == "loader(source)":
        loader = grain_cells.loader(source, batch_size=BATCH, seed=0)
        return source, loader.dataset.split.config, None, loader
    if spelling == "cell_dataset":
        dataset = grain_cells.cell_dataset(source, batch_size=BATCH, seed=0)
        return source, dataset.split.config, None, dataset
    ops = grain_cells.fetch_operations(source, batch_size=BATCH, seed=0)
    sampler = grain_cells.BlockSampler(len(source), seed=0)
    card = spelling == "grain.DataLoader"
    make = grain.DataLoader if card else grain_cells.DataLoader
    loader = make(data_source=source, sampler=sampler, operations=ops, worker_count=0)
    return source, ops[1].config, ops[0].batch_size, loader


SPELLINGS = [
    "loader(path)",
    "loader(source)",
    "grain_cells.DataLoader",
    "grain.DataLoader",
    "cell_dataset",
]
CASES = [
    pytest.param(kind, spelling, id=f"{kind}-{spelling}")
    for kind in ("h5ad", "gzip-h5ad", "zarr")
    for spelling in SPELLINGS
]


def _rows_of(batches) -> list[np.ndarray]:
    return [np.asarray(b["row_ids"])[np.asarray(b["mask"])] for b in batches]


@pytest.fixture(scope="module")
def expected(files):
    """Per file: what `AnnDataSource(path)` and the card spelling choose."""
    cache = {}

    def of(kind):
        if kind not in cache:
            path = files[kind]
            source = grain_cells.AnnDataSource(path)
            ops = grain_cells.fetch_operations(source, batch_size=BATCH, seed=0)
            sampler = grain_cells.BlockSampler(len(source), seed=0)
            card = grain.DataLoader(data_source=source, sampler=sampler, operations=ops)
            cache[kind] = {
                "block_size": source.block_size,
                "fetch_blocks": source.fetch_blocks,
                "blocks": np.stack(source.block_ranges(np.arange(len(source)))),
                "fetch_factor": ops[1].config.fetch_factor,
                "blocks_per_fetch": ops[1].config.blocks_per_fetch,
                "rows": _rows_of(card),
            }
        return cache[kind]

    return of


def test_the_defaults_are_the_sources(files, expected):
    """Uncompressed: the grid of 16 and fetch factor 16, as ever (golden
    orders and saved states depend on it); compressed: the chunk grid."""
    h5ad, gzip, store = (expected(k) for k in ("h5ad", "gzip-h5ad", "zarr"))
    assert (h5ad["block_size"], h5ad["fetch_blocks"], h5ad["fetch_factor"]) == (
        16,
        None,
        16,
    )
    for chosen in (gzip, store):
        assert chosen["block_size"] > 16 and chosen["fetch_blocks"] == 64
        assert chosen["blocks_per_fetch"] == 64
        assert len(chosen["blocks"][0]) > 64  # more than one fetch per epoch


@pytest.mark.parametrize(("kind", "spelling"), CASES)
def test_every_spelling_chooses_the_same_blocks_and_fetch(
    files, expected, kind, spelling
):
    path, want = files[kind], expected(kind)
    source, config, grouped, loader = _spelled(spelling, path)
    assert source.block_size == want["block_size"]
    assert source.fetch_blocks == want["fetch_blocks"]
    np.testing.assert_array_equal(
        np.stack(source.block_ranges(np.arange(len(source)))), want["blocks"]
    )
    assert config.fetch_factor == want["fetch_factor"]
    assert config.blocks_per_fetch == want["blocks_per_fetch"]
    if grouped is not None:  # the card's Batch groups that many block records
        assert grouped == want["blocks_per_fetch"]
    rows = _rows_of(loader)  # the same minibatches, in the same order
    assert len(rows) == len(want["rows"])
    for a, b in zip(rows, want["rows"], strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.sort(np.concatenate(rows)), np.arange(N_OBS))
    if spelling == "loader(path)":
        _check_values(path, loader)


def _check_values(path: str, loader) -> None:
    """An epoch's minibatches hold anndata's rows of the file."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        read = anndata.read_h5ad if path.endswith(".h5ad") else anndata.read_zarr
        oracle = sp.csr_matrix(read(path).X)
    for batch in loader:
        mask = np.asarray(batch["mask"])
        got = sp.csr_matrix(
            (batch["data"], batch["indices"], batch["indptr"]),
            shape=(mask.size, N_VARS),
        )[mask]
        rows = np.asarray(batch["row_ids"])[mask]
        np.testing.assert_array_equal(got.toarray(), oracle[rows].toarray())
