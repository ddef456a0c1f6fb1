"""Compressed `.h5ad`: chunks decoded in threads equal what anndata reads.

Files are written by anndata (`write_elem` with `dataset_kwargs`, so the
filter pipeline and a small chunk length are chosen here) with values that
encode (row, gene): `row * 1000 + gene + 1`. Chunks of 37 elements (or 7
rows) make blocks straddle chunks, and no size divides the row count, so the
last chunk is partial.
"""

from __future__ import annotations

import pickle
import shutil

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells import errors, formats
from grain_cells.hdf5 import _chunks as codecs
from grain_cells.outputs import CsrOutput, DenseOutput, PaddedSparseOutput

N_OBS, N_VARS = 203, 40

try:
    import lzf  # noqa: F401

    HAVE_LZF = True
except ImportError:
    HAVE_LZF = False


def _matrix(n_obs=N_OBS, n_vars=N_VARS, seed=0) -> sp.csr_matrix:
    rng = np.random.default_rng(seed)
    nnz = rng.integers(0, 13, n_obs)
    nnz[::9] = 0
    i = np.repeat(np.arange(n_obs), nnz)
    j = np.concatenate([np.sort(rng.choice(n_vars, k, replace=False)) for k in nnz])
    x = sp.csr_matrix(
        ((i * 1000 + j + 1).astype(np.float32), (i, j)), shape=(n_obs, n_vars)
    )
    x.sort_indices()
    return x


def write_compressed(path, kwargs, *, dense=False, userblock=0, x=None) -> str:
    """An `.h5ad` whose X, layers/counts and raw/X use `kwargs` (h5py's)."""
    x = _matrix() if x is None else x
    n_obs, n_vars = x.shape
    value = x.toarray() if dense else x
    adata = anndata.AnnData(
        X=value,
        obs=pd.DataFrame(
            {"idx": np.arange(n_obs)}, index=[f"c{i}" for i in range(n_obs)]
        ),
        var=pd.DataFrame(index=[f"g{j}" for j in range(n_vars)]),
    )
    adata.layers["counts"] = value.copy()
    adata.raw = adata.copy()
    opts = {"userblock_size": userblock} if userblock else {}
    with h5py.File(path, "w", **opts) as f:
        anndata.io.write_elem(f, "/", adata)
        for element in ("X", "layers/counts", "raw/X"):
            del f[element]
            parent, _, name = element.rpartition("/")
            group = f[parent] if parent else f
            anndata.io.write_elem(group, name, value, dataset_kwargs=kwargs)
    return str(path)


def _expected(path, layer, rows) -> np.ndarray:
    adata = anndata.read_h5ad(path)
    x = {None: adata.X, "counts": adata.layers.get("counts")}.get(layer)
    if layer == "raw":
        x = adata.raw.X
    x = x.toarray() if sp.issparse(x) else np.asarray(x)
    return x[rows]


def _dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else np.asarray(x)


SPARSE = {"chunks": (37,)}
PIPELINES = [
    pytest.param(({**SPARSE, "compression": "gzip"}, False), id="gzip"),
    pytest.param(
        (
            {**SPARSE, "compression": "gzip", "compression_opts": 9, "shuffle": True},
            False,
        ),
        id="shuffle-gzip9",
    ),
    pytest.param(
        ({**SPARSE, "compression": "gzip", "fletcher32": True}, False),
        id="gzip-fletcher32",
    ),
    pytest.param(
        ({**SPARSE, "compression": "gzip", "shuffle": True, "fletcher32": True}, False),
        id="shuffle-gzip-fletcher32",
    ),
    pytest.param(({**SPARSE, "fletcher32": True}, False), id="fletcher32-only"),
    pytest.param(({**SPARSE, "compression": "lzf"}, False), id="lzf"),
    pytest.param(
        ({**SPARSE, "compression": "lzf", "shuffle": True}, False), id="shuffle-lzf"
    ),
    pytest.param(
        ({"chunks": (7, N_VARS), "compression": "gzip"}, True), id="dense-gzip"
    ),
    pytest.param(
        (
            {
                "chunks": (7, N_VARS),
                "compression": "gzip",
                "shuffle": True,
                "fletcher32": True,
            },
            True,
        ),
        id="dense-shuffle-gzip-fletcher32",
    ),
    # Chunks that split rows: read through h5py, still correct.
    pytest.param(
        ({"chunks": (7, 9), "compression": "gzip"}, True), id="dense-gzip-2d-chunks"
    ),
]


