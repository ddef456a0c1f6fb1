"""The token kernel's steps timed one by one (`token_steps.py`), and tested.

A module of its own, without flags: a test imports it beside the other
benchmark binaries, whose absl flags are defined once per process.
"""

from __future__ import annotations

import numba
import numpy as np

from grain_cells.tokens import _jit as token_jit


@numba.njit(nogil=True)  # not cached: a benchmark helper
def rank_value_key_steps(data, indices, indptr, tokens, medians, checked, sort):
    """`encode_rows`' rank-value key pass (and sort) over every row: keys made."""
    rows = np.arange(indptr.size - 1, dtype=np.int64)
    keys, out, counts, bucket, quot, _ = token_jit._scratch(indptr, rows)
    total = 0
    for r in range(indptr.size - 1):
        a, b = indptr[r], indptr[r + 1]
        m, lo, hi, _ = token_jit._row_keys(
            data, indices, a, b, tokens, medians, True, checked, keys, quot
        )
        if sort:
            token_jit._sort_keys(keys, m, lo, hi, out, counts, bucket)
        total += m
    return total
