"""A file the HDF5 format opened: its datasets know they are read-only from
their parent, and the build's reads (`Hdf5Format.read`) equal h5py's (issue 33).
"""

import h5py
import numpy as np
import pytest

import grain_cells  # noqa: F401 (registers the formats)
from grain_cells import formats


def _write(path, *, chunks, compression=None, dtype="<i8", n=20_000):
    values = (np.arange(n, dtype=np.int64) * 7919 % 10007).astype(dtype)
    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=values, chunks=chunks, compression=compression)
        f.create_dataset("m", data=np.arange(40.0).reshape(20, 2), chunks=(4, 2))
    return values


def _indexes(n):
    return [
        np.s_[0:n],
        np.s_[0:1],
        np.s_[n - 1 : n],
        np.s_[3:3],
        np.s_[5 : n - 7],
        np.array([0, n - 1]),
        np.unique(np.linspace(0, n - 1, 65).astype(np.int64)),
        np.arange(0, n, 997),
        np.array([17]),
    ]


@pytest.mark.parametrize("chunks", [None, (2500,), (9000,), (7,)])
@pytest.mark.parametrize("dtype", ["<i8", "<f4", "u1"])
def test_build_reads_equal_h5py(tmp_path, chunks, dtype):
    path = str(tmp_path / "a.h5")
    values = _write(path, chunks=chunks, dtype=dtype)
    fmt = formats.for_path(path)
    f = fmt.open(path)
    try:
        node = fmt.child(f, "a")
        for index in _indexes(values.size):
            got = fmt.read(node, index, path, (0, values.size))
            want = node[index]
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    finally:
        f.close()


def test_compressed_2d_and_strided_reads_equal_h5py(tmp_path):
    path = str(tmp_path / "a.h5")
    values = _write(path, chunks=(2500,), compression="gzip")
    fmt = formats.for_path(path)
    f = fmt.open(path)
    try:
        packed, matrix = fmt.child(f, "a"), fmt.child(f, "m")
        at = np.array([1, 5, 19_999])
        assert fmt.read(packed, at, path, (1, 20_000)).tolist() == values[at].tolist()
        for node, index in [(matrix, np.s_[0:3]), (packed, np.s_[0:10:2])]:
            want = node[index]
            assert fmt.read(node, index, path, (0, 20)).tobytes() == want.tobytes()
    finally:
        f.close()


def test_a_closed_file_is_not_read(tmp_path):
    path = str(tmp_path / "a.h5")
    values = _write(path, chunks=None)
    fmt = formats.for_path(path)
    f = fmt.open(path)
    node = fmt.child(f, "a")
    assert fmt.read(node, np.s_[0:4], path, (0, 4)).tolist() == values[:4].tolist()
    f.close()
    with pytest.raises((OSError, ValueError)):
        fmt.read(node, np.s_[0:4], path, (0, 4))


def test_datasets_take_read_only_from_the_file_not_from_hdf5(tmp_path, monkeypatch):
    """h5py asks an `h5py.File` of each dataset's file; the format's file says."""
    path = str(tmp_path / "a.h5")
    _write(path, chunks=(7,))
    fmt = formats.for_path(path)
    f = fmt.open(path)
    try:
        # Asking HDF5 for a dataset's file is what a lookup no longer does.
        def refuse(oid):
            raise AssertionError("h5py.h5i.get_file_id called")

        monkeypatch.setattr(h5py.h5i, "get_file_id", refuse)
        node = fmt.child(f, "a")
        shape = node.shape
        monkeypatch.undo()
        assert shape == (20_000,)
    finally:
        f.close()
