"""Cell selection: views over the runs of selected cells, as block tables.

A block never straddles a file nor a gap in the selection, so every read stays
one contiguous slice; scattered cells make many short blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from grain_cells import errors
from grain_cells.source._table import BlockTable

_LOOKUP_CELLS = 1 << 20
_RUN_WINDOW = 1 << 22  # rows per window of runs_of_mask


def runs_of_mask(
    mask: np.ndarray, cell_offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The runs of True in `mask`, cut at file boundaries, as `(starts, stops)`."""
    mask = np.asarray(mask, bool)
    n = mask.size
    starts, stops = [], []
    for a in range(0, n, _RUN_WINDOW):  # a window at a time: no mask-sized temporaries
        b = min(n, a + _RUN_WINDOW)
        edges = (a > 0 and mask[a - 1], b < n and mask[b])
        step = np.diff(mask[a:b].astype(np.int8), prepend=edges[0], append=edges[1])
        starts.append(np.flatnonzero(step[:-1] == 1) + a)
        stops.append(np.flatnonzero(step[1:] == -1) + a + 1)
    inner = np.unique(np.asarray(cell_offsets[1:-1], np.int64))
    inner = inner[(inner > 0) & (inner < n)]
    cut = inner[mask[inner - 1] & mask[inner]]  # a run across two files: two runs
    starts, stops = np.concatenate([*starts, cut]), np.concatenate([*stops, cut])
    return np.sort(starts).astype(np.int64), np.sort(stops).astype(np.int64)


def selected_blocks(source, cells=None, where=None) -> BlockTable:
    """The block table of `source.select(cells, where=where)`."""
    return blocks_of_mask(source.block_table, selection_mask(source, cells, where))


def blocks_of_mask(table: BlockTable, mask: np.ndarray) -> BlockTable:
    """A view of `table`'s files: blocks over the runs of True in `mask`."""
    return table.with_runs(*runs_of_mask(mask, table.cell_offsets))


def obs_column(source, column: str, named: str) -> tuple[np.ndarray, np.ndarray | None]:
    """`(values, categories)` of an obs column; MissingColumnError names `named`."""
    if column not in source.obs_columns:
        raise errors.MissingColumnError(
            f"{named}{column!r} is not one of the source's obs_columns "
            f"{list(source.obs_columns)}; build the AnnDataSource with "
            "obs_columns including it"
        )
    return source.obs_values(column), source.categories[column]


def where_mask(
    source,
    column: str,
    condition: Sequence | np.ndarray | Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """One bool per global row: whether its value in `column` meets `condition`.

    `condition`: labels or values to keep, or an elementwise predicate (on the
    category labels of a categorical column; a missing label never matches).
    """
    values, categories = obs_column(source, column, f"where={{{column!r}: ...}}: ")
    if categories is None:  # numeric
        if callable(condition):
            return _predicate(condition, values, column, "values")
        return np.isin(values, np.asarray(condition))
    if callable(condition):
        keep = _predicate(condition, np.asarray(categories), column, "categories")
    else:
        keep = np.isin(categories, _labels(condition, categories, column))
    # The last entry answers the missing code -1 (indexing from the end).
    table = np.append(keep, False)
    out = np.empty(values.shape, bool)
    for a in range(0, values.size, _LOOKUP_CELLS):  # small index temporaries
        out[a : a + _LOOKUP_CELLS] = table[values[a : a + _LOOKUP_CELLS]]
    return out


def _labels(condition, categories: np.ndarray, column: str) -> np.ndarray:
    if isinstance(condition, (str, bytes)) or not isinstance(
        condition, (Sequence, np.ndarray, set, frozenset)
    ):
        raise TypeError(
            f"where[{column!r}] must be a list of labels or a callable, got "
            f"{condition!r}"
        )
    wanted = np.asarray(list(condition), dtype=object)
    unknown = wanted[~np.isin(wanted, categories)]
    if unknown.size:
        shown = categories[:20].tolist()
        more = f" (and {categories.size - 20} more)" if categories.size > 20 else ""
        raise ValueError(
            f"where[{column!r}]: {unknown.tolist()} not among the column's "
            f"categories {shown}{more}"
        )
    return wanted


def _predicate(fn, values: np.ndarray, column: str, what: str) -> np.ndarray:
    out = np.asarray(fn(values))
    if out.shape != values.shape or out.dtype != bool:
        raise ValueError(
            f"where[{column!r}]: the predicate must return one bool per "
            f"{what[:-1]} (shape {values.shape}), got dtype {out.dtype} and "
            f"shape {out.shape}"
        )
    return out


def selection_mask(source, cells=None, where=None) -> np.ndarray:
    """One bool per global row: the source's own cells that match every condition."""
    n = source.num_cells
    mask = source.block_table.cell_mask()
    if cells is not None:
        cells = np.asarray(cells)
        if cells.dtype == bool:
            if cells.shape != (n,):
                raise ValueError(
                    f"cells: a boolean mask needs one value per cell of the files "
                    f"(shape ({n},)), got shape {cells.shape}"
                )
            mask &= cells
        elif cells.dtype.kind in "iu":
            rows = cells.reshape(-1).astype(np.int64)
            if rows.size and (rows.min() < 0 or rows.max() >= n):
                bad = int(rows[(rows < 0) | (rows >= n)][0])
                raise ValueError(
                    f"cells: row id {bad} out of range; the files hold {n} cells"
                )
            chosen = np.zeros(n, bool)
            chosen[rows] = True
            mask &= chosen
        else:
            raise TypeError(
                f"cells must be a boolean mask or integer row ids, got dtype "
                f"{cells.dtype}"
            )
    if where is not None:
        if not isinstance(where, Mapping):
            raise TypeError(
                f"where must map obs column names to conditions, got {where!r}"
            )
        for column, condition in where.items():
            mask &= where_mask(source, column, condition)
    if not mask.any():
        raise ValueError(
            f"the selection holds no cell (where={describe_condition(where)}, cells="
            f"{describe_condition(cells)}, out of {source.num_selected_cells} cells)"
        )
    return mask


def describe_condition(x) -> str:
    """A short text for a condition or selection, for error messages."""
    if isinstance(x, np.ndarray):
        kind = "mask" if x.dtype == bool else "row ids"
        return f"<{kind} of {x.size}>"
    if isinstance(x, Mapping):
        items = (f"{k!r}: {describe_condition(v)}" for k, v in x.items())
        return "{" + ", ".join(items) + "}"
    if callable(x):
        return "<predicate>"
    text = repr(x)
    return text if len(text) < 80 else text[:77] + "..."
