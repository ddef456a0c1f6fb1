"""A file the HDF5 format opened: its datasets know they are read-only from
their parent, and the build's reads come from the file's own bytes (issue 33).

`Hdf5Format.read` of a 1-D dataset whose bytes lie as read is positional
(`_reads.read_positional`, through HDF5's descriptor); h5py is the oracle.
"""

import h5py
import numpy as np
import pytest

import grain_cells  # noqa: F401 (registers the formats)
from grain_cells import formats
from grain_cells.hdf5 import _reads


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
def test_positional_reads_equal_h5py(tmp_path, chunks, dtype):
    path = str(tmp_path / "a.h5")
    values = _write(path, chunks=chunks, dtype=dtype)
    fmt = formats.for_path(path)
    f = fmt.open(path)
    try:
        node = fmt.child(f, "a")
        for index in _indexes(values.size):
            got = _reads.read_positional(node, index, path)
            assert got is not None, index  # the positional path took it
            want = node[index]
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
            via = fmt.read(node, index, path, (0, values.size))
            assert via.tobytes() == want.tobytes()
    finally:
        f.close()


def test_what_is_not_positional_goes_to_h5py(tmp_path):
    path = str(tmp_path / "a.h5")
    values = _write(path, chunks=(2500,), compression="gzip")
    fmt = formats.for_path(path)
    f = fmt.open(path)
    try:
        packed, matrix = fmt.child(f, "a"), fmt.child(f, "m")
        at = np.array([1, 5, 19_999])
        assert _reads.read_positional(packed, at, path) is None  # compressed
        assert fmt.read(packed, at, path, (1, 20_000)).tolist() == values[at].tolist()
        assert _reads.read_positional(matrix, np.s_[0:3], path) is None  # 2-D
        assert _reads.read_positional(packed, np.array([3, 1]), path) is None
        assert _reads.read_positional(packed, np.s_[0:10:2], path) is None
    finally:
        f.close()
    with h5py.File(path, "r") as g:  # not opened by the format: no descriptor
        assert _reads.read_positional(g["m"], np.s_[0:1], path) is None


def test_a_closed_file_is_not_read_through_its_old_descriptor(tmp_path):
    path = str(tmp_path / "a.h5")
    _write(path, chunks=None)
    fmt = formats.for_path(path)
    f = fmt.open(path)
    node = fmt.child(f, "a")
    assert _reads.read_positional(node, np.s_[0:4], path) is not None
    f.close()
    assert _reads.read_positional(node, np.s_[0:4], path) is None


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
