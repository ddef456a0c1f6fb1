"""Compiled (numba) kernels of the token outputs: one pass per cell, per-row sorts.

Design notes: docs/reference/design.md#tokens-kernels, #tokens-jit, #tokens-sort.
"""

from __future__ import annotations

import numba
import numpy as np

from grain_cells.tokens._threads import announced

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
    counts[: nb + 1] = 0
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
    """`_sort_keys`, the keys of the row's smallest value set apart; scrambles keys."""
    if m < 64:
        _sort_keys(keys, m, lo, hi, out, counts, bucket)
        return
    # Branch-free: a row's 1s and others interleave at random, and a
    # mispredicted branch per key cost more than the two stores.
    c = t = disorder = 0
    top = prev = np.uint64(0)
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


@_njit
def _row_keys(data, indices, a, b, tokens, medians, use_medians, checked, keys, quot):
    """Keys of one row's expressed values; returns (m, lo, hi, dropped).

    `checked` False (every value kept): no tests, and a vectorised division loop.
    """
    m = dropped = 0
    lo, hi = _U32, np.uint64(0)
    if not checked:
        n = b - a
        values = data[a:b]
        columns = indices[a:b]
        if use_medians:
            for j in range(n):
                quot[j] = values[j] / medians[columns[j]]
            values = quot
        for j in range(n):
            w = np.uint64(np.float32(values[j]).view(np.uint32)) ^ _U32
            lo = min(lo, w)
            hi = max(hi, w)
            keys[j] = (w << np.uint64(32)) | np.uint64(tokens[columns[j]])
        return b - a, lo, hi, 0
    for j in range(a, b):
        v = data[j]
        if not v > 0:
            continue
        c = indices[j]
        t = tokens[c]
        if t < 0:
            dropped += 1
            continue
        s = v / medians[c] if use_medians else v
        w = np.uint64(np.float32(s).view(np.uint32)) ^ _U32
        lo = min(lo, w)
        hi = max(hi, w)
        keys[m] = (w << np.uint64(32)) | np.uint64(t)
        m += 1
    return m, lo, hi, dropped


@_njit
def _scratch(indptr, rows):
    """Scratch (keys, sorted keys, bucket counters and indices, quotients, tail)."""
    longest = 0
    for r in rows:
        longest = max(longest, indptr[r + 1] - indptr[r])
    u64 = np.empty((3, longest), np.uint64)
    counts, bucket = np.empty(longest + 18, np.int32), np.empty(longest, np.int32)
    return u64[0], u64[1], counts, bucket, np.empty(longest, np.float32), u64[2]


@_njit
def encode_rows(csr, rows, tokens, medians, checked, q, ids, values, mask, ends):
    """Token sequences of `rows` into `ids`, `values` (bins), `mask`; per-row counts.

    `csr`: `(data, indices, indptr)`; `ends`: `(cls_id, slots, pad_id, eos_id,
    pad_value)`. `q` empty: rank-value (values divided by `medians`, `values`
    untouched); else value-bin with `q = np.linspace(0, 1, n_bins - 1)`. Output rows
    past `rows.size` are padding; `checked` False: every value kept. Returns int32
    `(n_expressed, n_dropped, n_genes)` per output row.
    """
    data, indices, indptr = csr
    cls_id, slots, pad_id, eos_id, pad_value = ends
    binned = q.size > 0
    keys, out, counts, bucket, quot, tail = _scratch(indptr, rows)
    n_out, length = ids.shape
    n_expr = np.zeros(n_out, np.int32)
    n_drop = np.zeros(n_out, np.int32)
    n_genes = np.zeros(n_out, np.int32)
    edges = np.empty(q.size, np.float32)
    offset = 1 if cls_id >= 0 else 0
    for i in range(n_out):
        row = ids[i]
        p = 0
        if i < rows.size:
            r = rows[i]
            a, b = indptr[r], indptr[r + 1]
            m, lo, hi, dropped = _row_keys(
                data, indices, a, b, tokens, medians, not binned, checked, keys, quot
            )
            if binned:
                _sort_keys_min_last(keys, m, lo, hi, out, counts, bucket, tail)
            else:
                _sort_keys(keys, m, lo, hi, out, counts, bucket)
            n = min(m, slots)
            if offset:
                row[0] = cls_id
            for g in range(n):
                row[offset + g] = np.int32(out[g] & _U32)
            if binned:
                vrow = values[i]
                if offset:
                    vrow[0] = 0
                if m > 0:
                    _edges(out, m, q, edges)
                k = q.size
                for g in range(n):
                    x = _value_at(out, g)
                    while k > 0 and edges[k - 1] > x:
                        k -= 1
                    vrow[offset + g] = k
            p = offset + n
            if eos_id >= 0:
                row[p] = eos_id
                p += 1
            n_expr[i] = m
            n_drop[i] = dropped
            n_genes[i] = n
        for g in range(p, length):
            row[g] = pad_id
        if binned:
            for g in range(p, length):
                values[i, g] = pad_value
        for g in range(length):
            mask[i, g] = g < p
    return n_expr, n_drop, n_genes


@_njit
def _value_at(out, i):
    """float32 value of sorted key `i` (descending order)."""
    return np.uint32((out[i] >> np.uint64(32)) ^ _U32).view(np.float32)


@_njit
def _edges(out, m, q, edges):
    """`np.quantile(out[:m] values, q)`, each up to the smallest float32 `c >= e`."""
    last = m - 1
    for k in range(q.size):
        virtual = last * q[k]
        prev_f = np.floor(virtual)
        gamma = virtual - prev_f
        prev = int(prev_f)
        prev, nxt = (last, last) if virtual >= last else (prev, min(prev + 1, last))
        a = _value_at(out, last - prev)
        b = _value_at(out, last - nxt)
        d64 = np.float64(np.float32(b - a))  # the difference in float32, as NumPy
        e = np.float64(b) - d64 * (1 - gamma) if gamma >= 0.5 else a + d64 * gamma
        c = np.float32(e)
        if np.float64(c) < e:
            c = np.nextafter(c, np.float32(np.inf))
        edges[k] = c


encode_rows = announced(encode_rows)  # the first compile announced and locked
