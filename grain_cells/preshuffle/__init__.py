"""Pre-shuffled copies of AnnData files, written once, read as plain AnnData."""

from grain_cells.preshuffle._preshuffle import preshuffle

__all__ = ["preshuffle"]
