"""obs columns over the files of a source: one code space and one dtype each.

**Categorical** columns (and string and boolean ones, which `grain_cells.io._h5ad`
factorises) get one category list over all files: the first file's categories
in order, then each later file's new ones in order of first appearance. Each
file's codes are remapped into that list when the file opens, so a label has
the same code in every file, whatever order each file lists its categories
in. Code -1 means missing, as in pandas.

Design notes: docs/reference/design.md#io-obs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from grain_cells import errors
from grain_cells.io._h5ad import ObsColumn, obs_column_kinds, read_obs_column

OBS_MISSING = ("error", "fill")


@dataclasses.dataclass(frozen=True)
class ColumnKind:
    """What one file stores for one obs column (its values are not kept).

    Attributes:
        categories: Category labels of a categorical column, None if numeric.
        dtype: dtype of the stored values (codes for categorical columns).
    """

    categories: np.ndarray | None
    dtype: np.dtype

    @classmethod
    def of(cls, column: ObsColumn) -> ColumnKind:
        """The kind of a column read by `h5ad.read_obs_column`."""
        return cls(column.categories, column.values.dtype)

    @classmethod
    def read(
        cls,
        f,
        names: Sequence[str],
        have: list[str] | None = None,
        nodes: dict | None = None,
    ) -> dict[str, ColumnKind]:
        """The kinds of obs columns `names` of open file `f`, from metadata.

        Reads only a categorical column's categories where the encoding
        says the rest (`h5ad.obs_column_kinds`), otherwise the whole column.
        Codes outside the categories are then refused at the first read of
        the codes, not here. `have`: `obs_columns(f)`, when the caller has it;
        `nodes`: filled as `obs_column_kinds` fills it.
        """
        kinds = obs_column_kinds(f, names, have, nodes)
        return {
            c: cls.of(read_obs_column(f, c)) if k is None else cls(*k)
            for c, k in kinds.items()
        }


@dataclasses.dataclass(frozen=True)
class HarmonisedColumn:
    """One obs column, harmonised over the files of a source.

    Attributes:
        name: The column.
        categories: The shared category labels, or None for numeric columns.
        dtype: For numeric columns, the dtype every file's values are cast
            to; None for categorical ones.
        code_maps: Per file, the shared code of each of its codes, or None
            when its codes are already the shared ones (or it lacks the
            column).
        present: Per file, whether it has the column.
    """

    name: str
    categories: np.ndarray | None
    dtype: np.dtype | None
    code_maps: tuple[np.ndarray | None, ...]
    present: tuple[bool, ...]

    def file_values(self, i: int, column: ObsColumn | None, n_obs: int) -> np.ndarray:
        """File `i`'s values (one per cell) in the shared codes or dtype.

        For a file that lacks the column (`column` None), a read-only
        broadcast of the missing value (no memory).
        """
        if column is None:
            if self.categories is None:
                fill = np.array(np.nan, self.dtype)
            else:
                fill = np.array(-1, np.int8)
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
    """One category list (or dtype) per column over all files.

    Args:
        paths: The files, for error messages.
        names: The obs columns.
        kinds: Per file, each column's kind, or None where the file lacks it.
        obs_missing: `"error"` or `"fill"`; with `"error"`, files that lack a
            column must have been refused before.

    Returns:
        Column name to its harmonised description.

    Raises:
        errors.MissingColumnError: No file has a column.
        errors.AnnDataFormatError: A column is categorical in some files and
            numeric in others.
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
        # Files mostly repeat a few category lists (often the very same
        # array): each distinct list is merged and mapped once.
        labels, slot_of = _distinct_lists(per_file)
        merged: list = []
        seen: dict = {}
        for t in labels:  # in order of first appearance, as file by file
            for v in t:
                if v not in seen:
                    seen[v] = len(merged)
                    merged.append(v)
        slot_maps = []
        for t in labels:
            m = np.array([seen[v] for v in t], np.int64)
            slot_maps.append(None if np.array_equal(m, np.arange(m.size)) else m)
        maps = [None if i is None else slot_maps[i] for i in slot_of]
        out[c] = HarmonisedColumn(c, np.asarray(merged), None, tuple(maps), present)
    return out


def _distinct_lists(per_file) -> tuple[list[tuple], list[int | None]]:
    """The distinct category lists (as tuples) and each file's, by position."""
    labels: list[tuple] = []
    slots: dict = {}  # list -> its position in `labels`
    by_id: dict = {}  # id(categories) -> (categories, position)
    slot_of: list[int | None] = []
    for k in per_file:
        if k is None:
            slot_of.append(None)
            continue
        a = k.categories
        hit = by_id.get(id(a))
        if hit is None or hit[0] is not a:
            t = tuple(a.tolist())
            slot = slots.setdefault(t, len(labels))
            if slot == len(labels):
                labels.append(t)
            hit = by_id[id(a)] = (a, slot)
        slot_of.append(hit[1])
    return labels, slot_of
