"""Output formats of a minibatch: CSR, padded sparse (static shapes), dense."""

from grain_cells.outputs._formats import (
    CsrOutput,
    DenseOutput,
    Fetch,
    Output,
    declared,
    dtype_name,
    padded,
    zeros,
)
from grain_cells.outputs._padded import PaddedSparseOutput, TruncationReport

__all__ = [
    "CsrOutput",
    "DenseOutput",
    "Fetch",
    "Output",
    "PaddedSparseOutput",
    "TruncationReport",
    "declared",
    "densify",
    "dtype_name",
    "padded",
    "zeros",
]


def __getattr__(name: str):
    # JAX is imported only when the helper is used (workers never need it).
    if name == "densify":
        from grain_cells.outputs._densify import densify

        return densify
    raise AttributeError(f"module 'grain_cells.outputs' has no attribute {name!r}")
