"""Views of a source: deterministic splits, and blocks along the chunk grid.

Splits are pure functions of the source, the arguments and the seed (never of
worker or shard counts), disjoint, together the source. Design:
docs/reference/design.md#blocks-splits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from grain_cells._util import arguments, counter_rng
from grain_cells.source import (
    AnnDataSource,
    blocks_of_mask,
    chunk_aligned_blocks,
    describe_condition,
    obs_column,
    selected_blocks,
    where_mask,
)

if TYPE_CHECKING:
    from grain_cells.source import BlockTable

_FRACTION_TOLERANCE = 1e-6


def split_by_fraction(
    source: AnnDataSource,
    fractions: Mapping[str, float],
    *,
    seed: int = 0,
    unit_cells: int | None = None,
    by: str | None = None,
) -> dict[str, AnnDataSource]:
    """Splits a source's cells into views by fraction of cells (design notes).

    Example:
        >>> splits = split_by_fraction(source, {"train": 0.8, "val": 0.2})
        >>> by_donor = split_by_fraction(source, {"train": 0.8, "val": 0.2},
        ...                              by="donor", seed=1)

    Args:
        source: The source or view to split.
        fractions: Split name to its fraction of cells; all positive, summing
            to 1. The result keeps this order.
        seed: Seed of the assignment, a non-negative int.
        unit_cells: None (default) to assign the source's blocks, or a grid
            of `unit_cells` rows per file (independent of `block_size`).
        by: An obs column whose labels are the units (a missing label is
            one); exclusive with `unit_cells`.

    Returns:
        Split name to an `AnnDataSource` view of its cells.

    Raises:
        ValueError: Bad fractions, or fewer units than splits so that some
            split would be empty.
    """
    tables = fraction_split_blocks(
        source, fractions, seed=seed, unit_cells=unit_cells, by=by
    )
    return {name: source.view(table) for name, table in tables.items()}


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
            predicate) of its cells; splits share no cell.
        rest: Name of the split of every other cell (None: left out).

    Returns:
        Split name to an `AnnDataSource` view: holdout splits, then `rest`.

    Raises:
        ValueError: Two splits share cells, a split would be empty (`rest`
            too: when the holdout splits take every cell), or `rest`
            repeats a holdout name.
    """
    tables = obs_split_blocks(source, column, holdout, rest=rest)
    return {name: source.view(table) for name, table in tables.items()}


def fraction_split_blocks(source, fractions, *, seed=0, unit_cells=None, by=None):
    """`split_by_fraction`'s `BlockTable`s, before `source.view` binds them."""
    arguments.check_source(source, AnnDataSource)
    names, bounds = _fraction_bounds(fractions)
    seed = arguments.check_seed(seed)
    if unit_cells is not None and by is not None:
        raise ValueError(
            f"pass unit_cells or by, not both (got unit_cells={unit_cells!r}, "
            f"by={by!r})"
        )
    table = source.block_table
    if unit_cells is None and by is None:  # units: the source's blocks
        _, starts, stops = table.ranges(np.arange(len(table)))
        split_of = _cut(starts, stops - starts, bounds, seed, names, "blocks")
        return {
            name: table.with_blocks(starts[split_of == i], stops[split_of == i])
            for i, name in enumerate(names)
        }
    mask = table.cell_mask()
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
        arguments.check_int("unit_cells", unit_cells, minimum=1)
        offsets = table.cell_offsets
        rows = np.flatnonzero(mask)
        first = offsets[np.searchsorted(offsets, rows, side="right") - 1]
        grid = first + (rows - first) // unit_cells * unit_cells
        del first
        # The grid is sorted with the rows: a unit begins where it changes.
        begins = np.flatnonzero(np.diff(grid, prepend=-1))
        keys, sizes = grid[begins], np.diff(begins, append=grid.size)
        del grid
        split_of_unit = _cut(keys, sizes, bounds, seed, names, "units")
        split_of_row = np.full(table.num_cells, -1, np.int64)
        split_of_row[rows] = np.repeat(split_of_unit, sizes)
    return {
        name: selected_blocks(source, mask & (split_of_row == i))
        for i, name in enumerate(names)
    }


