"""Cell selection and deterministic train/validation/test splits.

**Selection.** `AnnDataSource.select(cells, where=...)` keeps the cells that
match a boolean mask, a list of row ids and/or obs predicates, and returns a
*view*: an `AnnDataSource` over the same files whose records are blocks over
the *runs* of selected cells (`blocks_over_runs`). A block never straddles a
file nor a gap in the selection, so every read stays one contiguous slice; a
run shorter than `block_size` (or a run's tail) makes a short block, and a
selection of scattered cells makes many short blocks, each a separate read.

Everything is vectorised over cells (no Python loop per cell). Memory while a
selection or a split is built: a few boolean masks (1 byte per cell of the
files each), the obs columns asked about (`AnnDataSource.obs_values`: codes
in the smallest integer type that holds them) and, for splits by group or by
`unit_cells`, int64 indices (8 bytes per cell, a few of them); kept
afterwards: the view's block table, 16 bytes per block.

Short blocks cost throughput, not correctness: `fetch_operations` groups a
fixed number of blocks per fetch, so a fetch of short blocks holds fewer
cells and its last minibatch is padded (`mask` False) or dropped. A selection
of scattered cells is better served by a pre-shuffled or filtered copy
(`grain_cells.preshuffle`) than by blocks of one or two cells.

**Splits.** Each split is a view, usable as its own data source with its own
`BlockSampler` or `WeightedBlockSampler` and `fetch_operations`. Splits
depend only on the source, the arguments and the seed, never on worker or
shard counts or on any position in a stream: they are disjoint, and together
they cover the source's cells (a view's selection).

* `split_by_fraction(source, {"train": 0.8, "val": 0.1, "test": 0.1}, seed=0)`
  assigns *units* to splits by a seeded hash of each unit's key, cutting the
  hash order at the fractions of cells (each split is within one unit of
  its fraction). The unit is, by default, one block of the source (reads stay
  whole blocks); `unit_cells=n` uses a fixed grid of `n` rows per file
  instead, so the split does not change with `block_size`; `by="donor"`
  uses the groups of an obs column (a donor, a plate, a study goes wholly to
  one split).
* `split_by_obs(source, "donor", {"val": ["D3"], "test": ["D7"]},
  rest="train")` holds out the cells with the given labels.

Example:
    >>> source = grain_cells.AnnDataSource(paths, obs_columns=["donor"])
    >>> splits = grain_cells.split_by_fraction(
    ...     source, {"train": 0.9, "val": 0.1}, seed=0, by="donor")
    >>> train = splits["train"]                 # an AnnDataSource view
    >>> sampler = grain_cells.BlockSampler(train, seed=0, num_epochs=None)
    >>> ops = grain_cells.fetch_operations(train, batch_size=64)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from grain_cells import arguments, counter_rng, errors

if TYPE_CHECKING:
    from grain_cells.block_table import BlockTable
    from grain_cells.source import AnnDataSource

_FRACTION_TOLERANCE = 1e-6


# -- blocks over runs ---------------------------------------------------------


def blocks_over_runs(
    mask: np.ndarray, cell_offsets: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of up to `block_size` cells over the runs of True in `mask`.

    A run is a maximal stretch of consecutive selected rows within one file.
    Each run is cut into blocks of `block_size` rows from its start; its last
    block may be short.

    Example:
        >>> blocks_over_runs(np.array([1, 1, 1, 0, 1], bool), np.array([0, 5]), 2)
        (array([0, 2, 4]), array([2, 3, 5]))

    Args:
        mask: One bool per global row.
        cell_offsets: Each file's first global row, plus the total.
        block_size: Most rows per block.

    Returns:
        `(starts, stops)`: int64 global row ranges, sorted.
    """
    mask = np.asarray(mask, bool)
    n = mask.size
    inner = np.asarray(cell_offsets[1:-1], np.int64)
    inner = inner[(inner > 0) & (inner < n)]
    # A run starts where a selected row follows an unselected one or a file
    # boundary, and stops likewise.
    begins = mask.copy()
    begins[1:] &= ~mask[:-1]
    begins[inner] = mask[inner]
    run_starts = np.flatnonzero(begins)
    begins[:] = mask
    begins[:-1] &= ~mask[1:]
    begins[inner - 1] = mask[inner - 1]
    run_stops = np.flatnonzero(begins) + 1
    lengths = run_stops - run_starts
    per_run = -(-lengths // block_size)
    # Block j of run r starts at run_starts[r] + j * block_size.
    run_of_block = np.repeat(np.arange(run_starts.size), per_run)
    first_block = np.cumsum(per_run) - per_run
    j = np.arange(run_of_block.size, dtype=np.int64) - first_block[run_of_block]
    starts = run_starts[run_of_block] + j * block_size
    stops = np.minimum(starts + block_size, run_stops[run_of_block])
    return starts.astype(np.int64), stops.astype(np.int64)


def cell_mask(source: AnnDataSource) -> np.ndarray:
    """One bool per global row: whether one of the source's blocks holds it."""
    return source.block_table.cell_mask()


def selected_blocks(source: AnnDataSource, cells=None, where=None) -> BlockTable:
    """The block table of `source.select(cells, where=where)`.

    A pure function of the source's cells, obs columns and the arguments:
    blocks over the runs of matching cells (`blocks_over_runs`).

    Args:
        source: The source (a view selects only among its own cells).
        cells: A boolean mask over `num_cells`, or global row ids, or None.
        where: Mapping of obs column to a condition (see `where_mask`).

    Raises:
        See `selection_mask`.
    """
    mask = selection_mask(source, cells, where)
    table = source.block_table
    return table.with_blocks(
        *blocks_over_runs(mask, table.cell_offsets, table.block_size)
    )


# -- selection -----------------------------------------------------------------


def where_mask(
    source: AnnDataSource,
    column: str,
    condition: Sequence | np.ndarray | Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """One bool per global row: whether its value in `column` matches.

    Args:
        source: The source whose obs column is read (`obs_values`).
        column: One of `source.obs_columns`.
        condition: The labels (categorical columns) or values (numeric ones)
            to keep, or an elementwise predicate returning one bool per value.
            For a categorical column the predicate is called once, on the
            array of category labels (`source.categories[column]`), and cells
            with a missing label (code -1) never match.

    Returns:
        A bool array of `source.num_cells`.

    Raises:
        errors.MissingColumnError: `column` is not one of `obs_columns`.
        ValueError: A label is not a category of `column`, or the predicate
            does not return one bool per value.
    """
    if column not in source.obs_columns:
        raise errors.MissingColumnError(
            f"where={{{column!r}: ...}}: {column!r} is not one of the source's "
            f"obs_columns {list(source.obs_columns)}; build the AnnDataSource "
            "with obs_columns including it"
        )
    categories = source.categories[column]
    values = source.obs_values(column)
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
    return table[values]


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


def selection_mask(source: AnnDataSource, cells=None, where=None) -> np.ndarray:
    """One bool per global row: the source's cells that match every condition.

    Args:
        source: The source (a view selects only among its own cells).
        cells: A boolean mask over `num_cells`, or global row ids, or None.
        where: Mapping of obs column to a condition (see `where_mask`).

    Returns:
        A bool array of `source.num_cells`.

    Raises:
        ValueError: The result is empty, or `cells` has the wrong length or
            rows out of range.
        TypeError: `cells` is neither bool nor integer.
    """
    n = source.num_cells
    mask = cell_mask(source)
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
            f"the selection holds no cell (where={_describe(where)}, cells="
            f"{_describe(cells)}, out of {source.num_selected_cells} cells)"
        )
    return mask


def _describe(x) -> str:
    if isinstance(x, np.ndarray):
        kind = "mask" if x.dtype == bool else "row ids"
        return f"<{kind} of {x.size}>"
    if isinstance(x, Mapping):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in x.items()) + "}"
    if callable(x):
        return "<predicate>"
    text = repr(x)
    return text if len(text) < 80 else text[:77] + "..."


