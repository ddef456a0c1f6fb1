"""obs and var dataframes on disk: their index, their columns, their length.

Dataframes go through anndata's own element reader (`anndata.io.read_elem`),
which knows every encoding anndata has written since 0.7, including the
`nullable-string-array` groups that anndata >= 0.11 writes for string
indexes and columns (the default under pandas 3). Two layouts it does not
read element by element are handled here:

* **anndata < 0.7** stored obs and var as one compound (structured) HDF5
  dataset whose first field is the index, categorical columns as integer
  codes with their labels in `uns/<column>_categories`, and `raw` as the
  root elements `raw.X` and `raw.var`. `read_elem` decodes the compound
  dataset; the index and categories are applied as `anndata.read_h5ad` does
  (codes become a categorical only when every code indexes the labels).
* A categorical column group **without `encoding-type` attributes** (written
  by hand-rolled writers) is read from its `codes` and `categories`.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from grain_cells import errors
from grain_cells.io import _nodes
from grain_cells.io._nodes import file_name

# anndata and pandas (0.7 s to import) are imported only where they are
# needed (uncommon index and obs encodings), not with the package: every
# Grain worker imports the package and opens the files again
# (`tests/test_loader.py::test_workers_do_not_import_anndata_or_pandas`).


def _anndata_io():
    """The module of anndata's element readers and writers, imported on first use."""
    try:  # anndata >= 0.11
        import anndata.io as elements
    except ImportError:  # pragma: no cover - anndata 0.10
        import anndata.experimental as elements
    return elements


def read_elem(elem):
    """`anndata.io.read_elem` of an HDF5 element (anndata imported on first use)."""
    return _anndata_io().read_elem(elem)


def write_elem(store, key: str, value) -> None:
    """`anndata.io.write_elem` (anndata imported on first use)."""
    _anndata_io().write_elem(store, key, value)


def _quiet_old_format() -> None:
    """Silences anndata's OldFormatWarning in the enclosing catch_warnings."""
    import anndata

    warnings.simplefilter("ignore", anndata.OldFormatWarning)


def encoding_of(obj) -> str | None:
    """The `encoding-type` attribute of an element, or None."""
    value = obj.attrs.get("encoding-type")
    if isinstance(value, bytes):
        value = value.decode()
    return value


_attr_str = _nodes.attr_str


def is_legacy_frame(obj) -> bool:
    """Whether a dataframe is an anndata < 0.7 compound dataset."""
    return _nodes.is_array(obj) and np.dtype(obj.dtype).names is not None


def var_group_name(element: str) -> str:
    """The var dataframe that describes the columns of the matrix `element`."""
    if element == "raw/X":
        return "raw/var"
    if element == "raw.X":  # anndata < 0.7
        return "raw.var"
    return "var"


def _element_length(obj) -> int | None:
    """Entries of a 1-D array element (dataset or encoded group), unread."""
    if _nodes.is_array(obj):
        return int(obj.shape[0]) if obj.ndim else None
    for key in ("values", "codes"):  # nullable-* arrays, categoricals
        if key in obj and _nodes.is_array(obj[key]):
            return int(obj[key].shape[0])
    return None


def n_rows(frame) -> int | None:
    """Rows of an obs/var dataframe, without reading it (None: unknown)."""
    if is_legacy_frame(frame):
        return int(frame.shape[0])
    if not _nodes.is_group(frame):
        return None
    index = _attr_str(frame, "_index")
    if index is not None and index in frame:
        return _element_length(frame[index])
    return None


def _legacy_table(path: str, frame) -> np.ndarray:
    try:
        with warnings.catch_warnings():
            _quiet_old_format()
            return read_elem(frame)
    except Exception as e:  # anndata and the formats raise many types here
        raise errors.AnnDataFormatError(
            f"{path}: {frame.name} is an anndata < 0.7 compound dataframe that "
            f"cannot be read ({type(e).__name__}: {e}); the file may be corrupt"
        ) from e


