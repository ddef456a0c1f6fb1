"""Zarr stores through the loaders: the same minibatches as the `.h5ad` files.

The conftest files (value at (row i, gene j) = i * 100 + j + 1, obs `idx` =
i) are copied by anndata into each zarr layout (`tests/zarr_copies.py`: v2,
v3, v3 sharded, `.zarr.zip`; chunks of 16 values, so each store spans
several chunks and shards). A loader over the copies must give, minibatch
for minibatch, the arrays the same loader gives over the `.h5ad` originals
(which the rest of the suite checks against `anndata.read_h5ad`), and its
values must equal `anndata.read_zarr(store)[rows]`: in CSR, padded, dense and
token outputs, with extra matrices, with 0 and 2 workers.
"""

from __future__ import annotations

import pathlib

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import zarr
from absl import flags
from zarr_copies import LAYOUTS, Truth, copy_as, layout_params, write_store

import grain_cells
import grain_cells.tokens

CONFIG = {"block_size": 5, "batch_size": 4, "fetch_factor": 5, "seed": 3}


@pytest.fixture(scope="module")
def stores(csr_paths, tmp_path_factory):
    """`stores(layout)`: zarr copies of the conftest files, made once."""
    made = {}

    def get(layout, paths=csr_paths, name="csr"):
        if (layout, name) not in made:
            folder = tmp_path_factory.mktemp(f"{name}-{layout}")
            made[layout, name] = copy_as(paths, folder, layout)
        return made[layout, name]

    return get


@pytest.fixture(scope="module")
def h5ad_epoch(csr_paths, helpers):
    """One epoch over the `.h5ad` originals, 0 workers."""
    return helpers.run(helpers.build(csr_paths, **CONFIG)[2])


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys(), i
        for key in b:
            assert a[key].dtype == b[key].dtype, (i, key)
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{i} {key}")


def csr_dense(batch, width, prefix=""):
    indptr = batch[f"{prefix}indptr"]
    return sp.csr_matrix(
        (batch[f"{prefix}data"], batch[f"{prefix}indices"], indptr),
        shape=(indptr.size - 1, width),
    ).toarray()


def assert_equals_anndata(batches, paths, helpers):
    """Every real row's X and `obs/idx` equal `anndata.read_zarr`; each row once."""
    truth = Truth(paths)
    seen = []
    for b in batches:
        real = b["mask"]
        rows = b["row_ids"][real]
        np.testing.assert_array_equal(
            csr_dense(b, helpers.N_GENES)[real], truth.matrix(rows)
        )
        np.testing.assert_array_equal(b["obs/idx"][real], truth.obs(rows, "idx"))
        seen.append(rows)
    assert np.sort(np.concatenate(seen)).tolist() == list(range(helpers.N_CELLS))


@pytest.mark.parametrize("layout", layout_params(*LAYOUTS))
def test_csr_minibatches_equal_h5ad_and_anndata(stores, layout, h5ad_epoch, helpers):
    paths = stores(layout)
    got = helpers.run(helpers.build(paths, **CONFIG)[2])
    assert_equals_anndata(got, paths, helpers)
    assert_same_batches(got, h5ad_epoch)


@pytest.mark.slow  # starts two workers (~10 s on 2 busy cores)
@pytest.mark.parametrize("layout", layout_params("zarr-v3-sharded"))
def test_two_workers_give_the_same_minibatches(stores, layout, h5ad_epoch, helpers):
    flags.FLAGS.mark_as_parsed()
    got = helpers.run(helpers.build(stores(layout), worker_count=2, **CONFIG)[2])
    assert_same_batches(got, h5ad_epoch)


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
def test_mixed_list_of_h5ad_and_zarr(stores, csr_paths, h5ad_epoch, helpers):
    """One file of each kind in one source: the same cells, genes and codes."""
    mixed = [csr_paths[0], stores("zarr-v2")[1], stores("zarr-zip")[2]]
    got = helpers.run(helpers.build(mixed, **CONFIG)[2])
    assert_same_batches(got, h5ad_epoch)


