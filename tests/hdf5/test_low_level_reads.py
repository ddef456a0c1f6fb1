"""What `Hdf5Format` reads with h5py's low-level calls equals h5py's reads.

Construction reads about twenty attributes, five string lists and a
sample of `indptr` per file (issue 33): `attr` reads text (scalars and
arrays) and numbers itself, `strings` reads variable-length lists itself (decoded once
per distinct list), `read` takes an index array as one point selection;
every other kind goes to h5py.
"""

import h5py
import numpy as np
import pytest

import grain_cells  # noqa: F401 (registers the formats)
from grain_cells import formats

VALUES = {
    "text": "csr_matrix",
    "unicode": "Zellen-ß-é",
    "empty_text": "",
    "ascii_vlen": np.array(b"dataframe", dtype=h5py.string_dtype("ascii")),
    "fixed_bytes": np.bytes_(b"fixed"),
    "int": 7,
    "int8": np.int8(-3),
    "uint64": np.uint64(2**63),
    "float": 0.25,
    "float16": np.float16(1.5),
    "bool": True,
    "shape": np.array([5000, 2000]),
    "shape_i4": np.array([3, 4], dtype=">i4"),
    "matrix": np.arange(6.0).reshape(2, 3),
    "empty_ints": np.array([], dtype=np.int64),
    "column_order": np.array(["a", "b"], dtype=object),
    "unicode_order": np.array(["Zellen-ß", "", "é" * 40], dtype=object),
    "ascii_order": np.array([b"a", b"b"], dtype=h5py.string_dtype("ascii")),
    "order_2d": np.array([["a", "b"], ["c", "d"]], dtype=object),
    "empty_order": np.array([], dtype=np.float64),
    "null": h5py.Empty("f"),
    "compound": np.array((1, 2.0), dtype=[("a", "i4"), ("b", "f8")]),
    "array_type": np.array([[1, 2, 3]], dtype=np.dtype("(3,)i4"))[0],
}


def _same(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            type(a) is type(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tolist() == b.tolist()
        )
    if isinstance(a, h5py.Empty):
        return isinstance(b, h5py.Empty) and a.dtype == b.dtype
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("on", ["group", "dataset"])
def test_every_kind_reads_as_h5py_reads_it(tmp_path, on):
    path = tmp_path / "attrs.h5"
    with h5py.File(path, "w") as f:
        node = (
            f.create_group("g")
            if on == "group"
            else f.create_dataset("d", (2,), dtype="f4")
        )
        for name, value in VALUES.items():
            node.attrs[name] = value
    with h5py.File(path, "r") as f:
        node = f["g"] if on == "group" else f["d"]
        for name in [*VALUES, "missing"]:
            want = node.attrs.get(name, "default")
            got = formats.of(node).attr(node, name, "default")
            assert _same(got, want), (name, got, want)


@pytest.mark.parametrize(
    "values",
    [
        ["ENSG0", "ENSG1", ""],
        ["Zellen-ß", "é" * 80, "x" * 100],
        ["same", "same"],
    ],
)
def test_string_lists_read_as_asstr_reads_them(tmp_path, values):
    """`Hdf5Format.strings` (read directly, decoded once per list) = `asstr()`."""
    path = tmp_path / "strings.h5"
    with h5py.File(path, "w") as f:
        f["vlen"] = np.array(values, dtype=object)
        f["fixed"] = np.array([v.encode() for v in values])
        f["scalar"] = values[0]
        f["two_d"] = np.array([values, values[::-1]], dtype=object)
        f.create_dataset("empty", (0,), dtype=h5py.string_dtype())
    with h5py.File(path, "r") as f:
        for name in ("vlen", "fixed", "scalar", "two_d", "empty", "vlen"):
            node = f[name]
            try:
                want = np.asarray(node.asstr()[()], dtype=object)
            except UnicodeDecodeError:  # non-ASCII bytes in an ASCII dataset
                with pytest.raises(UnicodeDecodeError):
                    formats.of(node).strings(node)
                continue
            got = formats.of(node).strings(node)
            assert got.dtype == object and got.shape == want.shape, name
            assert got.tolist() == want.tolist(), name
            if not got.flags.writeable:  # shared by equal lists: never written
                with pytest.raises(ValueError, match="read-only"):
                    got[...] = "changed"
            else:  # a list not kept (scalar, empty): the caller's own
                got[...] = "changed"


@pytest.mark.parametrize("dtype", ["<i8", ">i4", "<f4", "u1", "?"])
@pytest.mark.parametrize("chunks", [None, (7,)])
def test_index_arrays_read_as_h5py_reads_them(tmp_path, dtype, chunks):
    path = tmp_path / "points.h5"
    values = (np.arange(100) * 3 % 17).astype(dtype)
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "a", data=values, chunks=chunks, compression="gzip" if chunks else None
        )
    with h5py.File(path, "r") as f:
        node = f["a"]
        fmt = formats.of(node)
        for index in ([0], [0, 1, 2, 50, 99], list(range(0, 100, 3)), [99]):
            index = np.asarray(index, np.int64)
            got = fmt.read(node, index, str(path), (int(index[0]), 100))
            want = node[index]
            assert got.dtype == want.dtype and got.tolist() == want.tolist()
        for odd in ([3, 1], [1, 1], [100], [-1]):  # h5py's own answer
            index = np.asarray(odd, np.int64)
            try:
                want = node[index]
            except Exception as e:  # whatever h5py raises
                with pytest.raises(type(e)):
                    fmt.read(node, index, str(path), (0, 100))
                continue
            got = fmt.read(node, index, str(path), (0, 100))
            assert got.dtype == want.dtype and got.tolist() == want.tolist()
