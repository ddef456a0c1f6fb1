"""Uncompressed zarr chunks read by byte range (`zarr._reads.RangeReader._read_raw`).

Values encode their position; ranges straddle chunks and shards; the same
ranges read whole-chunk (through a decoded-chunk cache, which turns the
byte-range path off) must give the same values. Damaged stores: a short
chunk file, a short inner chunk in a shard, a missing chunk.
"""

from __future__ import annotations

import concurrent.futures
import os
import warnings

import anndata
import numpy as np
import pytest
import scipy.sparse as sp
import zarr

from grain_cells import errors
from grain_cells.zarr import _reads
from grain_cells.zarr._reads import RangeReader
from grain_cells.zarr._store import open_group

N = 2003

RAW = [
    pytest.param(2, {}, id="v2"),
    pytest.param(3, {}, id="v3"),
    pytest.param(3, {"shards": (400,)}, id="v3-sharded"),
]


def _ranges(rng, n, k=12):
    cuts = np.sort(rng.choice(n + 1, 2 * k, replace=False))
    starts, stops = cuts[0::2].copy(), cuts[1::2].copy()
    stops[::5] = starts[::5]  # some empty
    return starts.astype(np.int64), stops.astype(np.int64)


def _write(tmp_path, fmt, kwargs, values, name="a.zarr"):
    store = tmp_path / name
    g = zarr.open_group(store, mode="w", zarr_format=fmt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g.create_array("x", data=values, chunks=(100,), compressors=None, **kwargs)
    return store


@pytest.mark.parametrize("fmt, kwargs", RAW)
def test_byte_ranges_equal_whole_chunk_reads_and_the_values(
    tmp_path, monkeypatch, fmt, kwargs
):
    values = np.arange(N, dtype=np.float32) * 3 + 1
    store = _write(tmp_path, fmt, kwargs, values)
    array = open_group(str(store))["x"]
    raw = RangeReader(array, str(store))
    whole = RangeReader(array, str(store), cache_bytes=1 << 20)
    assert raw._raw and not whole._raw
    # Split reads over the pool's threads even at this size.
    monkeypatch.setattr(_reads, "_MIN_BYTES_PER_TASK", 64)
    rng = np.random.default_rng(0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for trial in range(6):
            starts, stops = _ranges(rng, N)
            want = np.concatenate(
                [values[a:b] for a, b in zip(starts, stops, strict=True)]
            )
            raw.advise(starts, stops)
            got = np.full(want.size + 3, -7, np.float32)
            pending = [] if trial == 5 else None
            raw.read(starts, stops, got, pool if trial % 2 else None, pending)
            for f in pending or ():
                f.result()
            other = np.empty(want.size, np.float32)
            whole.read(starts, stops, other)
            np.testing.assert_array_equal(got[: want.size], want)
            np.testing.assert_array_equal(other, want)
            assert (got[want.size :] == -7).all()


@pytest.mark.parametrize("shard", [False, True])
def test_anndata_raw_store_equals_read_zarr(tmp_path, shard):
    rng = np.random.default_rng(1)
    n, g = 700, 50
    x = sp.random(n, g, density=0.2, format="csr", dtype=np.float32, rng=rng)
    x.data = (np.repeat(np.arange(n), np.diff(x.indptr)) * 1000 + x.indices + 1).astype(
        np.float32
    )
    path = tmp_path / "raw.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ad = anndata.AnnData(x)
        g_ = zarr.open_group(path, mode="w", zarr_format=3)
        kwargs = {"compressors": None, "chunks": (97,)}
        if shard:
            kwargs["shards"] = (97 * 4,)
        anndata.io.write_elem(g_, "X", ad.X, dataset_kwargs=kwargs)
    array = open_group(str(path))["X/data"]
    reader = RangeReader(array, str(path))
    assert reader._raw
    starts = np.array([3, 500, 1201], np.int64)
    stops = np.array([90, 777, 1300], np.int64)
    got = np.empty(int((stops - starts).sum()), np.float32)
    reader.read(starts, stops, got)
    np.testing.assert_array_equal(
        got, np.concatenate([x.data[a:b] for a, b in zip(starts, stops, strict=True)])
    )


def test_a_short_chunk_file_is_refused_by_name(tmp_path):
    values = np.arange(N, dtype=np.float32) + 1
    store = _write(tmp_path, 2, {}, values)
    reader = RangeReader(open_group(str(store))["x"], str(store))
    reader.read(np.array([0]), np.array([5]), np.empty(5, np.float32))  # checked
    os.truncate(store / "x" / "3", 200)
    with pytest.raises(errors.CorruptChunkError, match=r"'x/3'.*holds 200 bytes") as e:
        reader.read(np.array([310]), np.array([320]), np.empty(10, np.float32))
    assert e.value.rows == (300, 400) and e.value.chunk_key == "x/3"


def test_a_short_inner_chunk_in_a_shard_is_refused(tmp_path):
    values = np.arange(N, dtype=np.float32) + 1
    store = _write(tmp_path, 3, {"shards": (400,)}, values)
    reader = RangeReader(open_group(str(store))["x"], str(store))
    reader.read(np.array([0]), np.array([5]), np.empty(5, np.float32))
    reader.load_shard_indices([(1,)])
    index = reader._shard_index[(1,)].copy()
    index[1, 1] -= 8  # the index gives inner chunk 5 eight bytes too few
    reader._shard_index[(1,)] = index
    with pytest.raises(errors.CorruptChunkError, match="gives it 392 bytes"):
        reader.read(np.array([510]), np.array([520]), np.empty(10, np.float32))


@pytest.mark.parametrize("fmt, kwargs", RAW)
def test_a_missing_chunk_is_an_error_or_the_fill_value(tmp_path, fmt, kwargs):
    values = np.arange(N, dtype=np.float32) + 1
    values[200:300] = 0  # zarr does not write an all-fill chunk
    store = _write(tmp_path, fmt, kwargs, values)
    array = open_group(str(store))["x"]
    strict = RangeReader(array, str(store))
    with pytest.raises(errors.CorruptChunkError, match="never written"):
        strict.read(np.array([190]), np.array([210]), np.empty(20, np.float32))
    filled = RangeReader(array, str(store), fill_missing=True)
    got = np.empty(20, np.float32)
    filled.read(np.array([190]), np.array([210]), got)
    np.testing.assert_array_equal(got, values[190:210])
