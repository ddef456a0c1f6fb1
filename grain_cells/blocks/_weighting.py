"""Block weights for `WeightedBlockSampler`: per-cell weights, class balance.

A sampler emits every cell of a drawn block, so a cell's expected rate is its
block's probability. Design notes: docs/reference/design.md#blocks-weighting.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np

from grain_cells._util.arguments import check_choice, check_int, check_source
from grain_cells.blocks._pairs import Pairs, block_sums, class_sums, pairs
from grain_cells.source import AnnDataSource, obs_column

MISS_POINTS = 0.03  # a share this far from its target suggests a grouped copy


def _numbers(value, name: str, function: str, hint: str = "") -> np.ndarray:
    """`value` as float64, or a TypeError naming the argument."""
    bare = isinstance(value, (str, bytes)) or value is None
    arr = None if bare else np.asarray(value)
    if arr is None or arr.dtype.kind not in "biuf":
        got = f"{type(value).__name__} {value!r}" if bare else f"dtype {arr.dtype}"
        raise TypeError(
            f"{function}: {name} must be an array of numbers, got {got}{hint}"
        )
    return arr.astype(np.float64)


def block_weights(
    source: AnnDataSource, cell_weights, *, reduce: str = "mean"
) -> np.ndarray:
    """Per-block weights from per-cell weights.

    Example:
        >>> w = np.where(source.obs_values("batch") == 3, 5.0, 1.0)
        >>> weights = block_weights(source, w)   # batch 3 five times as often

    Args:
        source: The source (or view) whose blocks are weighed.
        cell_weights: One non-negative finite weight per global row
            (`source.num_cells`); rows outside a view's blocks are ignored.
        reduce: `"mean"` (default) or `"sum"` of a block's cell weights.

    Returns:
        float64 weights, one per block of `source`.

    Raises:
        TypeError: `source` is not an `AnnDataSource`, or `cell_weights`
            not numbers (a column name means `balanced_block_weights`).
        ValueError: Wrong shape, negative or non-finite weights, every block
            weighing 0, or an unknown `reduce`.
    """
    check_source(source, AnnDataSource)
    check_choice("reduce", reduce, ("mean", "sum"))
    hint = (
        f"; for class balance over an obs column use balanced_block_weights("
        f"source, {cell_weights!r})"
        if isinstance(cell_weights, str)
        else ""
    )
    w = _numbers(cell_weights, "cell_weights", "block_weights", hint)
    n = source.num_cells
    if w.shape != (n,):
        raise ValueError(
            f"cell_weights needs one weight per cell of the files (shape ({n},)), "
            f"got shape {w.shape}"
        )
    if not np.isfinite(w).all() or (w < 0).any():
        bad = int(np.flatnonzero(~np.isfinite(w) | (w < 0))[0])
        raise ValueError(
            f"cell_weights must be finite and >= 0; row {bad} has {w[bad]}"
        )
    table = source.block_table
    _, starts, stops = table.ranges(np.arange(len(table)))
    if table.num_selected_cells != n:  # cells between blocks count 0
        w = np.where(table.cell_mask(), w, 0.0)
    sums = np.add.reduceat(w, starts) if starts.size else np.zeros(0)
    out = sums / (stops - starts) if reduce == "mean" else sums
    if not (out > 0).any():
        raise ValueError("cell_weights give every block of the source weight 0")
    return out


def _codes(source: AnnDataSource, column: str, function: str):
    """`(codes, ranges, categories)` of a categorical column of `source`."""
    check_source(source, AnnDataSource)
    if not isinstance(column, str):
        raise TypeError(
            f"{function}: column must be the name of a categorical obs column "
            f"(a str), got {type(column).__name__}"
            + (f" of shape {np.shape(column)}" if np.ndim(column) else f" {column!r}")
        )
    codes, categories = obs_column(source, column, "column=")
    if categories is None:
        raise ValueError(
            f"column={column!r} is numeric; class balance needs a categorical "
            "column (or pass per-cell weights to block_weights)"
        )

    def ranges(a, b):
        return source.block_ranges(np.arange(a, b))[1:]

    return codes, ranges, categories


def _targets(counts: np.ndarray, categories, column: str, shares) -> np.ndarray:
    """Target share per class index (0: missing, never a target)."""
    width = counts.size
    present = counts > 0
    present[0] = False
    target = np.zeros(width)
    if shares is None:
        if not present.any():
            raise ValueError(f"no cell of the source has a {column!r} label")
        target[present] = 1.0 / present.sum()
        return target
    if not isinstance(shares, Mapping) or not shares:
        raise ValueError(f"shares must map labels to target shares, got {shares!r}")
    index = {str(c): i + 1 for i, c in enumerate(categories.tolist())}
    for label, share in shares.items():
        i = index.get(str(label))
        if i is None:
            raise ValueError(
                f"shares: {label!r} is not a category of {column!r} "
                f"({categories[:20].tolist()})"
            )
        share = float(share)
        if not np.isfinite(share) or share < 0:
            raise ValueError(f"shares[{label!r}] must be >= 0, got {share}")
        if share > 0 and not present[i]:
            raise ValueError(
                f"shares[{label!r}] = {share}, but no cell of the source has "
                f"{column}={label!r}"
            )
        target[i] = share
    if target.sum() <= 0:
        raise ValueError(f"shares must not all be 0, got {dict(shares)}")
    return target / target.sum()


def balanced_block_weights(
    source: AnnDataSource,
    column: str,
    *,
    shares: Mapping | None = None,
    max_iterations: int = 200,
    tolerance: float = 1e-6,
) -> np.ndarray:
    """Block weights giving each class of `column` its target share of cells.

    Per-class multipliers, averaged per block (a missing label weighs 0), are
    refined until each expected share is within `tolerance` of its target.

    Example:
        >>> equal = balanced_block_weights(source, "cell_type")
        >>> skewed = balanced_block_weights(source, "cell_type",
        ...                                 shares={"B": 0.5, "T": 0.5})

    Args:
        source: The source (or view) whose blocks are weighed.
        column: A categorical obs column (one of `obs_columns`).
        shares: Label to target share (normalised to sum 1; labels left out
            get 0), or None for an equal share per label present.
        max_iterations: Most refinement steps.
        tolerance: Largest accepted gap between a class's expected and target
            share.

    Returns:
        float64 weights, one per block of `source`.

    Raises:
        TypeError: `source` is not an `AnnDataSource`, or `column` not a str.
        ValueError: `column` is numeric, a label is unknown or absent from
            the source, or a share is negative.
        errors.MissingColumnError: `column` is not one of `obs_columns`.

    Warns:
        UserWarning: The targets were not reached (blocks mix classes): the
            shares against the targets, and what would help.
    """
    codes, ranges, categories = _codes(source, column, "balanced_block_weights")
    check_int("max_iterations", max_iterations, minimum=1)
    blocks, longest = len(source), source.block_size
    table = pairs(codes, ranges, blocks, longest, len(categories) + 1)
    target = _targets(table.counts, categories, column, shares)
    multiplier, got, gap = balance(table, target, max_iterations, tolerance)
    if gap > tolerance:
        warnings.warn(
            _miss_note(categories, column, got, target, gap, source.block_size),
            stacklevel=2,
        )
    return block_sums(codes, ranges, blocks, longest, multiplier)


def balance(
    table: Pairs, target: np.ndarray, max_iterations: int, tolerance: float
) -> tuple[np.ndarray, np.ndarray, float]:
    """`balanced_block_weights`' fixed-point iteration: `(multiplier, shares, gap)`.

    Per class index; the block weights are `block_sums` of the multiplier.
    """
    width = target.size
    count = table.counts
    multiplier = np.divide(target, count, out=np.zeros(width), where=count > 0)
    gap = np.inf
    for _ in range(max_iterations + 1):
        used = multiplier.copy()
        emitted = table.emitted(used)
        got = emitted / emitted.sum()
        gap = float(np.abs(got - target).max())
        if gap <= tolerance:
            break
        step = np.divide(target, got, out=np.ones(width), where=got > 0)
        multiplier *= step
        multiplier /= multiplier.max()  # keep the scale away from under/overflow
    return used, got, gap


def _miss_note(categories, column, got, target, gap, block_size) -> str:
    """What the weights reach, against the targets, and what would help."""
    labels = [None, *categories.tolist()]
    listed = [i for i in np.argsort(-np.abs(got - target)) if got[i] or target[i]]
    shown = [
        f"{labels[i]!s}: {got[i]:.1%} (target {target[i]:.1%})" for i in listed[:8]
    ]
    more = f" and {len(listed) - 8} more" if len(listed) > 8 else ""
    note = (
        f"balanced_block_weights({column!r}): blocks mix classes, so the "
        f"expected shares miss the targets by up to {gap:.1%}: "
        + ", ".join(shown)
        + more
        + " (expected_shares(source, weights, column) gives them all)."
    )
    if gap > MISS_POINTS:
        note += (
            f" Blocks of {block_size} cells here hold several {column!r} labels "
            "each. Write a copy grouped by the label once, "
            f"grain_cells.preshuffle(paths, out_dir, group_by={column!r}), and "
            "read it at this block size: its blocks hold one label each, so the "
            "targets are reached with contiguous reads. (block_size=1 also "
            "reaches them, at a fraction of the read speed.)"
        )
    else:
        note += " Smaller blocks come closer."
    return note


def expected_shares(source: AnnDataSource, weights, column: str) -> dict:
    """Each label's expected share of the cells a weighted sampler emits.

    Example:
        >>> weights = balanced_block_weights(source, "cell_type")
        >>> expected_shares(source, weights, "cell_type")
        {'B': 0.25, 'CD4 T': 0.25, 'Mono': 0.25, 'NK': 0.25}

    Args:
        source: The source the weights are for.
        weights: One weight per block (as given to `WeightedBlockSampler`).
        column: A categorical obs column (one of `obs_columns`).

    Returns:
        Label to share, for the labels present (a missing label: key None).

    Raises:
        TypeError: `source` is not an `AnnDataSource`, `column` not a str or
            `weights` not numbers.
        ValueError: `weights` does not hold one value per block.
        errors.MissingColumnError: `column` is not one of `obs_columns`.
    """
    if isinstance(weights, str) and not isinstance(column, str):
        weights, column = column, weights  # the earlier order (column, weights)
    codes, ranges, categories = _codes(source, column, "expected_shares")
    weights = _numbers(weights, "weights", "expected_shares")
    if weights.shape != (len(source),):
        raise ValueError(
            f"weights needs one value per block ({len(source)}), got shape "
            f"{weights.shape}"
        )
    table = (codes, ranges, len(source), source.block_size, len(categories) + 1)
    emitted = class_sums(*table, weights)
    got = emitted / emitted.sum()
    present = class_sums(*table) > 0
    labels = [None, *categories.tolist()]
    return {labels[i]: float(got[i]) for i in np.flatnonzero(present)}
