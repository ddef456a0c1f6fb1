"""The AnnData on-disk format (`.h5ad`): what is where, and is it sane.

This module opens files, locates the matrix to read (`X`, `layers/<name>` or
`raw/X`), checks its encoding cheaply, and reads metadata: var names and obs
columns. obs columns go through anndata's own element reader, which knows
every encoding anndata has written since 0.7; nothing here re-implements the
dataframe spec. Reading rows of the matrix is `grain_cells.matrix`'s job.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings

import anndata
import h5py
import numpy as np
import pandas as pd

from grain_cells import errors

try:  # anndata >= 0.11
    from anndata.io import read_elem
except ImportError:  # pragma: no cover - anndata 0.10
    from anndata.experimental import read_elem

CSR = "csr_matrix"
CSC = "csc_matrix"
DENSE = "array"


def matrix_element(layer: str | None) -> str:
    """Returns the HDF5 path of the matrix to read.

    Args:
        layer: None for `X`, `"raw"` (or `"raw/X"`) for `raw/X`, any other
            name for `layers/<name>`.
    """
    if layer is None or layer == "X":
        return "X"
    if layer in ("raw", "raw/X"):
        return "raw/X"
    return f"layers/{layer}"


@dataclasses.dataclass(frozen=True)
class MatrixInfo:
    """Where a file's matrix lives and what it holds.

    Attributes:
        path: The file.
        element: HDF5 path of the matrix (`X`, `layers/counts`, `raw/X`).
        encoding: `"csr_matrix"` or `"array"` (dense).
        n_obs: Rows (cells).
        n_vars: Columns (genes).
        dtype: dtype of the stored values.
        nnz: Stored values of a sparse matrix; None for dense.
    """

    path: str
    element: str
    encoding: str
    n_obs: int
    n_vars: int
    dtype: np.dtype
    nnz: int | None

    def describe(self) -> str:
        """A one-line summary used to detect changed files."""
        nnz = "" if self.nnz is None else f", nnz={self.nnz}"
        return (
            f"{self.element}: {self.encoding} {self.n_obs}x{self.n_vars} "
            f"{self.dtype}{nnz}"
        )


def open_file(path: str | os.PathLike) -> h5py.File:
    """Opens an `.h5ad` file read-only with errors that name the file.

    Raises:
        FileNotFoundError: The path does not exist.
        errors.AnnDataFormatError: The file is not HDF5, is truncated, or has
            no `obs`/`var` groups (not AnnData).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if os.path.isdir(path):
        raise errors.AnnDataFormatError(
            f"{path}: is a directory, expected an .h5ad file (zarr stores are "
            "not supported)"
        )
    if not h5py.is_hdf5(path):
        raise errors.AnnDataFormatError(
            f"{path}: not an HDF5 file (no HDF5 signature), expected an .h5ad "
            "file written by anndata"
        )
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise errors.AnnDataFormatError(
            f"{path}: HDF5 cannot open it ({e}); the file is probably truncated "
            "or corrupt"
        ) from e
    missing = [k for k in ("obs", "var") if k not in f]
    if missing:
        found = sorted(f.keys())
        f.close()
        raise errors.AnnDataFormatError(
            f"{path}: HDF5 but not AnnData: expected groups 'obs' and 'var' at "
            f"the root, found {found}"
        )
    return f


def _encoding(obj) -> str | None:
    value = obj.attrs.get("encoding-type")
    if isinstance(value, bytes):
        value = value.decode()
    return value


def _n_rows_of_frame(group: h5py.Group) -> int | None:
    """Rows of an obs/var dataframe group, without reading it."""
    if not isinstance(group, h5py.Group):
        return None
    index = group.attrs.get("_index")
    if isinstance(index, bytes):
        index = index.decode()
    if index is not None and index in group:
        return int(group[index].shape[0])
    return None


