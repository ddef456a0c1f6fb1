"""obs columns: one file's as codes and labels or values; one code space over files.

A column reads as `anndata.read_h5ad` gives it, through the format alone for
numeric arrays and string categoricals (Grain workers need not import anndata
or pandas). Categorical, string and boolean columns share one category list
over all files: the first file's, then each later file's new ones in order of
first appearance. Code -1 means missing, as in pandas.
Design notes: docs/reference/design.md#io-obs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from grain_cells import errors
from grain_cells.io import _nodes
from grain_cells.io._frames import (
    encoding_of,
    frame_column,
    frame_columns,
    is_legacy_frame,
    n_rows,
)
from grain_cells.io._nodes import file_name

OBS_MISSING = ("error", "fill")


@dataclasses.dataclass(frozen=True)
class ObsColumn:
    """Codes (-1: missing) and `categories`, or numbers (nullable ints: float64)."""

    values: np.ndarray
    categories: np.ndarray | None


def read_obs_column(f, name: str) -> ObsColumn:
    """One obs column as `anndata.read_h5ad` reads it, as codes or values.

    Raises MissingColumnError, AnnDataFormatError or UnsupportedLayoutError.
    """
    nodes: dict = {}
    kind, column = obs_column_kinds(f, [name], nodes=nodes)[name], None
    if kind is not None:  # a numeric array or string categorical: the format reads it
        labels, dtype = kind
        values = np.asarray(nodes[name][...])
        if labels is None:
            column = ObsColumn(values.astype(dtype, copy=False), None)
        elif not values.size or (values.max() < labels.size and values.min() >= -1):
            column = ObsColumn(values, labels)  # else anndata's reader reports it
    if column is None:
        column = _to_column(file_name(f), name, read_obs_values(f, name))
    shape, rows = column.values.shape, n_rows(f["obs"])
    if len(shape) != 1:
        raise errors.AnnDataFormatError(
            f"{file_name(f)}: obs column {name!r} has shape {shape}; expected one "
            "value per cell (1-D)"
        )
    if rows is not None and shape[0] != rows:
        raise errors.AnnDataFormatError(
            f"{file_name(f)}: obs column {name!r} has {shape[0]} values; obs's "
            f"index has {rows} cells"
        )
    return column


def read_obs_values(f, name: str):
    """One obs column as `anndata.read_h5ad` gives it (pandas or NumPy values)."""
    return frame_column(f, "obs", name)


def obs_column_kinds(
    f, names, have: list[str] | None = None, nodes: dict | None = None
) -> dict:
    """Per column `(categories, dtype)` from metadata alone, None where it must read.

    `nodes` gets each plain column's values array (a categorical's codes).
    """
    group, path = _nodes.at(f, "obs"), file_name(f)
    have = frame_columns(group) if have is None else have
    legacy = is_legacy_frame(group)
    rows = None if legacy else n_rows(group)
    out = {}
    for name in names:
        if name not in have or name.startswith("__"):
            raise errors.MissingColumnError(
                f"{path}: obs has no column {name!r}; it has {have}"
            )
        kind = None
        if not legacy:
            kind = _plain_kind(_nodes.checked(_nodes.at(group, name), path))
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
    """`(categories, dtype, length, values array)` of a plain column, else None."""
    encoding = encoding_of(elem)
    if encoding == "array" and _nodes.is_array(elem):
        if elem.ndim != 1 or elem.dtype.kind not in "iuf":
            return None
        return None, np.dtype(elem.dtype).newbyteorder("="), elem.shape[0], elem
    if encoding != "categorical" or not _nodes.is_group(elem):
        return None
    codes, categories = _nodes.get(elem, "codes"), _nodes.get(elem, "categories")
    if not (_nodes.is_array(codes) and _nodes.is_array(categories)):
        return None
    if len(codes.shape) != 1 or len(categories.shape) != 1:
        return None
    if codes.dtype.kind not in "iu" or not _nodes.is_string_array(categories):
        return None
    names = _nodes.format_of(categories).strings(categories)
    return names, np.dtype(codes.dtype), codes.shape[0], codes


def _to_column(path: str, name: str, values) -> ObsColumn:
    import pandas as pd

    types = pd.api.types
    values = values.array if isinstance(values, pd.Series) else values
    if isinstance(values, pd.Categorical):
        return ObsColumn(np.asarray(values.codes), np.asarray(values.categories))
    if isinstance(values, pd.api.extensions.ExtensionArray):
        dtype = values.dtype
        if types.is_bool_dtype(dtype) or types.is_string_dtype(dtype):
            return _factorize(values)
        if types.is_integer_dtype(dtype) or types.is_float_dtype(dtype):
            return ObsColumn(values.to_numpy(dtype=np.float64, na_value=np.nan), None)
    else:
        arr = np.asarray(values)
        dtype = arr.dtype
        if dtype.kind in "OUSTb":  # T: NumPy's StringDType (v3 stores)
            return _factorize(arr)
        if dtype.kind in "iuf":
            return ObsColumn(arr.astype(dtype.newbyteorder("="), copy=False), None)
    raise errors.UnsupportedLayoutError(
        f"{path}: obs column {name!r} has dtype {dtype}; expected categorical, "
        "string, boolean or numeric"
    )


def _factorize(values) -> ObsColumn:
    import pandas as pd

    codes, uniques = pd.factorize(values, sort=True, use_na_sentinel=True)
    return ObsColumn(codes.astype(np.int32), np.asarray(uniques))


@dataclasses.dataclass(frozen=True)
class ColumnKind:
    """One file's column: its categories (None: numeric) and stored dtype."""

    categories: np.ndarray | None
    dtype: np.dtype

    @classmethod
    def read(cls, f, names, have=None, nodes=None) -> dict[str, ColumnKind]:
        """`obs_column_kinds`, reading the columns whose metadata cannot tell."""
        kinds = obs_column_kinds(f, names, have, nodes)
        for c, k in kinds.items():
            if k is None:
                column = read_obs_column(f, c)
                k = column.categories, column.values.dtype
            kinds[c] = cls(*k)
        return kinds


