"""A toy storage format for tests: a folder of `.npy` arrays holding CSR cells.

It proves the seam of issue 36: this one module, registered with
`grain_cells.formats.register`, is all it takes for `AnnDataSource`,
`grain_cells.loader` and the fetch transform to read a new format. Nothing
in `grain_cells` names it.

A toy folder (its name ends in `.npycells`) holds `indptr.npy`,
`indices.npy`, `data.npy` (CSR, one row per cell), `shape.npy` (cells,
genes), optionally `var_names.npy` (strings) and one `obs_<name>.npy` per
obs column (numbers, or strings read as a categorical column). The format
presents them as the tree AnnData writes: `X` a `csr_matrix` group, `obs`
and `var` dataframes with an `_index`.
"""

from __future__ import annotations

import os

import numpy as np

from grain_cells import formats
from grain_cells.storage import FileStat

SUFFIX = ".npycells"


def write_toy(path, X, obs: dict | None = None, var_names=None) -> str:
    """Writes a toy folder from a SciPy CSR matrix and obs columns."""
    os.makedirs(path, exist_ok=True)
    np.save(os.path.join(path, "indptr.npy"), np.asarray(X.indptr, np.int64))
    np.save(os.path.join(path, "indices.npy"), np.asarray(X.indices, np.int32))
    np.save(os.path.join(path, "data.npy"), np.asarray(X.data))
    np.save(os.path.join(path, "shape.npy"), np.asarray(X.shape, np.int64))
    if var_names is not None:
        np.save(os.path.join(path, "var_names.npy"), np.asarray(var_names, str))
    for name, values in (obs or {}).items():
        np.save(os.path.join(path, f"obs_{name}.npy"), np.asarray(values))
    return os.fspath(path)


class ToyArray:
    """A node that is an array: a memory-mapped `.npy` with attributes."""

    def __init__(self, name: str, values: np.ndarray, attrs=None, file=""):
        self.name = name
        self.values = values
        self.attrs = dict(attrs or {})
        self.file = file

    shape = property(lambda self: self.values.shape)
    ndim = property(lambda self: self.values.ndim)
    dtype = property(lambda self: self.values.dtype)

    def __getitem__(self, key):
        return self.values[key]


class ToyGroup:
    """A node that is a group: named children and attributes."""

    def __init__(self, name: str, children: dict, attrs=None):
        self.name = name
        self.children = children
        self.attrs = dict(attrs or {})

    def keys(self):
        return list(self.children)

    def __iter__(self):
        return iter(self.children)

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def get(self, key: str, default=None):
        node = self
        for part in (p for p in key.split("/") if p):
            if not isinstance(node, ToyGroup) or part not in node.children:
                return default
            node = node.children[part]
        return node

    def __getitem__(self, key: str):
        node = self.get(key)
        if node is None:
            raise KeyError(key)
        return node


class ToyFile(ToyGroup):
    """An open toy folder: the root group, a context manager."""

    def __init__(self, path: str, children: dict, stat: FileStat):
        super().__init__("/", children, {"encoding-type": "anndata"})
        self.filename = path
        self.stat = stat

    def close(self) -> None:
        self.children = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ToyReader:
    """`grain_cells.formats.RangeReader` of a toy array: numpy copies."""

    direct = True
    remote = False
    chunk_length = None
    decoded = False

    def __init__(self, array: ToyArray, path: str):
        self.name = array.name
        self.path = path
        self._values = array.values
        self.dtype = formats.value_dtype(array.dtype)
        self.shape = tuple(array.shape)
        self.row_shape = self.shape[1:]

    def pin(self) -> None:
        pass

    def advise(self, starts, stops) -> None:
        pass

    def read(self, starts, stops, out, pool=None, pending=None) -> None:
        at = 0
        starts, stops = formats.checked_ranges(self, starts, stops)
        for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
            out[at : at + b - a] = self._values[a:b]
            at += b - a


def _strings(name: str, values) -> ToyArray:
    return ToyArray(
        name, np.asarray(values, dtype=object), {"encoding-type": "string-array"}
    )


def _obs_column(name: str, values: np.ndarray):
    if values.dtype.kind in "US":
        labels, codes = np.unique(values, return_inverse=True)
        return ToyGroup(
            f"/obs/{name}",
            {
                "codes": ToyArray(f"/obs/{name}/codes", codes.astype(np.int8)),
                "categories": _strings(f"/obs/{name}/categories", labels),
            },
            {"encoding-type": "categorical", "ordered": False},
        )
    return ToyArray(f"/obs/{name}", values, {"encoding-type": "array"})


def _load(path: str, name: str) -> np.ndarray:
    return np.load(os.path.join(path, name), mmap_mode="r")


class ToyFormat(formats.Format):
    """Folders of `.npy` CSR arrays (`write_toy`)."""

    name = "toy"
    description = "a toy .npy folder"

    def can_open(self, path: str) -> bool:
        return os.fspath(path).rstrip("/").endswith(SUFFIX)

    def open(self, path, storage_options=None, stat=None) -> ToyFile:
        if not os.path.isdir(path):
            raise formats.missing_path(path)
        n_obs, n_vars = (int(s) for s in _load(path, "shape.npy"))
        x = ToyGroup(
            "/X",
            {
                k: ToyArray(f"/X/{k}", _load(path, f"{k}.npy"))
                for k in ("data", "indices", "indptr")
            },
            {"encoding-type": "csr_matrix", "shape": (n_obs, n_vars)},
        )
        names = sorted(n[4:-4] for n in os.listdir(path) if n.startswith("obs_"))
        obs = {
            n: _obs_column(n, np.asarray(_load(path, f"obs_{n}.npy"))) for n in names
        }
        obs["_index"] = _strings("/obs/_index", [f"cell{i}" for i in range(n_obs)])
        genes = (
            np.asarray(_load(path, "var_names.npy"))
            if os.path.exists(os.path.join(path, "var_names.npy"))
            else [f"gene{j}" for j in range(n_vars)]
        )
        frame = {"encoding-type": "dataframe", "_index": "_index"}
        children = {
            "X": x,
            "obs": ToyGroup("/obs", obs, {**frame, "column-order": names}),
            "var": ToyGroup("/var", {"_index": _strings("/var/_index", genes)}, frame),
        }
        return ToyFile(path, children, self.stat_path(path))

    def stat_path(self, path, storage_options=None) -> FileStat:
        return FileStat.of(os.stat(os.path.join(path, "data.npy")))

    def stat_of(self, f, path) -> FileStat:
        return f.stat

    def owns(self, node) -> bool:
        return isinstance(node, (ToyGroup, ToyArray))

    def is_group(self, node) -> bool:
        return isinstance(node, ToyGroup)

    def is_array(self, node) -> bool:
        return isinstance(node, ToyArray)

    def range_reader(self, array, path, fd, *, cache_bytes=0, fill_missing=False):
        return ToyReader(array, path)

    def array_layout(self, array) -> list:
        return [array.name, array.shape, array.dtype.str]


FORMAT = ToyFormat()