# -- splits --------------------------------------------------------------------


def split_by_fraction(
    source: AnnDataSource,
    fractions: Mapping[str, float],
    *,
    seed: int = 0,
    unit_cells: int | None = None,
    by: str | None = None,
) -> dict[str, AnnDataSource]:
    """Splits a source's cells into views by fraction of cells.

    Units (blocks, a grid of rows, or obs groups) are ordered by
    `hash64(seed, unit key)` and the order is cut where the cumulative cell
    count crosses each fraction: a unit goes to the split whose share of
    cells holds its midpoint. A unit's key is its first global row (blocks,
    grid) or a hash of its label (groups), so the split depends only on the
    source, the arguments and `seed`.

    Example:
        >>> splits = split_by_fraction(source, {"train": 0.8, "val": 0.2})
        >>> by_donor = split_by_fraction(source, {"train": 0.8, "val": 0.2},
        ...                              by="donor", seed=1)

    Args:
        source: The source or view to split.
        fractions: Split name to its fraction of cells; all positive, summing
            to 1. The result keeps this order.
        seed: Seed of the assignment, a non-negative int.
        unit_cells: None (default) to assign the source's blocks, or a number
            of rows: the grid of `unit_cells` rows from each file's start
            (intersected with the selection), so that the split does not
            depend on `block_size`.
        by: An obs column (one of `obs_columns`) whose groups are the units:
            all cells of a label go to one split (cells with a missing label
            form one group). Exclusive with `unit_cells`.

    Returns:
        Split name to an `AnnDataSource` view of its cells.

    Raises:
        ValueError: Bad fractions, or fewer units than splits so that some
            split would be empty.
    """
    names, bounds = _fraction_bounds(fractions)
    seed = _check_seed(seed)
    if unit_cells is not None and by is not None:
        raise ValueError(
            f"pass unit_cells or by, not both (got unit_cells={unit_cells!r}, "
            f"by={by!r})"
        )
    if unit_cells is None and by is None:  # units: the source's blocks
        _, starts, stops = source.block_ranges(np.arange(len(source)))
        split_of = _cut(starts, stops - starts, bounds, seed, names, "blocks")
        return {
            name: source.with_blocks(starts[split_of == i], stops[split_of == i])
            for i, name in enumerate(names)
        }
    mask = cell_mask(source)
    if by is not None:
        unit_of_row, keys = _groups(source, by)
        sizes = np.bincount(unit_of_row[mask], minlength=keys.size)
        present = np.flatnonzero(sizes)
        split_of = np.zeros(keys.size, np.int64)
        split_of[present] = _cut(
            keys[present], sizes[present], bounds, seed, names, f"{by!r} groups"
        )
        split_of_row = split_of[unit_of_row]
    else:
        if not isinstance(unit_cells, (int, np.integer)) or unit_cells < 1:
            raise ValueError(
                f"unit_cells must be a positive int or None, got {unit_cells!r}"
            )
        offsets = source.cell_offsets
        rows = np.flatnonzero(mask)
        first = offsets[np.searchsorted(offsets, rows, side="right") - 1]
        grid = first + (rows - first) // unit_cells * unit_cells
        del first
        # The grid is sorted with the rows: a unit begins where it changes.
        begins = np.flatnonzero(np.diff(grid, prepend=-1))
        keys, sizes = grid[begins], np.diff(begins, append=grid.size)
        del grid
        split_of_unit = _cut(keys, sizes, bounds, seed, names, "units")
        split_of_row = np.full(source.num_cells, -1, np.int64)
        split_of_row[rows] = np.repeat(split_of_unit, sizes)
    return {
        name: source.select(mask & (split_of_row == i)) for i, name in enumerate(names)
    }