def inspect_matrix(f: h5py.File, element: str) -> MatrixInfo:
    """Locates and checks the matrix at `element`.

    Reads only attributes, shapes and two `indptr` values.

    Raises:
        errors.MissingColumnError: There is no such element; the message lists
            the matrices the file does have.
        errors.UnsupportedLayoutError: The matrix is CSC (row reads would touch
            every column) or an encoding this reader does not handle.
        errors.AnnDataFormatError: The element contradicts the format.
    """
    path = f.filename
    if element not in f:
        have = available_matrices(f)
        hint = ""
        if element == "X":
            hint = (
                " anndata writes files without X when the AnnData had none "
                "(e.g. AnnData(shape=...)); read a layer instead with layer=..."
            )
        raise errors.MissingColumnError(
            f"{path}: has no {element}.{hint} Matrices in this file: {have or 'none'}"
        )
    obj = f[element]
    enc = _encoding(obj)
    if isinstance(obj, h5py.Group):
        if enc == CSC:
            raise errors.UnsupportedLayoutError(
                f"{path}: {element} is stored as csc_matrix; row reads would touch "
                "every column. Convert it once to CSR, e.g. with anndata: "
                "`a = anndata.read_h5ad(path); a.X = a.X.tocsr(); "
                "a.write_h5ad(new_path)` (use a layer name instead of X as needed)."
            )
        if enc != CSR:
            raise errors.UnsupportedLayoutError(
                f"{path}: {element} is a group with encoding-type {enc!r}; expected "
                "'csr_matrix' (sparse) or a dense 2-D dataset"
            )
        for name in ("data", "indices", "indptr"):
            if name not in obj or not isinstance(obj[name], h5py.Dataset):
                raise errors.AnnDataFormatError(
                    f"{path}: {element} is a csr_matrix without the dataset "
                    f"'{name}'; found {sorted(obj.keys())}"
                )
        shape = obj.attrs.get("shape")
        if shape is None or len(shape) != 2:
            raise errors.AnnDataFormatError(
                f"{path}: {element} has no 2-element 'shape' attribute (found "
                f"{shape!r})"
            )
        n_obs, n_vars = int(shape[0]), int(shape[1])
        data, indices, indptr = obj["data"], obj["indices"], obj["indptr"]
        nnz = int(data.shape[0])
        if data.ndim != 1 or indices.ndim != 1 or indptr.ndim != 1:
            raise errors.AnnDataFormatError(
                f"{path}: {element}/data, indices and indptr must be 1-D; found "
                f"shapes {data.shape}, {indices.shape}, {indptr.shape}"
            )
        if indptr.shape[0] != n_obs + 1:
            raise errors.AnnDataFormatError(
                f"{path}: {element}/indptr has {indptr.shape[0]} entries; the "
                f"shape attribute {n_obs}x{n_vars} needs {n_obs + 1}"
            )
        if indices.shape[0] != nnz:
            raise errors.AnnDataFormatError(
                f"{path}: {element}/indices has {indices.shape[0]} entries but "
                f"data has {nnz}; they must match"
            )
        if indices.dtype.kind not in "iu" or indptr.dtype.kind not in "iu":
            raise errors.AnnDataFormatError(
                f"{path}: {element}/indices and indptr must be integers; found "
                f"{indices.dtype} and {indptr.dtype}"
            )
        if data.dtype.kind not in "biuf":
            raise errors.UnsupportedLayoutError(
                f"{path}: {element}/data has dtype {data.dtype}; expected a "
                "numeric dtype"
            )
        try:
            ends = indptr[[0, n_obs]] if n_obs else indptr[[0]]
        except OSError as e:
            raise errors.AnnDataFormatError(
                f"{path}: reading {element}/indptr failed ({e}); the file is "
                "probably truncated"
            ) from e
        if int(ends[0]) != 0 or int(ends[-1]) != nnz:
            raise errors.CorruptDataError(
                f"{path}: {element}/indptr runs from {int(ends[0])} to "
                f"{int(ends[-1])}; expected 0 to {nnz} (the length of data)"
            )
        info = MatrixInfo(path, element, CSR, n_obs, n_vars, data.dtype, nnz)
    elif isinstance(obj, h5py.Dataset):
        if obj.ndim != 2:
            raise errors.UnsupportedLayoutError(
                f"{path}: {element} is a {obj.ndim}-D dataset; expected a 2-D "
                "dense matrix or a csr_matrix group"
            )
        if obj.dtype.kind not in "biuf":
            raise errors.UnsupportedLayoutError(
                f"{path}: {element} has dtype {obj.dtype}; expected numeric"
            )
        n_obs, n_vars = (int(s) for s in obj.shape)
        info = MatrixInfo(path, element, DENSE, n_obs, n_vars, obj.dtype, None)
    else:  # pragma: no cover - h5py only has groups and datasets
        raise errors.AnnDataFormatError(f"{path}: {element} is not readable")

    frame_rows = _n_rows_of_frame(f["raw/var" if element == "raw/X" else "var"])
    obs_rows = _n_rows_of_frame(f["obs"])
    if obs_rows is not None and obs_rows != info.n_obs:
        raise errors.AnnDataFormatError(
            f"{path}: {element} has {info.n_obs} rows but obs has {obs_rows}"
        )
    if frame_rows is not None and frame_rows != info.n_vars:
        raise errors.AnnDataFormatError(
            f"{path}: {element} has {info.n_vars} columns but its var has "
            f"{frame_rows} rows"
        )
    return info


def available_matrices(f: h5py.File) -> list[str]:
    """Matrix element paths present in the file (for error messages)."""
    found = []
    if "X" in f:
        found.append("X")
    if "layers" in f and isinstance(f["layers"], h5py.Group):
        found += [f"layers/{k}" for k in f["layers"]]
    if "raw" in f and "X" in f["raw"]:
        found.append("raw/X")
    return found


def read_var_names(f: h5py.File, element: str) -> np.ndarray:
    """Var names (gene ids) of the matrix at `element`, as a str array."""
    group = f["raw/var"] if element == "raw/X" else f["var"]
    index = read_elem(group[_index_key(f.filename, group)])
    return np.asarray(index, dtype=str)