def _codecs(name):
    import numcodecs
    import zarr.codecs as zc

    return {
        "v2-gzip": ("zarr-v2", {"compressors": numcodecs.GZip(5)}),
        "v2-blosc-zstd": (
            "zarr-v2",
            {"compressors": numcodecs.Blosc("zstd", 3, numcodecs.Blosc.BITSHUFFLE)},
        ),
        "v3-gzip": ("zarr-v3", {"compressors": zc.GzipCodec(level=5)}),
        "v3-blosc-lz4": ("zarr-v3", {"compressors": zc.BloscCodec(cname="lz4")}),
        "v3-sharded-zstd-crc32c": (
            "zarr-v3-sharded",
            {"compressors": [zc.ZstdCodec(level=3), zc.Crc32cCodec()]},
        ),
        "v3-uncompressed": ("zarr-v3", {"compressors": None}),
        # Read by byte range (zarr/_reads.py, RangeReader._read_raw), not whole chunks.
        "v2-uncompressed": ("zarr-v2", {"compressors": None}),
        "v3-sharded-uncompressed": ("zarr-v3-sharded", {"compressors": None}),
    }[name]


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
@pytest.mark.parametrize(
    "codec",
    layout_params(
        "v3-sharded-zstd-crc32c",
        "v2-gzip",
        "v2-blosc-zstd",
        "v3-gzip",
        "v3-blosc-lz4",
        "v3-uncompressed",
        "v2-uncompressed",
        "v3-sharded-uncompressed",
    ),
)
def test_codecs_through_the_loader(csr_paths, tmp_path, h5ad_epoch, helpers, codec):
    layout, codecs = _codecs(codec)
    paths = copy_as(csr_paths, tmp_path, layout, **codecs)
    meta = str(zarr.open_group(paths[0], mode="r")["X/data"].metadata).lower()
    for name in ("gzip", "zstd", "lz4", "crc32c", "blosc"):
        if name == "crc32c" and "sharded" in codec:
            continue  # a shard's index carries its own crc32c
        assert (name in meta) == (name in codec), name  # the codecs asked for
    got = helpers.run(helpers.build(paths, **CONFIG)[2])
    assert_equals_anndata(got, paths, helpers)
    assert_same_batches(got, h5ad_epoch)
    if codec == "v3-sharded-uncompressed":  # byte-range reads in workers too
        flags.FLAGS.mark_as_parsed()
        got = helpers.run(helpers.build(paths, worker_count=2, **CONFIG)[2])
        assert_same_batches(got, h5ad_epoch)


def _token_outputs(source):
    vocab = grain_cells.tokens.GeneVocabulary.from_genes(source.var_names[::-1])
    stats = grain_cells.tokens.corpus_stats(
        source, method="exact", cache=False, progress=False
    )
    return {
        "rank-value": grain_cells.tokens.RankValueTokens.for_source(
            source, vocab, stats, length=8, kernels="numpy"
        ),
        "value-bins": grain_cells.tokens.ValueBinTokens.for_source(
            source, vocab, length=8, n_bins=5, selection="random", kernels="numpy"
        ),
    }


OUTPUTS = {
    "padded": lambda source: grain_cells.PaddedSparseOutput(8),
    "dense": lambda source: grain_cells.DenseOutput(),
    "rank-value": lambda source: _token_outputs(source)["rank-value"],
    "value-bins": lambda source: _token_outputs(source)["value-bins"],
}


def _loader_epoch(paths, output, helpers, workers=0):
    source = grain_cells.AnnDataSource(
        paths, block_size=CONFIG["block_size"], obs_columns=["plate", "idx"]
    )
    loader = grain_cells.loader(
        source,
        batch_size=CONFIG["batch_size"],
        fetch_factor=CONFIG["fetch_factor"],
        seed=CONFIG["seed"],
        output=OUTPUTS[output](source),
        worker_count=workers,
    )
    return helpers.run(loader)


