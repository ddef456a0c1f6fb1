"""zarr `RangeReader`: values equal zarr's own slicing and `anndata.read_zarr`.

Arrays are written by zarr (the codecs and chunk grids chosen here) and by
anndata (its defaults), with values that encode their position, chunks that
no range size divides, and range sets that straddle chunks and shards.
"""

from __future__ import annotations

import concurrent.futures
import warnings

import anndata
import numcodecs
import numpy as np
import pytest
import scipy.sparse as sp
import zarr
import zarr.codecs as zc

from grain_cells.zarr._reads import RangeReader
from grain_cells.zarr._store import open_group

N = 2003


def _ranges(rng, n, k=12, empty=True):
    """`k` sorted, disjoint random ranges of `[0, n)` (some empty)."""
    cuts = np.sort(rng.choice(n + 1, 2 * k, replace=False))
    starts, stops = cuts[0::2].copy(), cuts[1::2].copy()
    if empty:
        stops[::5] = starts[::5]
    return starts.astype(np.int64), stops.astype(np.int64)


def _expected(array, starts, stops):
    return np.concatenate([array[a:b] for a, b in zip(starts, stops, strict=False)])


def write_zarr(adata, path, fmt: int, shard: bool) -> None:
    """`adata.write_zarr` in zarr format `fmt`, auto-sharded or not.

    anndata 0.13 deprecates `zarr_write_format` (a warning on reading it).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with anndata.settings.override(zarr_write_format=fmt, auto_shard_zarr_v3=shard):
            adata.write_zarr(path)


# (id, zarr_format, extra create_array kwargs)
CASES = [
    pytest.param(2, {}, id="v2-default-blosc-lz4"),
    pytest.param(2, {"compressors": numcodecs.Zstd(level=3)}, id="v2-zstd"),
    pytest.param(2, {"compressors": numcodecs.GZip(level=4)}, id="v2-gzip"),
    pytest.param(2, {"compressors": numcodecs.LZ4()}, id="v2-lz4"),
    pytest.param(2, {"compressors": None}, id="v2-raw"),
    pytest.param(3, {}, id="v3-default-zstd"),
    pytest.param(3, {"compressors": zc.BloscCodec(cname="zstd")}, id="v3-blosc-zstd"),
    pytest.param(3, {"compressors": zc.GzipCodec()}, id="v3-gzip"),
    pytest.param(
        3, {"compressors": [zc.ZstdCodec(), zc.Crc32cCodec()]}, id="v3-crc32c"
    ),
    pytest.param(3, {"shards": (400,)}, id="v3-sharded"),
    pytest.param(
        3,
        {"shards": (400,), "compressors": zc.BloscCodec(cname="lz4")},
        id="v3-sharded-blosc",
    ),
]


@pytest.mark.parametrize("fmt, kwargs", CASES)
def test_1d_ranges_equal_zarr_slicing(tmp_path, fmt, kwargs):
    values = np.arange(N, dtype=np.float32) * 3 + 1
    store = tmp_path / "a.zarr"
    g = zarr.open_group(store, mode="w", zarr_format=fmt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr's v2/v3 codec notes
        g.create_array("x", data=values, chunks=(100,), **kwargs)
    array = open_group(str(store))["x"]
    reader = RangeReader(array, str(store), cache_bytes=1 << 20)
    assert reader.direct and reader.chunk_length == 100
    rng = np.random.default_rng(0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for trial in range(4):
            starts, stops = _ranges(rng, N)
            want = _expected(values, starts, stops)
            out = np.full(want.size + 3, -7, reader.dtype)
            pending = [] if trial == 3 else None
            reader.read(starts, stops, out, pool if trial % 2 else None, pending)
            for f in pending or ():
                f.result()
            np.testing.assert_array_equal(out[: want.size], want)
            assert (out[want.size :] == -7).all()  # nothing written past the ranges
    reader.read(np.array([5], np.int64), np.array([5], np.int64), out)  # empty


@pytest.mark.parametrize(
    "fmt, kwargs",
    [
        pytest.param(2, {"chunks": (64, 16)}, id="v2-split-columns"),
        pytest.param(2, {"chunks": (64, 16), "order": "F"}, id="v2-fortran-order"),
        pytest.param(3, {"chunks": (64, 37)}, id="v3-whole-rows"),
        pytest.param(3, {"chunks": (32, 16), "shards": (128, 32)}, id="v3-sharded-2d"),
    ],
)
def test_2d_ranges_equal_zarr_slicing(tmp_path, fmt, kwargs):
    n, m = 501, 37
    values = (np.arange(n)[:, None] * 1000 + np.arange(m)[None, :]).astype(np.int32)
    store = tmp_path / "d.zarr"
    g = zarr.open_group(store, mode="w", zarr_format=fmt)
    order = kwargs.pop("order", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g.create_array(
            "x", data=values, config={"order": order} if order else None, **kwargs
        )
    reader = RangeReader(open_group(str(store))["x"], str(store))
    assert reader.direct
    rng = np.random.default_rng(1)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        starts, stops = _ranges(rng, n, k=9)
        want = _expected(values, starts, stops)
        out = np.empty(want.shape, reader.dtype)
        reader.read(starts, stops, out, pool)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize(
    "fmt, shard", [(2, False), (3, False), (3, True)], ids=["v2", "v3", "v3-sharded"]
)
def test_csr_written_by_anndata_equals_read_zarr(tmp_path, fmt, shard):
    rng = np.random.default_rng(2)
    n, g = 300, 50
    X = sp.random(n, g, density=0.2, format="csr", random_state=3, dtype=np.float32)
    X.data[:] = (
        np.repeat(np.arange(n), np.diff(X.indptr)) * 1000 + X.indices + 1
    ).astype(np.float32)
    path = tmp_path / "a.zarr"
    write_zarr(anndata.AnnData(X), path, fmt, shard)
    want = anndata.read_zarr(path).X
    group = open_group(str(path))
    readers = {
        k: RangeReader(group[f"X/{k}"], str(path))
        for k in ("data", "indices", "indptr")
    }
    rows = np.sort(rng.choice(n, 40, replace=False))
    # The loader's shape: indptr ranges, then data/indices ranges.
    ip = np.empty(rows.size, readers["indptr"].dtype)
    readers["indptr"].read(rows, rows + 1, ip)
    np.testing.assert_array_equal(ip, want.indptr[rows])
    lo, hi = want.indptr[rows], want.indptr[rows + 1]
    for k in ("data", "indices"):
        out = np.empty(int((hi - lo).sum()), readers[k].dtype)
        readers[k].read(lo, hi, out)
        np.testing.assert_array_equal(out, getattr(want[rows], k))


def test_anndata_013_defaults_are_read_directly(tmp_path):
    """anndata 0.13 writes zarr v3 with auto sharding: the fast path reads it."""
    X = np.arange(600 * 20, dtype=np.float32).reshape(600, 20)
    path = tmp_path / "d.zarr"
    write_zarr(anndata.AnnData(X), path, 3, True)
    reader = RangeReader(open_group(str(path))["X"], str(path))
    assert reader.direct
    out = np.empty((30, 20), reader.dtype)
    reader.read(np.array([5, 590]), np.array([25, 600]), out)
    np.testing.assert_array_equal(out, np.concatenate([X[5:25], X[590:600]]))


def test_zip_store(tmp_path):
    values = np.arange(N, dtype=np.int64)
    path = tmp_path / "a.zarr.zip"
    with zarr.storage.ZipStore(path, mode="w") as store:
        zarr.create_array(store, name="x", data=values, chunks=(128,))
    reader = RangeReader(open_group(str(path))["x"], str(path))
    assert reader.direct
    starts, stops = _ranges(np.random.default_rng(4), N)
    out = np.empty(int((stops - starts).sum()), reader.dtype)
    reader.read(starts, stops, out)
    np.testing.assert_array_equal(out, _expected(values, starts, stops))


def test_rows_outside_the_array_are_refused(tmp_path):
    from grain_cells import errors

    store = tmp_path / "a.zarr"
    zarr.create_array(store, name="x", data=np.arange(10), chunks=(4,))
    reader = RangeReader(open_group(str(store))["x"], str(store))
    with pytest.raises(errors.CorruptDataError, match="has 10 elements"):
        reader.read(np.array([8]), np.array([12]), np.empty(4, reader.dtype))


def test_pin_decodes_a_hot_array_into_the_cache(tmp_path):
    """indptr is read by every batch: with a cache large enough, pin
    decodes it once and later reads touch no storage."""
    import shutil

    values = np.arange(N, dtype=np.int64) * 7
    store = tmp_path / "a.zarr"
    zarr.create_array(store, name="x", data=values, chunks=(100,), shards=(500,))
    reader = RangeReader(open_group(str(store))["x"], str(store), cache_bytes=1 << 20)
    reader.pin()
    shutil.rmtree(store / "x" / "c")  # every shard gone
    starts, stops = _ranges(np.random.default_rng(5), N)
    out = np.empty(int((stops - starts).sum()), reader.dtype)
    reader.read(starts, stops, out)
    np.testing.assert_array_equal(out, _expected(values, starts, stops))


@pytest.mark.parametrize("fmt", [2, 3])
def test_big_endian_values(tmp_path, fmt):
    values = np.arange(N, dtype=">f8") / 3
    store = tmp_path / "b.zarr"
    g = zarr.open_group(store, mode="w", zarr_format=fmt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if fmt == 2:
            g.create_array("x", data=values, chunks=(128,))
        else:
            g.create_array(
                "x", data=values, chunks=(128,), serializer=zc.BytesCodec(endian="big")
            )
    reader = RangeReader(open_group(str(store))["x"], str(store))
    assert reader.direct and reader.dtype.isnative
    starts, stops = _ranges(np.random.default_rng(6), N)
    out = np.empty(int((stops - starts).sum()), reader.dtype)
    reader.read(starts, stops, out)
    np.testing.assert_array_equal(out, _expected(values, starts, stops))


def test_a_decoder_that_disagrees_with_zarr_falls_back_with_a_warning(tmp_path):
    """The first read compares one chunk with zarr-python's; a difference
    (here a byte order misread on purpose) means zarr-python reads, not
    different values."""
    import dataclasses

    values = np.arange(N, dtype=np.float64) / 7
    store = tmp_path / "a.zarr"
    zarr.create_array(store, name="x", data=values, chunks=(128,))
    reader = RangeReader(open_group(str(store))["x"], str(store))
    wrong = dataclasses.replace(
        reader.codec, stored_dtype=reader.codec.stored_dtype.newbyteorder(">")
    )
    reader.codec = wrong
    starts, stops = _ranges(np.random.default_rng(7), N)
    out = np.empty(int((stops - starts).sum()), reader.dtype)
    with pytest.warns(RuntimeWarning, match="differs from zarr-python"):
        reader.read(starts, stops, out)
    assert not reader.direct
    np.testing.assert_array_equal(out, _expected(values, starts, stops))