def _index_key(path: str, group: h5py.Group) -> str:
    key = group.attrs.get("_index", "_index")
    if isinstance(key, bytes):
        key = key.decode()
    if key not in group:
        raise errors.AnnDataFormatError(
            f"{path}: {group.name} has no index dataset {key!r}"
        )
    return key


def obs_columns(f: h5py.File) -> list[str]:
    """Names of the obs columns stored in the file."""
    group = f["obs"]
    index = group.attrs.get("_index", "_index")
    if isinstance(index, bytes):
        index = index.decode()
    order = group.attrs.get("column-order")
    if order is not None and len(order):
        return [c.decode() if isinstance(c, bytes) else str(c) for c in order]
    return [k for k in group if k != index and not k.startswith("__")]


@dataclasses.dataclass(frozen=True)
class ObsColumn:
    """One obs column as arrays a model can use.

    Attributes:
        values: Integer codes for categorical, string and boolean columns
            (-1 where missing), otherwise the numeric values (nullable
            integers become float64 with NaN where missing).
        categories: The category labels codes index into, or None for numeric
            columns.
    """

    values: np.ndarray
    categories: np.ndarray | None


def read_obs_column(f: h5py.File, name: str) -> ObsColumn:
    """Reads one obs column through anndata's element reader.

    Raises:
        errors.MissingColumnError: No such column; the message lists the
            columns that exist.
        errors.AnnDataFormatError: The column cannot be read (a malformed or
            truncated element) or its length differs from obs's index.
        errors.UnsupportedLayoutError: The column's dtype is not usable.
    """
    path = f.filename
    group = f["obs"]
    if name not in group or name.startswith("__"):
        raise errors.MissingColumnError(
            f"{path}: obs has no column {name!r}; it has {obs_columns(f)}"
        )
    elem = group[name]
    try:
        with warnings.catch_warnings():
            # Legacy files are expected input; anndata's warning is not
            # actionable at every read.
            warnings.simplefilter("ignore", anndata.OldFormatWarning)
            if isinstance(elem, h5py.Dataset) and "categories" in elem.attrs:
                # anndata < 0.8 stored codes here and categories under
                # obs/__categories; only the whole-dataframe reader resolves
                # that reference.
                series = read_elem(group)[name]
            else:
                series = read_elem(elem)
    except Exception as e:  # anndata and h5py raise many types here
        raise errors.AnnDataFormatError(
            f"{path}: obs column {name!r} cannot be read as an anndata element "
            f"({type(e).__name__}: {e}); the file may be corrupt"
        ) from e
    column = _to_column(path, name, series)
    shape = column.values.shape
    if len(shape) != 1:
        raise errors.AnnDataFormatError(
            f"{path}: obs column {name!r} has shape {shape}; expected one value "
            "per cell (1-D)"
        )
    n_rows = _n_rows_of_frame(group)
    if n_rows is not None and shape[0] != n_rows:
        raise errors.AnnDataFormatError(
            f"{path}: obs column {name!r} has {shape[0]} values; obs's index "
            f"has {n_rows} cells"
        )
    return column


def _to_column(path: str, name: str, values) -> ObsColumn:
    if isinstance(values, pd.Series):
        values = values.array
    if isinstance(values, pd.Categorical):
        codes = np.asarray(values.codes)
        return ObsColumn(codes, np.asarray(values.categories))
    if isinstance(values, pd.api.extensions.ExtensionArray):
        dtype = values.dtype
        if pd.api.types.is_bool_dtype(dtype) or pd.api.types.is_string_dtype(dtype):
            return _factorize(values)
        if pd.api.types.is_integer_dtype(dtype) or pd.api.types.is_float_dtype(dtype):
            return ObsColumn(values.to_numpy(dtype=np.float64, na_value=np.nan), None)
        raise errors.UnsupportedLayoutError(
            f"{path}: obs column {name!r} has dtype {dtype}; expected categorical, "
            "string, boolean or numeric"
        )
    arr = np.asarray(values)
    if arr.dtype.kind in "OUSb":
        return _factorize(arr)
    if arr.dtype.kind in "iuf":
        return ObsColumn(arr, None)
    raise errors.UnsupportedLayoutError(
        f"{path}: obs column {name!r} has dtype {arr.dtype}; expected "
        "categorical, string, boolean or numeric"
    )


def _factorize(values) -> ObsColumn:
    codes, uniques = pd.factorize(values, sort=True, use_na_sentinel=True)
    return ObsColumn(codes.astype(np.int32), np.asarray(uniques))


def resolve_paths(paths) -> list[str]:
    """Normalises one path or a sequence of paths to a list of str.

    Raises:
        ValueError: The list is empty.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = [os.fspath(pathlib.Path(p)) for p in paths]
    if not out:
        raise ValueError("paths is empty: expected one or more .h5ad files")
    return out