def _frame_index(f, name: str) -> np.ndarray:
    """The index (obs or var names) of the dataframe `name`, as stored."""
    path = file_name(f)
    frame = f[name]
    if is_legacy_frame(frame):
        table = _legacy_table(path, frame)
        return np.asarray(table[table.dtype.names[0]], dtype=str)
    key = _attr_str(frame, "_index", "_index")
    if not _nodes.is_group(frame) or key not in frame:
        raise errors.AnnDataFormatError(
            f"{path}: {frame.name} has no index element {key!r}"
        )
    index = _nodes.checked(frame[key], path)
    names = _plain_strings(index)
    if names is not None:
        return names
    return np.asarray(read_elem(index))


def _plain_strings(index) -> np.ndarray | None:
    """An index's strings read with h5py or zarr, or None for anndata to read.

    What anndata reads from a `string-array` (anndata < 0.11, and later
    under pandas 2) and from a `nullable-string-array` without missing
    entries (anndata >= 0.11 under pandas 3), without importing anndata and
    pandas: about 0.7 s, most of a fresh process's first minibatch.
    """
    encoding = encoding_of(index)
    if encoding == "nullable-string-array" and _nodes.is_group(index):
        mask = index.get("mask")
        if not _nodes.is_array(mask) or mask.ndim != 1 or np.asarray(mask[...]).any():
            return None
        index = index.get("values")
    elif encoding not in ("string-array", None):
        return None
    if _nodes.is_array(index) and index.ndim == 1 and _nodes.is_string_array(index):
        return _nodes.strings(index)
    return None


def read_var_names(f, element: str) -> np.ndarray:
    """Var names (gene ids) of the matrix at `element`, as a str array."""
    return np.asarray(_frame_index(f, _var_frame(f, element)), dtype=str)


def _var_frame(f, element: str) -> str:
    if element == "raw/X" and "raw" not in f and "raw.X" in f:
        element = "raw.X"  # anndata < 0.7
    return var_group_name(element)


def read_var_column(f, element: str, column: str):
    """One var column of the matrix at `element`, as `anndata.read_h5ad` gives it.

    Read with anndata's reader (every encoding, anndata < 0.7 compound
    frames included); `grain_cells.io._genes.read_gene_keys` makes gene keys
    of it.

    Raises:
        errors.MissingColumnError: var has no such column (the message lists
            the columns it has and the fix).
        errors.AnnDataFormatError: The column cannot be read, or its length
            is not var's.
    """
    path, name = file_name(f), _var_frame(f, element)
    group = f[name]
    have = frame_columns(group)
    if column not in have or column.startswith("__"):
        raise errors.MissingColumnError(
            f"{path}: {name} has no column {column!r} to take gene keys from "
            f"(genes_from={column!r}); it has {have}. Pass genes_from= one of "
            "those that every file has, or genes_from=None to align on var names."
        )
    if is_legacy_frame(group):
        values = _legacy_column(f, _legacy_table(path, group), column)
    else:
        _nodes.checked(group[column], path)
        values = _read_column(path, group, column)
    rows = n_rows(group)
    if rows is not None and len(values) != rows:
        raise errors.AnnDataFormatError(
            f"{path}: {name} column {column!r} has {len(values)} values; "
            f"{name}'s index has {rows} genes"
        )
    return values


def read_obs_names(f) -> np.ndarray:
    """Obs names (cell ids) as an object array of the stored strings."""
    return np.asarray(_frame_index(f, "obs"), dtype=object)


def obs_columns(f) -> list[str]:
    """Names of the obs columns stored in the file."""
    return frame_columns(f["obs"])


def frame_columns(group) -> list[str]:
    """Names of the columns of a stored obs or var dataframe."""
    if is_legacy_frame(group):
        return list(group.dtype.names[1:])
    if not _nodes.is_group(group):
        return []
    index = _attr_str(group, "_index", "_index")
    order = group.attrs.get("column-order")
    if order is not None and len(order):
        return [c.decode() if isinstance(c, bytes) else str(c) for c in order]
    return [k for k in group if k != index and not k.startswith("__")]


@dataclasses.dataclass(frozen=True)
class ObsColumn:
    """One obs column as arrays a model can use.

    Attributes:
        values: Integer codes for categorical, string and boolean columns
            (-1 where missing), otherwise the numeric values in their stored
            dtype (nullable integers become float64 with NaN where missing).
        categories: The category labels codes index into, or None for numeric
            columns.
    """

    values: np.ndarray
    categories: np.ndarray | None