@pytest.mark.parametrize("output", list(OUTPUTS))
def test_outputs_equal_h5ad(stores, csr_paths, output, helpers):
    got = _loader_epoch(stores("zarr-v3-sharded"), output, helpers)
    assert_same_batches(got, _loader_epoch(csr_paths, output, helpers))
    if output in ("padded", "dense"):
        truth = Truth(stores("zarr-v3-sharded"))
        for b in got:
            real = b["mask"]
            rows = b["row_ids"][real]
            if output == "dense":
                x = b["X"][real]
            else:
                x = np.zeros((rows.size, helpers.N_GENES), np.float32)
                nnz = b["nnz"][real]
                for r, (idx, val) in enumerate(
                    zip(b["indices"][real], b["values"][real], strict=True)
                ):
                    x[r, idx[: nnz[r]]] = val[: nnz[r]]
            np.testing.assert_array_equal(x, truth.matrix(rows))


@pytest.mark.slow
@pytest.mark.parametrize("output", ["value-bins"])
def test_outputs_with_two_workers(stores, csr_paths, output, helpers):
    flags.FLAGS.mark_as_parsed()
    got = _loader_epoch(stores("zarr-v2"), output, helpers, workers=2)
    assert_same_batches(got, _loader_epoch(csr_paths, output, helpers))


def test_dense_x_equals_h5ad(dense_paths, stores, helpers):
    paths = stores("zarr-v3-sharded", dense_paths, "dense")
    got = helpers.run(helpers.build(paths, **CONFIG)[2])
    assert_equals_anndata(got, paths, helpers)
    assert_same_batches(got, helpers.run(helpers.build(dense_paths, **CONFIG)[2]))


@pytest.mark.parametrize("layout", layout_params("zarr-v3", "zarr-v2"))
def test_csr_with_leading_empty_rows(tmp_path, layout):
    x = np.zeros((100, 12), np.float32)
    x[40:, 3] = np.arange(60) + 1  # rows 0-39 empty: indptr[0:40] all 0
    path = write_store(
        anndata.AnnData(X=sp.csr_matrix(x)), tmp_path / "a.zarr", layout, chunk=16
    )
    cells = grain_cells.AnnDataSource(path, block_size=4).read(np.arange(100))
    np.testing.assert_array_equal(cells.X.toarray(), x)


@pytest.mark.parametrize("layout", layout_params("zarr-v3", "zarr-v2"))
def test_missing_indptr_chunk_after_stored_ones_is_refused(tmp_path, layout):
    """Only leading all-zero indptr chunks may be missing; a lost one later
    would read as zeros (rows silently empty), so it is refused by name."""
    x = np.zeros((100, 12), np.float32)
    x[:, 3] = np.arange(100) + 1
    path = write_store(
        anndata.AnnData(X=sp.csr_matrix(x)), tmp_path / "a.zarr", layout, chunk=16
    )
    group = zarr.open_group(path, mode="r")
    indptr = group["X/indptr"]
    key = indptr.metadata.encode_chunk_key((3,))
    victim = pathlib.Path(path) / "X" / "indptr" / key
    assert victim.exists(), victim
    victim.unlink()
    with pytest.raises(grain_cells.errors.CorruptChunkError, match="missing"):
        grain_cells.AnnDataSource(path, block_size=4).read(np.arange(100))


# -- extra matrices: layers, raw/X, obsm ------------------------------------------

SIZES, N_RAW = (45, 38), 15