def split_by_obs(
    source: AnnDataSource,
    column: str,
    holdout: Mapping[str, Sequence | Callable[[np.ndarray], np.ndarray]],
    *,
    rest: str | None = "train",
) -> dict[str, AnnDataSource]:
    """Holds out the cells with given obs values (a donor, a plate, a study).

    Example:
        >>> splits = split_by_obs(source, "donor", {"val": ["D3"], "test": ["D7"]})
        >>> splits["train"], splits["val"], splits["test"]

    Args:
        source: The source or view to split.
        column: One of `source.obs_columns`.
        holdout: Split name to the labels (or values, or an elementwise
            predicate, as in `where_mask`) of its cells. Splits must not share
            a cell.
        rest: Name of the split holding every other cell, or None to leave
            those cells out.

    Returns:
        Split name to an `AnnDataSource` view: the holdout splits in order,
        then `rest` (omitted when no cell is left).

    Raises:
        ValueError: Two splits share cells, a split would be empty, or `rest`
            repeats a holdout name.
    """
    if not isinstance(holdout, Mapping) or not holdout:
        raise ValueError(
            f"holdout must map split names to labels, got holdout={holdout!r}"
        )
    if rest is not None and rest in holdout:
        raise ValueError(f"rest={rest!r} is also a holdout split; rename one")
    mask = cell_mask(source)
    taken = np.zeros_like(mask)
    out = {}
    for name, condition in holdout.items():
        split = mask & where_mask(source, column, condition)
        if not split.any():
            raise ValueError(
                f"holdout[{name!r}]: no cell of the source has {column!r} in "
                f"{_describe(condition)}"
            )
        if (split & taken).any():
            raise ValueError(
                f"holdout[{name!r}] shares cells with an earlier split: its "
                f"{column!r} values overlap"
            )
        taken |= split
        out[name] = source.select(split)
    left = mask & ~taken
    if rest is not None and left.any():
        out[rest] = source.select(left)
    return out