def read_obs_column(f, name: str) -> ObsColumn:
    """Reads one obs column as `anndata.read_h5ad` would.

    Raises:
        errors.MissingColumnError: No such column; the message lists the
            columns that exist.
        errors.AnnDataFormatError: The column cannot be read (a malformed or
            truncated element) or its length differs from obs's index.
        errors.UnsupportedLayoutError: The column's dtype is not usable.
    """
    path = file_name(f)
    group = f["obs"]
    _check_column(f, name)
    column = None if is_legacy_frame(group) else _plain_column(group[name])
    if column is None:
        column = _to_column(path, name, _obs_values(f, name))
    shape = column.values.shape
    if len(shape) != 1:
        raise errors.AnnDataFormatError(
            f"{path}: obs column {name!r} has shape {shape}; expected one value "
            "per cell (1-D)"
        )
    rows = n_rows(group)
    if rows is not None and shape[0] != rows:
        raise errors.AnnDataFormatError(
            f"{path}: obs column {name!r} has {shape[0]} values; obs's index "
            f"has {rows} cells"
        )
    return column


def read_obs_values(f, name: str):
    """One obs column as `anndata.read_h5ad` gives it (pandas or NumPy values).

    The one reader of obs columns: `read_obs_column` turns its result into
    codes and labels; `preshuffle` keeps the pandas objects to write them
    again. Handles anndata < 0.7 compound frames, anndata < 0.8 categorical
    codes, and categorical groups without encoding attributes.

    Raises:
        errors.MissingColumnError: No such column; the message lists the
            columns that exist.
        errors.AnnDataFormatError: The column cannot be read.
    """
    _check_column(f, name)
    return _obs_values(f, name)


def _check_column(f, name: str) -> None:
    """The column exists; a zarr column's arrays agree with their metadata."""
    if name not in obs_columns(f) or name.startswith("__"):
        raise errors.MissingColumnError(
            f"{file_name(f)}: obs has no column {name!r}; it has {obs_columns(f)}"
        )
    if not is_legacy_frame(f["obs"]):
        _nodes.checked(f["obs"][name], file_name(f))


def _obs_values(f, name: str):
    group = f["obs"]
    if is_legacy_frame(group):
        return _legacy_column(f, _legacy_table(file_name(f), group), name)
    return _read_column(file_name(f), group, name)


def obs_column_kind(f, name: str):
    """`obs_column_kinds` of one column."""
    return obs_column_kinds(f, [name])[name]


def obs_column_kinds(f, names) -> dict:
    """Obs columns' kinds from their metadata alone, None where it must read.

    Reads the categories of a categorical column (small), never its codes
    nor a numeric column's values: the common encodings of `_plain_kind`.
    Codes outside the categories are found when the codes are read
    (`read_obs_column`, at the first read of the file's cells).

    Returns:
        Per column, `(categories, dtype)` as `read_obs_column` would give
        them (`categories` None for a numeric column; `dtype` that of its
        codes or values), or None when only reading the column tells
        (legacy frames, strings, booleans, nullable and other encodings).

    Raises:
        errors.MissingColumnError: No such column.
        errors.AnnDataFormatError: A column's length differs from obs's index.
    """
    group, path = f["obs"], file_name(f)
    have = frame_columns(group)
    legacy = is_legacy_frame(group)
    rows = None if legacy else n_rows(group)
    out = {}
    for name in names:
        if name not in have or name.startswith("__"):
            raise errors.MissingColumnError(
                f"{path}: obs has no column {name!r}; it has {have}"
            )
        kind = None if legacy else _plain_kind(_nodes.checked(group[name], path))
        if kind is not None:
            categories, dtype, length = kind
            if rows is not None and length != rows:
                raise errors.AnnDataFormatError(
                    f"{path}: obs column {name!r} has {length} values; obs's "
                    f"index has {rows} cells"
                )
            kind = categories, dtype
        out[name] = kind
    return out