@pytest.fixture(scope="module")
def matrices(tmp_path_factory):
    """Two `.h5ad` files with a `counts` layer, raw (15 genes) and obsm, each
    value naming its row; and their zarr copies (v2 and v3 sharded)."""
    folder = tmp_path_factory.mktemp("zarr_matrices")
    rng = np.random.default_rng(1)
    paths, offset = [], 0
    for f, n in enumerate(SIZES):
        rows = np.arange(offset, offset + n)
        mask = rng.random((n, N_RAW)) < 0.4
        raw = ((rows[:, None] * 100 + np.arange(N_RAW) + 1) * mask).astype(np.float32)
        adata = anndata.AnnData(
            X=sp.csr_matrix(raw[:, :12] / 2),
            obs=pd.DataFrame(
                {"cell_type": pd.Categorical(rng.choice(["B", "T"], n))},
                index=[f"c{r}" for r in rows],
            ),
            var=pd.DataFrame(index=[f"g{j}" for j in range(12)]),
            layers={"counts": sp.csr_matrix(raw[:, :12])},
            obsm={"X_pca": (rows[:, None] * 10 + np.arange(5)).astype(float)},
        )
        adata.raw = anndata.AnnData(
            X=sp.csr_matrix(raw),
            var=pd.DataFrame(index=[f"g{j}" for j in range(N_RAW)]),
        )
        paths.append(str(folder / f"m{f}.h5ad"))
        adata.write_h5ad(paths[-1])
        offset += n
    copies = {
        layout: copy_as(paths, folder / layout, layout, chunk=8)
        for layout in ("zarr-v2", "zarr-v3-sharded")
    }
    return paths, copies


def _extra_loader(paths, workers):
    source = grain_cells.AnnDataSource(paths, block_size=4, obs_columns=["cell_type"])
    return grain_cells.DataLoader(
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
        ),
        worker_count=workers,
    )


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
@pytest.mark.parametrize(
    ("layout", "workers"),
    [
        pytest.param("zarr-v3-sharded", 0, id="zarr-v3-sharded-0"),
        pytest.param("zarr-v2", 0, id="zarr-v2-0"),
        pytest.param(
            "zarr-v3-sharded", 2, id="zarr-v3-sharded-2", marks=pytest.mark.slow
        ),
    ],
)
def test_layers_raw_obsm_equal_anndata(matrices, helpers, layout, workers):
    flags.FLAGS.mark_as_parsed()
    h5ad, copies = matrices
    got = helpers.run(_extra_loader(copies[layout], workers))
    assert_same_batches(got, helpers.run(_extra_loader(h5ad, 0)))
    truth = Truth(copies[layout])
    for b in got:
        real = b["mask"]
        rows = b["row_ids"][real]
        np.testing.assert_array_equal(csr_dense(b, 12)[real], truth.matrix(rows))
        np.testing.assert_array_equal(
            b["counts/X"][real], truth.matrix(rows, lambda a: a.layers["counts"])
        )
        np.testing.assert_array_equal(
            csr_dense(b, N_RAW, "raw/")[real], truth.matrix(rows, lambda a: a.raw.X)
        )
        np.testing.assert_array_equal(
            b["pca"][real], truth.matrix(rows, lambda a: a.obsm["X_pca"])
        )


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
def test_corpus_stats_cache_notices_a_store_rewritten(tmp_path, monkeypatch):
    """Token statistics cached for a store are not reused once its values change."""
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    values = rng.integers(1, 20, (2000, 50)) * (rng.random((2000, 50)) < 0.2)
    x = sp.csr_matrix(values.astype(np.float32))
    path = write_store(
        anndata.AnnData(X=x), tmp_path / "a.zarr", "zarr-v3-sharded", chunk=1024
    )
    stats = grain_cells.tokens.corpus_stats
    before = stats(grain_cells.AnnDataSource(path), progress=False)
    # Same shape and sparsity, other values in the middle of X (even genes
    # tripled), written through zarr into the store's chunks.
    group = zarr.open_group(path, mode="r+")
    data, indices = group["X/data"], group["X/indices"][:]
    lo, hi = data.shape[0] // 3, 2 * data.shape[0] // 3
    part = data[lo:hi]
    part[indices[lo:hi] % 2 == 0] *= 3
    data[lo:hi] = part
    fresh = stats(grain_cells.AnnDataSource(path), progress=False, cache=False)
    assert not np.array_equal(fresh.nonzero_median, before.nonzero_median)
    again = stats(grain_cells.AnnDataSource(path), progress=False)
    np.testing.assert_array_equal(again.nonzero_median, fresh.nonzero_median)
