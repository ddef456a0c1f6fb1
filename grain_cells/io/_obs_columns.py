"""obs columns as arrays a model can use: codes and categories, or values.

`read_obs_column` reads a column as `anndata.read_h5ad` would (through
anndata's element reader, or through the format alone for numeric arrays and string
categoricals, so Grain workers need not import anndata or pandas);
`obs_column_kinds` tells each column's kind from its metadata alone (a
categorical's categories, never its codes), which is what building a source
needs. Layouts anndata does not read element by element (anndata < 0.7
compound frames, categoricals without encoding attributes) are handled by
`grain_cells.io._frames`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from grain_cells import errors
from grain_cells.io import _nodes
from grain_cells.io._frames import (
    encoding_of,
    frame_columns,
    is_legacy_frame,
    legacy_column,
    legacy_table,
    n_rows,
    obs_columns,
    read_column,
)
from grain_cells.io._nodes import file_name


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
    """The column exists; its arrays agree with their metadata (stores)."""
    if name not in obs_columns(f) or name.startswith("__"):
        raise errors.MissingColumnError(
            f"{file_name(f)}: obs has no column {name!r}; it has {obs_columns(f)}"
        )
    if not is_legacy_frame(f["obs"]):
        _nodes.checked(f["obs"][name], file_name(f))


def _obs_values(f, name: str):
    group = f["obs"]
    if is_legacy_frame(group):
        return legacy_column(f, legacy_table(file_name(f), group), name)
    return read_column(file_name(f), group, name)


def obs_column_kind(f, name: str):
    """`obs_column_kinds` of one column."""
    return obs_column_kinds(f, [name])[name]


def obs_column_kinds(
    f, names, have: list[str] | None = None, nodes: dict | None = None
) -> dict:
    """Obs columns' kinds from their metadata alone, None where it must read.

    Reads the categories of a categorical column (small), never its codes
    nor a numeric column's values: the common encodings of `_plain_kind`.
    Codes outside the categories are found when the codes are read
    (`read_obs_column`, at the first read of the file's cells).

    Args:
        f: The open file.
        names: The columns.
        have: `obs_columns(f)`, when the caller has it.
        nodes: If given, filled with each plain column's array of values
            (a categorical's codes), for callers that locate its bytes
            (`grain_cells.io._layout_cache`) without looking it up again.

    Returns:
        Per column, `(categories, dtype)` as `read_obs_column` would give
        them (`categories` None for a numeric column; `dtype` that of its
        codes or values), or None when only reading the column tells
        (legacy frames, strings, booleans, nullable and other encodings).

    Raises:
        errors.MissingColumnError: No such column.
        errors.AnnDataFormatError: A column's length differs from obs's index.
    """
    group, path = _nodes.at(f, "obs"), file_name(f)
    if have is None:
        have = frame_columns(group)
    legacy = is_legacy_frame(group)
    rows = None if legacy else n_rows(group)
    out = {}
    for name in names:
        if name not in have or name.startswith("__"):
            raise errors.MissingColumnError(
                f"{path}: obs has no column {name!r}; it has {have}"
            )
        kind = (
            None
            if legacy
            else _plain_kind(_nodes.checked(_nodes.at(group, name), path))
        )
        if kind is not None:
            categories, dtype, length, values = kind
            if nodes is not None:
                nodes[name] = values
            if rows is not None and length != rows:
                raise errors.AnnDataFormatError(
                    f"{path}: obs column {name!r} has {length} values; obs's "
                    f"index has {rows} cells"
                )
            kind = categories, dtype
        out[name] = kind
    return out


def _plain_kind(elem):
    """`(categories, dtype, length, values)` of a column `_plain_column` reads.

    `values` is the array of its values (a categorical's codes); None for
    any other column.
    """
    encoding = encoding_of(elem)
    if encoding == "array" and _nodes.is_array(elem):
        if elem.ndim != 1 or elem.dtype.kind not in "iuf":
            return None
        return None, np.dtype(elem.dtype).newbyteorder("="), elem.shape[0], elem
    if encoding != "categorical" or not _nodes.is_group(elem):
        return None
    codes, categories = _nodes.get(elem, "codes"), _nodes.get(elem, "categories")
    if not (
        _nodes.is_array(codes)
        and _nodes.is_array(categories)
        and len(codes.shape) == 1
        and len(categories.shape) == 1
        and codes.dtype.kind in "iu"
        and _nodes.is_string_array(categories)
    ):
        return None
    return _nodes.strings(categories), np.dtype(codes.dtype), codes.shape[0], codes


def _plain_column(elem) -> ObsColumn | None:
    """A column read through its format alone, or None: `read_elem`'s to read.

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
    labels, dtype, _, array = kind
    if labels is None:
        return ObsColumn(np.asarray(array[...]).astype(dtype, copy=False), None)
    values = np.asarray(array[...])
    if values.size and (values.max() >= labels.size or values.min() < -1):
        return None  # let anndata's reader report it
    return ObsColumn(values, labels)


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
    if arr.dtype.kind in "OUSTb":  # T: NumPy's StringDType (v3 stores)
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
