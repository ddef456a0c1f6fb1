"""Argument checks, row-range arithmetic and counter-based random numbers (private)."""