def obs_split_blocks(source, column, holdout, *, rest="train") -> dict[str, BlockTable]:
    """`split_by_obs`'s `BlockTable`s, before `source.view` binds them."""
    arguments.check_source(source, AnnDataSource)
    if not isinstance(holdout, Mapping) or not holdout:
        raise ValueError(
            f"holdout must map split names to labels, got holdout={holdout!r}"
        )
    if rest is not None and rest in holdout:
        raise ValueError(f"rest={rest!r} is also a holdout split; rename one")
    table = source.block_table
    mask = table.cell_mask() if table.is_view else True  # True: every row
    taken = None
    out = {}
    for name, condition in holdout.items():
        split = where_mask(source, column, condition)
        split &= mask
        if not split.any():
            raise ValueError(
                f"holdout[{name!r}]: no cell of the source has {column!r} in "
                f"{describe_condition(condition)}"
            )
        if taken is not None and _overlap(split, taken):
            raise ValueError(
                f"holdout[{name!r}] shares cells with an earlier split: its "
                f"{column!r} values overlap"
            )
        out[name] = blocks_of_mask(table, split)
        taken = split if taken is None else np.logical_or(taken, split, out=taken)
        del split
    if rest is not None:
        left = np.logical_not(taken, out=taken)
        left &= mask
        if not left.any():
            raise ValueError(
                f"split_by_obs(..., rest={rest!r}): the holdout splits "
                f"{list(holdout)} take every one of the source's "
                f"{table.num_selected_cells} cells, so {rest!r} would be empty. "
                "Hold out fewer values, or pass rest=None to split only the "
                "held-out cells"
            )
        out[rest] = blocks_of_mask(table, left)
    return out


def _overlap(a: np.ndarray, b: np.ndarray, step: int = 1 << 22) -> bool:
    """Whether two masks share a True, without a mask-sized temporary."""
    return any(
        np.logical_and(a[i : i + step], b[i : i + step]).any()
        for i in range(0, a.size, step)
    )


def _fraction_bounds(fractions) -> tuple[list[str], np.ndarray]:
    if not isinstance(fractions, Mapping) or not fractions:
        raise ValueError(
            f"fractions must map split names to fractions, got fractions={fractions!r}"
        )
    names = list(fractions)
    values = np.array([float(fractions[k]) for k in names])
    if not np.isfinite(values).all() or (values <= 0).any():
        raise ValueError(f"fractions must be positive, got fractions={dict(fractions)}")
    if abs(values.sum() - 1) > _FRACTION_TOLERANCE:
        raise ValueError(
            f"fractions must sum to 1, got {values.sum():g} ({dict(fractions)})"
        )
    return names, np.cumsum(values)[:-1] / values.sum()


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
    """The group of each global row, and each group's key: a hash of its label's text.

    Categorical: the categories plus "missing" (group 0); numeric: distinct values.
    """
    values, categories = obs_column(source, column, "by=")
    if categories is None:
        labels, group_of_row = np.unique(values, return_inverse=True)
        texts = [repr(float(v)) for v in labels]
    else:
        group_of_row = values.astype(np.int64) + 1
        texts = ["\x00missing", *(str(c) for c in categories.tolist())]
    digests = [hashlib.blake2b(t.encode(), digest_size=8).digest() for t in texts]
    keys = np.array([int.from_bytes(d, "little") for d in digests], np.uint64)
    return group_of_row.reshape(-1), keys


def chunk_aligned(source: AnnDataSource, chunks_per_block: int = 1) -> AnnDataSource:
    """A view of `source` whose blocks follow the matrix's chunk grid (design notes).

    Give the source a `block_size` of at least `chunks_per_block` times
    `mean_cells_per_chunk`, plus a margin.

    Args:
        source: An `AnnDataSource` (or a view of one).
        chunks_per_block: Chunks of the matrix per block (at least 1).

    Returns:
        A new `AnnDataSource` view (its own file handles); its `repr` names
        a hash of its block table, so checkpoints bind to the alignment.
    """
    arguments.check_source(source, AnnDataSource)
    n = arguments.check_int("chunks_per_block", chunks_per_block, minimum=1)
    table = source.block_table
    return source.view(chunk_aligned_blocks(table, source.chunk_starts(), n))


def mean_cells_per_chunk(source: AnnDataSource) -> float:
    """Average cells per chunk of the matrix over all files (for sizing)."""
    starts = np.union1d(source.block_table.cell_offsets[:-1], source.chunk_starts())
    return source.num_cells / max(1, starts.size)
