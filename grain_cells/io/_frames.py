"""obs and var dataframes on disk: their index, their columns, their length.

Read with anndata's element reader (imported on first use: Grain workers
never need it), plus two layouts it does not read element by element:
anndata < 0.7 compound frames (labels in `uns/<column>_categories`, `raw.X`
and `raw.var`) and categorical groups without `encoding-type` attributes.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np

from grain_cells import errors
from grain_cells.io import _nodes
from grain_cells.io._nodes import file_name


def _anndata_io():
    try:  # anndata >= 0.11
        import anndata.io as elements
    except ImportError:  # pragma: no cover - anndata 0.10
        import anndata.experimental as elements
    return elements


def read_elem(elem):
    """`anndata.io.read_elem` (anndata imported on first use)."""
    return _anndata_io().read_elem(elem)


def write_elem(store, key: str, value) -> None:
    """`anndata.io.write_elem` (anndata imported on first use)."""
    _anndata_io().write_elem(store, key, value)


@contextlib.contextmanager
def _reading(what: str | None = None):
    """Silences anndata's OldFormatWarning (legacy files are expected input).

    `what`: the element read; a failure then raises AnnDataFormatError naming it.
    """
    import anndata

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", anndata.OldFormatWarning)
            yield
    except Exception as e:  # anndata and the formats raise many types here
        if what is None:
            raise
        raise errors.AnnDataFormatError(
            f"{what} ({type(e).__name__}: {e}); the file may be corrupt"
        ) from e


def encoding_of(obj) -> str | None:
    """The `encoding-type` attribute of an element, or None."""
    return _nodes.attr_str(obj, "encoding-type")


def is_legacy_frame(obj) -> bool:
    """Whether a dataframe is an anndata < 0.7 compound dataset."""
    return _nodes.is_array(obj) and np.dtype(obj.dtype).names is not None


def var_group_name(element: str, f=None) -> str:
    """The var dataframe that describes the columns of the matrix `element` (in `f`)."""
    if f is not None and element == "raw/X" and "raw" not in f and "raw.X" in f:
        element = "raw.X"  # anndata < 0.7
    return {"raw/X": "raw/var", "raw.X": "raw.var"}.get(element, "var")


def n_rows(frame) -> int | None:
    """Rows of an obs/var dataframe, without reading it (None: unknown)."""
    if is_legacy_frame(frame):
        return int(frame.shape[0])
    if not _nodes.is_group(frame):
        return None
    index = _nodes.attr_str(frame, "_index")
    node = None if index is None else _nodes.get(frame, index)
    if node is None:
        return None
    if _nodes.is_array(node):
        return int(node.shape[0]) if node.ndim else None
    for key in ("values", "codes"):  # nullable-* arrays, categoricals
        part = _nodes.get(node, key)
        if part is not None and _nodes.is_array(part):
            return int(part.shape[0])
    return None


def legacy_table(path: str, frame) -> np.ndarray:
    what = f"{path}: {frame.name} is an anndata < 0.7 compound dataframe"
    with _reading(f"{what} that cannot be read"):
        return read_elem(frame)


def _frame_index(f, name: str) -> np.ndarray:
    """The index (obs or var names) of the dataframe `name`, as stored."""
    path = file_name(f)
    frame = _nodes.at(f, name)
    if is_legacy_frame(frame):
        table = legacy_table(path, frame)
        return np.asarray(table[table.dtype.names[0]], dtype=str)
    key = _nodes.attr_str(frame, "_index", "_index")
    if not _nodes.is_group(frame) or _nodes.get(frame, key) is None:
        raise errors.AnnDataFormatError(
            f"{path}: {frame.name} has no index element {key!r}"
        )
    node = index = _nodes.checked(_nodes.at(frame, key), path)
    # Plain strings are read by the format: anndata costs 0.7 s to import.
    encoding = encoding_of(index)
    if encoding == "nullable-string-array" and _nodes.is_group(index):
        mask = _nodes.get(index, "mask")
        plain = _nodes.is_array(mask) and mask.ndim == 1
        plain = plain and not np.asarray(mask[...]).any()
        node = _nodes.get(index, "values") if plain else None
    elif encoding not in ("string-array", None):
        node = None
    if _nodes.is_array(node) and node.ndim == 1 and _nodes.is_string_array(node):
        return _nodes.format_of(node).strings(node)
    return np.asarray(read_elem(index))


def read_var_names(f, element: str) -> np.ndarray:
    """Var names (gene ids) of the matrix at `element`, as a str array."""
    names = var_names(f, element)
    return names if names.flags.writeable else names.copy()


# Shared read-only string lists (`Format.strings`) as one str array each, by
# identity: `_genes.shared_keys` then knows them without hashing.
_AS_STR: dict = {}


def var_names(f, element: str) -> np.ndarray:
    """`read_var_names`, read-only and shared by equal lists where it can be."""
    names = _frame_index(f, var_group_name(element, f))
    shared = isinstance(names, np.ndarray) and names.dtype == object
    if not shared or names.flags.writeable:  # not a shared read-only list
        return np.asarray(names, dtype=str)
    held = _AS_STR.get(id(names))
    if held is None or held[0] is not names:
        if len(_AS_STR) >= 64:
            _AS_STR.clear()
        as_str = np.asarray(names, dtype=str)
        as_str.flags.writeable = False
        held = _AS_STR[id(names)] = (names, as_str)
    return held[1]


def read_var_column(f, element: str, column: str):
    """One var column of the matrix at `element`, as `anndata.read_h5ad` gives it.

    Raises MissingColumnError (no such column) or AnnDataFormatError.
    """
    name = var_group_name(element, f)
    values = frame_column(
        f,
        name,
        column,
        f" to take gene keys from (genes_from={column!r})",
        ". Pass genes_from= one of those that every file has, or genes_from=None "
        "to align on var names.",
    )
    rows = n_rows(f[name])
    if rows is not None and len(values) != rows:
        raise errors.AnnDataFormatError(
            f"{file_name(f)}: {name} column {column!r} has {len(values)} values; "
            f"{name}'s index has {rows} genes"
        )
    return values


def read_obs_names(f) -> np.ndarray:
    """Obs names (cell ids) as an object array of the stored strings."""
    names = np.asarray(_frame_index(f, "obs"), dtype=object)
    return names if names.flags.writeable else names.copy()


def obs_columns(f) -> list[str]:
    """Names of the obs columns stored in the file."""
    return frame_columns(_nodes.at(f, "obs"))


def frame_columns(group) -> list[str]:
    """Names of the columns of a stored obs or var dataframe."""
    if is_legacy_frame(group):
        return list(group.dtype.names[1:])
    if not _nodes.is_group(group):
        return []
    index = _nodes.attr_str(group, "_index", "_index")
    order = _nodes.attr(group, "column-order")
    if order is not None and len(order):
        return [c.decode() if isinstance(c, bytes) else str(c) for c in order]
    return [k for k in group if k != index and not k.startswith("__")]


def frame_column(f, frame: str, name: str, why: str = "", fix: str = ""):
    """Column `name` of the dataframe `frame` as `anndata.read_h5ad` gives it.

    Raises MissingColumnError (`why` and `fix` added) or AnnDataFormatError.
    """
    import pandas as pd

    path, group = file_name(f), f[frame]
    have = frame_columns(group)
    if name not in have or name.startswith("__"):
        raise errors.MissingColumnError(
            f"{path}: {frame} has no column {name!r}{why}; it has {have}{fix}"
        )
    if is_legacy_frame(group):  # anndata < 0.7: labels in uns/<name>_categories
        values = legacy_table(path, group)[name]
        cats = _nodes.get(f, f"uns/{name}_categories")
        if not _nodes.is_array(cats):
            return values
        with _reading():
            cats = np.asarray(read_elem(cats)).reshape(-1)
        cats = cats.astype(str) if cats.dtype.kind == "S" else cats
        # anndata's rule (`_clean_uns`): only when every code indexes a label.
        if values.dtype.kind in "iu" and np.all(values < len(cats)):
            return pd.Categorical.from_codes(values, cats)
        return values
    elem = _nodes.checked(group[name], path)
    what = f"{path}: obs column {name!r} cannot be read as an anndata element"
    with _reading(what):
        if _nodes.is_array(elem) and "categories" in elem.attrs:
            # anndata < 0.8: categories under obs/__categories, which
            # only the whole-dataframe reader resolves.
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