def _fraction_bounds(fractions) -> tuple[list[str], np.ndarray]:
    if not isinstance(fractions, Mapping) or not fractions:
        raise ValueError(
            f"fractions must map split names to fractions, got {fractions!r}"
        )
    names = list(fractions)
    values = np.array([float(fractions[k]) for k in names])
    if not np.isfinite(values).all() or (values <= 0).any():
        raise ValueError(f"fractions must be positive, got {dict(fractions)}")
    if abs(values.sum() - 1) > _FRACTION_TOLERANCE:
        raise ValueError(
            f"fractions must sum to 1, got {values.sum():g} ({dict(fractions)})"
        )
    return names, np.cumsum(values)[:-1] / values.sum()


def _check_seed(seed) -> int:
    seed = arguments.check_int("seed", seed)
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got seed={seed!r}")
    return seed


def _cut(keys, sizes, bounds, seed, names, what) -> np.ndarray:
    """Split index of each unit: hash order cut at the fractions of cells."""
    if keys.size < len(names):
        raise ValueError(
            f"{keys.size} {what} cannot fill {len(names)} splits {names}; use "
            "smaller units (block_size, unit_cells) or fewer splits"
        )
    order = np.argsort(counter_rng.hash64(seed, keys.astype(np.uint64)), kind="stable")
    sizes = sizes[order].astype(np.float64)
    middle = (np.cumsum(sizes) - sizes / 2) / sizes.sum()
    split_of = np.empty(keys.size, np.int64)
    split_of[order] = np.searchsorted(bounds, middle, side="right")
    counts = np.bincount(split_of, minlength=len(names))
    if (counts == 0).any():
        empty = [n for n, c in zip(names, counts, strict=True) if c == 0]
        raise ValueError(
            f"splits {empty} get none of the {keys.size} {what}: their fractions "
            "are smaller than one unit; use smaller units or larger fractions"
        )
    return split_of


def _groups(source: AnnDataSource, column: str) -> tuple[np.ndarray, np.ndarray]:
    """Group index of each global row, and each group's uint64 key.

    A categorical column's groups are its categories plus "missing"
    (index 0); a numeric column's are its distinct values. Keys hash the
    label's text, so they do not depend on category order or file order.
    """
    if column not in source.obs_columns:
        raise errors.MissingColumnError(
            f"by={column!r} is not one of the source's obs_columns "
            f"{list(source.obs_columns)}; build the AnnDataSource with "
            "obs_columns including it"
        )
    values = source.obs_values(column)
    categories = source.categories[column]
    if categories is None:
        labels, group_of_row = np.unique(values, return_inverse=True)
        texts = [repr(float(v)) for v in labels]
    else:
        group_of_row = values.astype(np.int64) + 1
        texts = ["\x00missing", *(str(c) for c in categories.tolist())]
    keys = np.array(
        [
            int.from_bytes(
                hashlib.blake2b(t.encode(), digest_size=8).digest(), "little"
            )
            for t in texts
        ],
        np.uint64,
    )
    return group_of_row.reshape(-1), keys


__all__ = [
    "blocks_over_runs",
    "cell_mask",
    "selected_blocks",
    "selection_mask",
    "split_by_fraction",
    "split_by_obs",
    "where_mask",
]