@pytest.fixture(scope="module", params=PIPELINES)
def written(request, tmp_path_factory):
    kwargs, dense = request.param
    path = tmp_path_factory.mktemp("z") / "a.h5ad"
    return write_compressed(path, kwargs, dense=dense), kwargs, dense


@pytest.mark.parametrize("layer", [None, "counts", "raw"])
def test_reads_equal_anndata(written, layer):
    path, kwargs, dense = written
    source = grain_cells.AnnDataSource(path, layer=layer, obs_columns=["idx"])
    reader = source._file(0).reader
    splits_rows = dense and kwargs["chunks"][1] != N_VARS
    lzf_without_decoder = kwargs.get("compression") == "lzf" and not HAVE_LZF
    part = reader._x if dense else reader._data
    assert part.decoded == (not splits_rows and not lzf_without_decoder)
    rng = np.random.default_rng(1)
    for rows in (
        rng.integers(0, N_OBS, 60),
        np.arange(N_OBS),
        np.array([N_OBS - 1, 0, N_OBS - 1]),  # the partial last chunk
        rng.permutation(N_OBS)[:25],
    ):
        cells = source.read(rows)
        np.testing.assert_array_equal(_dense(cells.X), _expected(path, layer, rows))
        np.testing.assert_array_equal(cells.obs["idx"], rows)
    # Blocks that straddle chunks, read in one batched call.
    starts = np.arange(3, N_OBS - 20, 23)
    cells = source.read_ranges(starts, starts + 11)
    rows = (starts[:, None] + np.arange(11)).ravel()
    np.testing.assert_array_equal(_dense(cells.X), _expected(path, layer, rows))


def test_threads_and_pickling(written):
    path, _, _ = written
    source = grain_cells.AnnDataSource(path, read_threads=3)
    source.read([0])
    clone = pickle.loads(pickle.dumps(source))
    rows = np.random.default_rng(2).permutation(N_OBS)
    np.testing.assert_array_equal(
        _dense(clone.read(rows).X), _expected(path, None, rows)
    )


def test_chunk_offsets_are_absolute_with_a_userblock(tmp_path):
    path = write_compressed(
        tmp_path / "u.h5ad", {**SPARSE, "compression": "gzip"}, userblock=1024
    )
    with h5py.File(path) as f:
        assert f.userblock_size == 1024
    source = grain_cells.AnnDataSource(path)
    assert source._file(0).reader._data.decoded
    rows = np.arange(N_OBS)[::-1]
    np.testing.assert_array_equal(
        _dense(source.read(rows).X), _expected(path, None, rows)
    )


def test_chunk_with_a_skipped_filter(tmp_path):
    """A chunk stored raw with its filter mask saying deflate was skipped."""
    path = write_compressed(tmp_path / "m.h5ad", {**SPARSE, "compression": "gzip"})
    with h5py.File(path, "r+") as f:
        ds = f["X/data"]
        raw = np.ascontiguousarray(ds[37:74]).tobytes()
        ds.id.write_direct_chunk((37,), raw, filter_mask=1)
        assert ds.id.get_chunk_info_by_coord((37,)).filter_mask == 1
    source = grain_cells.AnnDataSource(path)
    assert source._file(0).reader._data.decoded
    rows = np.arange(N_OBS)
    np.testing.assert_array_equal(
        _dense(source.read(rows).X), _expected(path, None, rows)
    )


