"""Type checks of the weighting calls' arguments, each naming the call and the argument.

Design notes: docs/reference/design.md#blocks-weight-args.
"""

from __future__ import annotations

import numpy as np

from grain_cells.source import AnnDataSource


def check_source(source, function: str) -> None:
    """Raises TypeError unless `source` is an `AnnDataSource` (or a view)."""
    if not isinstance(source, AnnDataSource):
        raise TypeError(
            f"{function}: source must be a grain_cells.AnnDataSource (or a view "
            f"of one), got {type(source).__name__}"
        )


def check_column(column, function: str) -> None:
    """Raises TypeError unless `column` is a str (an obs column name)."""
    if not isinstance(column, str):
        raise TypeError(
            f"{function}: column must be the name of a categorical obs column "
            f"(a str), got {type(column).__name__}"
            + (f" of shape {np.shape(column)}" if np.ndim(column) else f" {column!r}")
        )


def numbers(value, name: str, function: str, hint: str = "") -> np.ndarray:
    """`value` as float64, or a TypeError naming the argument."""
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(
            f"{function}: {name} must be an array of numbers, got "
            f"{type(value).__name__} {value!r}{hint}"
        )
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise TypeError(
            f"{function}: {name} must be an array of numbers, got dtype {arr.dtype}"
            f"{hint}"
        )
    return arr.astype(np.float64)