@dataclasses.dataclass(frozen=True)
class HarmonisedColumn:
    """One obs column over the files: shared `categories` or `dtype`, and per file.

    `code_maps[i]`: shared code of each of file i's codes (None: the same).
    """

    name: str
    categories: np.ndarray | None
    dtype: np.dtype | None
    code_maps: tuple[np.ndarray | None, ...]
    present: tuple[bool, ...]

    def file_values(self, i: int, column: ObsColumn | None, n_obs: int) -> np.ndarray:
        """File `i`'s values in the shared codes or dtype (no column: missing)."""
        if column is None:
            numeric = self.categories is None
            fill = np.array(
                np.nan if numeric else -1, self.dtype if numeric else np.int8
            )
            return np.broadcast_to(fill, (n_obs,))
        if self.categories is None:
            return column.values.astype(self.dtype, copy=False)
        code_map = self.code_maps[i]
        if code_map is None:
            return column.values
        codes = column.values
        out = np.where(codes >= 0, code_map[np.maximum(codes, 0)], -1)
        return out.astype(np.min_scalar_type(-max(int(code_map.max(initial=0)), 1)))


def harmonise(
    paths: Sequence[str],
    names: Sequence[str],
    kinds: Sequence[dict[str, ColumnKind | None]],
    obs_missing: str,
) -> dict[str, HarmonisedColumn]:
    """One category list (or dtype) per column over all files (`kinds`: per file).

    Raises MissingColumnError or AnnDataFormatError (categorical here, numeric there).
    """
    out = {}
    for c in names:
        per_file = [k[c] for k in kinds]
        present = tuple(k is not None for k in per_file)
        if not any(present):
            raise errors.MissingColumnError(
                f"obs column {c!r} is in none of the files ({', '.join(paths)}); "
                "obs_missing='fill' fills only files that lack a column others have"
            )
        categorical = [
            i for i, k in enumerate(per_file) if k and k.categories is not None
        ]
        numeric = [i for i, k in enumerate(per_file) if k and k.categories is None]
        if categorical and numeric:
            a, b = categorical[0], numeric[0]
            raise errors.AnnDataFormatError(
                f"obs column {c!r} is categorical in {paths[a]} (dtype "
                f"{per_file[a].categories.dtype}) but numeric in {paths[b]} (dtype "
                f"{per_file[b].dtype}); it must have one kind in every file"
            )
        if numeric:
            dtype = np.result_type(*(per_file[i].dtype for i in numeric))
            if not all(present):
                dtype = np.result_type(dtype, np.float32)  # to hold NaN
            out[c] = HarmonisedColumn(c, None, dtype, (None,) * len(per_file), present)
            continue
        # Files mostly repeat a few category lists (often the very same array,
        # alive in `kinds`, so its id names it): each list is mapped once.
        lists = {id(k.categories): k.categories for k in per_file if k is not None}
        labels = {i: tuple(a.tolist()) for i, a in lists.items()}
        merged = list(dict.fromkeys(v for t in labels.values() for v in t))
        seen, by_list = {v: i for i, v in enumerate(merged)}, {}
        for t in labels.values():
            if t not in by_list:
                m = np.array([seen[v] for v in t], np.int64)
                by_list[t] = None if np.array_equal(m, range(m.size)) else m
        maps = [k and by_list[labels[id(k.categories)]] for k in per_file]
        out[c] = HarmonisedColumn(c, np.asarray(merged), None, tuple(maps), present)
    return out