def _corrupt_chunk(path, dataset, k, byte=20):
    with h5py.File(path) as f:
        info = f[dataset].id.get_chunk_info(k)
        length = f[dataset].chunks[0]
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + min(byte, info.size - 5))
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x5A]))
    return info.byte_offset, k * length


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        pytest.param({**SPARSE, "compression": "gzip"}, "deflate", id="gzip"),
        pytest.param(
            {**SPARSE, "compression": "gzip", "shuffle": True, "fletcher32": True},
            "fletcher32",
            id="fletcher32",
        ),
    ],
)
def test_corrupt_chunk_names_file_dataset_offset_and_cells(tmp_path, kwargs, reason):
    x = _matrix(n_obs=400, seed=4)
    path = write_compressed(tmp_path / "c.h5ad", kwargs, x=x)
    offset, first = _corrupt_chunk(path, "X/data", 5)
    source = grain_cells.AnnDataSource(path, read_threads=2)
    # Rows whose values lie in other chunks still read.
    fine = np.arange(0, 3)
    np.testing.assert_array_equal(_dense(source.read(fine).X), x[fine].toarray())
    with pytest.raises(errors.CorruptChunkError) as info:
        source.read(np.arange(400))
    e = info.value
    message = str(e)
    assert path in message and "/X/data" in message and str(offset) in message
    assert reason in message
    assert f"rows [{first}, {first + 37})" in message
    lo = int(np.searchsorted(x.indptr, first, side="right")) - 1
    hi = int(np.searchsorted(x.indptr, first + 36, side="right"))
    assert e.rows == (lo, hi) and e.byte_offset == offset
    assert f"cells (rows) [{lo}, {hi})" in message
    assert isinstance(e, errors.CorruptDataError)
    clone = pickle.loads(pickle.dumps(e))  # crosses worker processes intact
    assert clone.rows == e.rows and str(clone) == message


def test_corrupt_chunk_through_the_loader_is_an_error_not_garbage(tmp_path, helpers):
    path = write_compressed(tmp_path / "w.h5ad", {**SPARSE, "compression": "gzip"})
    _corrupt_chunk(path, "X/indices", 3)
    source = grain_cells.AnnDataSource(path, block_size=5)
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=1),
        operations=grain_cells.fetch_operations(source, batch_size=4, fetch_factor=5),
        worker_count=0,
    )
    with pytest.raises(errors.CorruptChunkError, match="X/indices chunk 3"):
        helpers.run(loader)


def test_filter_unknown_to_hdf5_is_refused_with_its_provider(tmp_path, monkeypatch):
    path = write_compressed(tmp_path / "b.h5ad", {**SPARSE, "compression": "gzip"})
    real = h5py.h5z.filter_avail
    monkeypatch.setattr(
        h5py.h5z, "filter_avail", lambda i: False if i == 1 else real(i)
    )
    with pytest.raises(
        errors.UnsupportedLayoutError, match=r"filter 1 \(deflate\).*not available"
    ):
        grain_cells.AnnDataSource(path).read([0])


def test_filter_not_decoded_here_goes_through_h5py(tmp_path):
    hdf5plugin = pytest.importorskip("hdf5plugin")
    path = write_compressed(
        tmp_path / "z.h5ad", {**SPARSE, **hdf5plugin.Zstd(clevel=3)}
    )
    source = grain_cells.AnnDataSource(path)
    assert not source._file(0).reader._data.decoded
    rows = np.arange(N_OBS)
    np.testing.assert_array_equal(
        _dense(source.read(rows).X), _expected(path, None, rows)
    )


@pytest.mark.parametrize("dtype", ["<f2", ">f2", ">f4"])
@pytest.mark.parametrize("dense", [False, True], ids=["csr", "dense"])
def test_compressed_half_precision_and_big_endian_read_as_stored(
    tmp_path, dtype, dense
):
    """Chunks whose values are not read as stored (float16, big-endian) go
    through h5py, which converts them: the chunk decoder would copy their
    stored bytes into float32 rows."""
    kwargs = {"chunks": (37, N_VARS) if dense else (37,), "compression": "gzip"}
    path = write_compressed(tmp_path / "h.h5ad", kwargs, dense=dense)
    key = "X" if dense else "X/data"
    with h5py.File(path, "r+") as f:
        ds = f[key]
        values, attrs = (ds[()] / 8).astype(dtype), dict(ds.attrs)
        del f[key]
        f.create_dataset(key, data=values, chunks=ds.chunks, compression="gzip")
        f[key].attrs.update(attrs)
        if not dense:
            indices, indptr = f["X/indices"][()], f["X/indptr"][()]
    expected = values.astype(np.float32)  # as stored, through h5py
    if not dense:
        shape = (N_OBS, N_VARS)
        expected = sp.csr_matrix((expected, indices, indptr), shape).toarray()
    got = _dense(grain_cells.AnnDataSource(path).read(np.arange(N_OBS)).X)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