def _plain_kind(elem):
    """`(categories, dtype, length)` of a column `_plain_column` reads, or None."""
    encoding = encoding_of(elem)
    if encoding == "array" and _nodes.is_array(elem):
        if elem.ndim != 1 or elem.dtype.kind not in "iuf":
            return None
        return None, np.dtype(elem.dtype).newbyteorder("="), elem.shape[0]
    if encoding != "categorical" or not _nodes.is_group(elem):
        return None
    codes, categories = elem.get("codes"), elem.get("categories")
    if not (
        _nodes.is_array(codes)
        and _nodes.is_array(categories)
        and codes.ndim == 1
        and categories.ndim == 1
        and codes.dtype.kind in "iu"
        and _nodes.is_string_array(categories)
    ):
        return None
    return _nodes.strings(categories), np.dtype(codes.dtype), codes.shape[0]


def _plain_column(elem) -> ObsColumn | None:
    """A column read with h5py alone, or None: `read_elem`'s to read.

    The common cases need neither anndata nor pandas, which Grain workers,
    opening the files again, would otherwise import for them: a numeric
    `encoding-type: array` dataset, and a categorical (anndata >= 0.7: a
    group of integer `codes` and a string `categories` dataset). The result
    is what `_to_column` makes of `anndata.io.read_elem`'s
    (`tests/test_source.py` compares); every other encoding goes through
    `read_elem`.
    """
    kind = _plain_kind(elem)
    if kind is None:
        return None
    labels, dtype, _ = kind
    if labels is None:
        return ObsColumn(np.asarray(elem[...]).astype(dtype, copy=False), None)
    values = np.asarray(elem["codes"][...])
    if values.size and (values.max() >= labels.size or values.min() < -1):
        return None  # let anndata's reader report it
    return ObsColumn(values, labels)


def _read_column(path: str, group, name: str):
    import pandas as pd

    elem = group[name]
    try:
        with warnings.catch_warnings():
            # Legacy files are expected input; anndata's warning is not
            # actionable at every read.
            _quiet_old_format()
            if _nodes.is_array(elem) and "categories" in elem.attrs:
                # anndata < 0.8 stored codes here and categories under
                # obs/__categories; only the whole-dataframe reader resolves
                # that reference.
                return read_elem(group)[name]
            if (
                _nodes.is_group(elem)
                and encoding_of(elem) is None
                and {"codes", "categories"} <= set(elem)
            ):
                # A categorical written without encoding attributes.
                return pd.Categorical.from_codes(
                    np.asarray(read_elem(elem["codes"])),
                    pd.Index(read_elem(elem["categories"])),
                    ordered=bool(elem.attrs.get("ordered", False)),
                )
            return read_elem(elem)
    except Exception as e:  # anndata and the formats raise many types here
        raise errors.AnnDataFormatError(
            f"{path}: obs column {name!r} cannot be read as an anndata element "
            f"({type(e).__name__}: {e}); the file may be corrupt"
        ) from e


def _legacy_column(f, table: np.ndarray, name: str):
    """A column of an anndata < 0.7 compound obs, categories applied."""
    import pandas as pd

    values = table[name]
    cats_name = f"uns/{name}_categories"
    if cats_name in f and _nodes.is_array(f[cats_name]):
        with warnings.catch_warnings():
            _quiet_old_format()
            cats = np.asarray(read_elem(f[cats_name])).reshape(-1)
        if cats.dtype.kind == "S":
            cats = cats.astype(str)
        # anndata's rule (`_clean_uns`): codes become a categorical only when
        # they all index the labels.
        if values.dtype.kind in "iu" and np.all(values < len(cats)):
            return pd.Categorical.from_codes(values, cats)
    return values


def _to_column(path: str, name: str, values) -> ObsColumn:
    import pandas as pd

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
    if arr.dtype.kind in "OUSTb":  # T: NumPy's StringDType (zarr strings)
        return _factorize(arr)
    if arr.dtype.kind in "iuf":
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        return ObsColumn(arr, None)
    raise errors.UnsupportedLayoutError(
        f"{path}: obs column {name!r} has dtype {arr.dtype}; expected "
        "categorical, string, boolean or numeric"
    )


def _factorize(values) -> ObsColumn:
    import pandas as pd

    codes, uniques = pd.factorize(values, sort=True, use_na_sentinel=True)
    return ObsColumn(codes.astype(np.int32), np.asarray(uniques))
