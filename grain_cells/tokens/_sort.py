"""Compiled (numba) per-row sorts of the token kernels' keys.

Design notes: docs/reference/design.md#tokens-sort.
"""

from __future__ import annotations

import numba
import numpy as np

_U32 = np.uint64(0xFFFFFFFF)


def _njit(fn):
    return numba.njit(cache=True, nogil=True)(fn)


@_njit
def _sort_keys(keys, m, lo, hi, out, counts, bucket):
    """Sorts `keys[:m]` (order words in `[lo, hi]`) into `out[:m]`."""
    if m == 0:
        return
    span = np.uint64(hi - lo)
    limit = np.uint64(max(m, 16))
    shift = np.uint64(0)
    while (span >> shift) >= limit:
        shift += np.uint64(1)
    nb = int(span >> shift) + 1
    for b in range(nb + 1):
        counts[b] = 0
    base = np.uint64(lo)
    for i in range(m):
        b = int(((keys[i] >> np.uint64(32)) - base) >> shift)
        bucket[i] = b
        counts[b + 1] += 1
    for b in range(nb):
        counts[b + 1] += counts[b]
    for i in range(m):
        b = bucket[i]
        out[counts[b]] = keys[i]
        counts[b] += 1
    budget = 16 * m + 256
    moves = 0
    for i in range(1, m):
        k = out[i]
        j = i - 1
        while j >= 0 and out[j] > k:
            out[j + 1] = out[j]
            j -= 1
        out[j + 1] = k
        moves += i - 1 - j
        if moves > budget:
            out[:m] = np.sort(out[:m])
            return


@_njit
def _sort_keys_min_last(keys, m, lo, hi, out, counts, bucket, tail):
    """`_sort_keys`, with the keys of the row's smallest value set apart (in `tail`).

    Scrambles `keys[:m]`.
    """
    if m < 64:
        _sort_keys(keys, m, lo, hi, out, counts, bucket)
        return
    # Branch-free: a row's 1s and others interleave at random, and a
    # mispredicted branch per key cost more than the two stores.
    c = 0
    t = 0
    top = np.uint64(0)
    prev = np.uint64(0)
    disorder = 0
    for j in range(m):
        k = keys[j]
        w = k >> np.uint64(32)
        last = w == hi
        tail[t] = k
        keys[c] = k
        disorder += last & (k < prev)
        prev = k if last else prev
        top = top if last else max(top, w)
        t += last
        c += 1 - last
    if disorder:
        keys[c:m] = tail[:t]
        _sort_keys(keys, m, lo, hi, out, counts, bucket)
        return
    _sort_keys(keys, c, lo, top, out, counts, bucket)
    out[c:m] = tail[:t]