def test_fletcher32_matches_hdf5(tmp_path):
    """Our checksum equals the one HDF5 stored, for even and odd lengths."""
    for n, dtype in ((50, np.float32), (33, np.uint8)):
        path = tmp_path / f"f{n}.h5"
        values = np.arange(n * 7, dtype=dtype)
        with h5py.File(path, "w") as f:
            f.create_dataset("v", data=values, chunks=(n,), fletcher32=True)
        with h5py.File(path) as f:
            _, raw = f["v"].id.read_direct_chunk((0,))
        stored = int.from_bytes(raw[-4:], "little")
        assert codecs._same_fletcher(codecs.fletcher32(raw[:-4]), stored)
        codecs.verify_fletcher32(raw)


# -- through the DataLoader ----------------------------------------------------


def _rewrite_compressed(src_paths, directory, kwargs) -> list[str]:
    out = []
    for p in src_paths:
        dst = directory / p.rsplit("/", 1)[-1]
        shutil.copy(p, dst)
        with h5py.File(dst, "r+") as f:
            x = anndata.io.read_elem(f["X"])
            del f["X"]
            anndata.io.write_elem(f, "X", x, dataset_kwargs=kwargs)
        out.append(str(dst))
    return out


@pytest.fixture(scope="module")
def gz_csr_paths(csr_paths, tmp_path_factory):
    kwargs = {"chunks": (11,), "compression": "gzip", "shuffle": True}
    return _rewrite_compressed(csr_paths, tmp_path_factory.mktemp("gzcsr"), kwargs)


@pytest.fixture(scope="module")
def gz_dense_paths(dense_paths, tmp_path_factory):
    kwargs = {"chunks": (6, 12), "compression": "gzip", "fletcher32": True}
    return _rewrite_compressed(dense_paths, tmp_path_factory.mktemp("gzdense"), kwargs)


def _batch_rows(batch, output, n_genes) -> np.ndarray:
    mask = batch["mask"]
    if isinstance(output, DenseOutput):
        return batch["X"][mask]
    if isinstance(output, PaddedSparseOutput):
        out = np.zeros((mask.size, n_genes), np.float32)
        for r in range(mask.size):
            k = min(int(batch["nnz"][r]), batch["values"].shape[1])
            out[r, batch["indices"][r, :k]] = batch["values"][r, :k]
        return out[mask]
    x = sp.csr_matrix(
        (batch["data"], batch["indices"], batch["indptr"]),
        shape=(mask.size, n_genes),
    )
    return x.toarray()[mask]


@pytest.mark.parametrize(
    "layout, output, genes, workers",
    [
        pytest.param("csr", CsrOutput(), None, 0, id="csr-csr-0"),
        pytest.param(
            "csr",
            PaddedSparseOutput(width=12),
            ["g7", "g2", "g0"],
            0,
            id="csr-padded-subset-0",
        ),
        pytest.param(
            "csr", DenseOutput(), None, 2, id="csr-dense-2", marks=pytest.mark.slow
        ),
        pytest.param(
            "dense", DenseOutput(), ["g11", "g3"], 0, id="dense-dense-subset-0"
        ),
        pytest.param(
            "dense", CsrOutput(), None, 2, id="dense-csr-2", marks=pytest.mark.slow
        ),
    ],
)
def test_loader_values(request, helpers, layout, output, genes, workers):
    paths = request.getfixturevalue(f"gz_{layout}_paths")
    source, _, loader = helpers.build(
        paths, output=output, genes=genes, worker_count=workers
    )
    part = source._file(0).reader
    assert (part._x if layout == "dense" else part._data).decoded
    batches = helpers.run(loader)
    ids = np.concatenate([b["row_ids"][b["mask"]] for b in batches])
    np.testing.assert_array_equal(np.sort(ids), np.arange(helpers.N_CELLS))
    truth = helpers.Truth(source, paths)
    for b in batches:
        np.testing.assert_array_equal(
            _batch_rows(b, output, source.num_genes),
            truth.x(b["row_ids"][b["mask"]], genes),
        )


