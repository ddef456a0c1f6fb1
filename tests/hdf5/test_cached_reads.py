"""Reads that take what the page cache holds inline and the rest on threads.

`RangeReader` reads a large, many-piece batch with its read threads; since
`LocalByteReader.read_cached` (`preadv` with `RWF_NOWAIT`) it first reads,
on the calling thread, the leading pieces the page cache holds, and hands
only the rest to the threads. Checked against anndata on a file whose
cache is cold, warm, or warm in its first half only (the read then switches
to the threads in the middle of a piece), and on a file that lost its end.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import anndata as ad
import h5py
import numpy as np
import pytest

import grain_cells
from grain_cells import errors
from grain_cells.hdf5._reads import RangeReader
from grain_cells.storage import _readers

pytestmark = pytest.mark.skipif(
    not hasattr(os, "posix_fadvise"), reason="page-cache control needs posix_fadvise"
)

N_CELLS, N_GENES = 2_000, 400  # 3.2 MB of float32: above the threaded minimum


@pytest.fixture(scope="module")
def dense_file(tmp_path_factory):
    """A dense h5ad whose value at (row, gene) is row * 1000 + gene."""
    path = tmp_path_factory.mktemp("cached") / "dense.h5ad"
    x = (np.arange(N_CELLS)[:, None] * 1000 + np.arange(N_GENES)[None, :]).astype(
        np.float32
    )
    ad.AnnData(x).write_h5ad(path)
    return str(path)


def _cache(path: str, state: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if state == "warm":
            os.pread(fd, os.path.getsize(path), 0)
        elif state == "half":
            os.pread(fd, os.path.getsize(path) // 2, 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("state", ["cold", "warm", "half"])
def test_reads_match_anndata(dense_file, state):
    expected = ad.read_h5ad(dense_file).X
    starts = np.arange(0, N_CELLS, 100)
    stops = starts + 80  # 20 pieces, 2.6 MB in all
    source = grain_cells.AnnDataSource(dense_file, read_threads=2)
    try:
        _cache(dense_file, state)
        cells = source.read_ranges(starts, stops)
    finally:
        source.close()
    rows = np.concatenate([np.arange(a, b) for a, b in zip(starts, stops, strict=True)])
    np.testing.assert_array_equal(cells.X, expected[rows])
    np.testing.assert_array_equal(cells.row_ids, rows)


def test_read_cached_stops_at_end_of_file(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(100)))
    reader = _readers.LocalByteReader.open(str(path))
    try:
        dest = np.zeros(300, np.uint8)
        k, got = reader.read_cached(dest, [0, 50, 90], [50, 40, 20], [0, 100, 200])
    finally:
        reader.close()
    # A warm cache or no RWF_NOWAIT: either the first pieces, or nothing.
    assert (k, got) in {(2, 10), (0, 0)}
    if k:
        np.testing.assert_array_equal(dest[:50], np.arange(50))
        np.testing.assert_array_equal(dest[100:140], np.arange(50, 90))
        np.testing.assert_array_equal(dest[200:210], np.arange(90, 100))


def test_without_rwf_nowait_the_threads_read_everything(dense_file, monkeypatch):
    monkeypatch.setattr(_readers, "_NOWAIT", None)
    source = grain_cells.AnnDataSource(dense_file, read_threads=2)
    try:
        _cache(dense_file, "warm")
        cells = source.read_ranges([0, 1000], [900, 2000])
    finally:
        source.close()
    rows = np.r_[0:900, 1000:2000]
    np.testing.assert_array_equal(cells.X, ad.read_h5ad(dense_file).X[rows])


def test_truncated_file_still_named(tmp_path):
    path = tmp_path / "cut.h5ad"
    ad.AnnData(np.ones((N_CELLS, N_GENES), np.float32)).write_h5ad(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        with h5py.File(path, "r") as f, ThreadPoolExecutor(2) as pool:
            reader = RangeReader(f["X"], str(path), fd)
            assert reader.direct
            _cache(str(path), "warm")
            os.truncate(path, os.path.getsize(path) - N_GENES * 4 * 300)
            out = np.empty((1900, N_GENES), np.float32)
            with pytest.raises(errors.CorruptDataError, match="truncated"):
                reader.read(np.array([0, 1000]), np.array([900, N_CELLS]), out, pool)
    finally:
        os.close(fd)