# -- the synthetic maker's chunking --------------------------------------------


@pytest.mark.parametrize("chunks", [None, 500, "atlas"])
def test_synthetic_chunks(tmp_path, chunks):
    from grain_cells.synthetic import _tahoe as synthetic

    args = {"n_genes": 300, "mean_nnz": 40.0, "chunk_cells": 400}
    path = synthetic.write_tahoe_like(
        tmp_path / "s.h5ad", 1_000, compression="gzip", chunks=chunks, **args
    )
    with h5py.File(path) as f:
        got = f["X/data"].chunks[0]
        with h5py.File("probe", "w", driver="core", backing_store=False) as mem:
            guess = mem.create_dataset(
                "p", (40_000,), np.float32, maxshape=(None,), chunks=True
            ).chunks[0]
    assert got == {None: 2**16, 500: 500, "atlas": guess}[chunks]
    source = grain_cells.AnnDataSource(path)
    assert source._file(0).reader._data.decoded
    rows = np.arange(0, 1_000, 7)
    np.testing.assert_array_equal(
        _dense(source.read(rows).X), anndata.read_h5ad(path).X[rows].toarray()
    )
    assert synthetic._cache_name(
        10, {**synthetic._DEFAULTS, "chunks": chunks}
    ).endswith("" if chunks is None else f"-k{chunks}.h5ad")
    with pytest.raises(ValueError, match="chunks must be a positive int, got chunks=0"):
        synthetic.write_tahoe_like(tmp_path / "t.h5ad", 10, chunks=0, **args)


def test_prefix_decode_is_off_by_default():
    """Every chunk is inflated whole, so its adler32 is always checked."""
    assert codecs.PREFIX_FRACTION == 0


def test_prefix_decode_equals_the_whole_chunk(tmp_path, monkeypatch):
    """Opted in, a read that needs only a chunk's start inflates only that."""
    monkeypatch.setattr(codecs, "PREFIX_FRACTION", 0.25)
    path = tmp_path / "p.h5"
    values = np.arange(4_000, dtype=np.float32) % 97
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=values, chunks=(1_000,), compression="gzip")
        f.create_dataset(
            "s", data=values, chunks=(1_000,), compression="gzip", shuffle=True
        )
    with h5py.File(path) as f:
        pipe = codecs.Pipeline.for_dataset(f["v"])
        _, raw = f["v"].id.read_direct_chunk((1_000,))
        whole = pipe.decode(raw)
        part = pipe.decode(raw, need=400)
        assert part.size < whole.size  # only a prefix was inflated
        np.testing.assert_array_equal(part[:400], whole[:400])
        np.testing.assert_array_equal(whole.view(np.float32), values[1_000:2_000])
        with pytest.raises(formats.ChunkDecodeError, match="deflate"):
            pipe.decode(raw[:2] + bytes(40) + raw[42:], need=400)
        # Shuffled chunks are always inflated whole.
        spipe = codecs.Pipeline.for_dataset(f["s"])
        _, sraw = f["s"].id.read_direct_chunk((0,))
        assert spipe.decode(sraw, need=400).size == 4_000
    # Through a source: blocks that end early in a chunk.
    gz = write_compressed(
        tmp_path / "q.h5ad", {"chunks": (400,), "compression": "gzip"}
    )
    source = grain_cells.AnnDataSource(gz)
    starts = np.arange(0, N_OBS - 3, 7)
    cells = source.read_ranges(starts, starts + 2)
    rows = (starts[:, None] + np.arange(2)).ravel()
    np.testing.assert_array_equal(_dense(cells.X), _expected(gz, None, rows))
