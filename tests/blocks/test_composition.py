"""The block x class tables against the straightforward computation.

`grain_cells.blocks._pairs` gives the block x class count entries piece by
piece and the class sums over them (`expected_shares`), the class x class
sums that `balanced_block_weights` iterates on, and the block weights of a
multiplier. The references here work on one dense
blocks x classes table. Weights and expected shares must agree bit for bit
(a sampler's repr and checkpoints hash the weights).
"""

from __future__ import annotations

import balance_oracle
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from listed_blocks import blocks_over_runs

from grain_cells.blocks import _pairs, _weighting
from grain_cells.source import BlockTable


def _reference_table(codes, starts, stops, width):
    lengths = stops - starts
    rows = np.concatenate([np.arange(a, b) for a, b in zip(starts, stops, strict=True)])
    key = np.repeat(np.arange(lengths.size), lengths) * width + codes[rows] + 1
    keys, counts = np.unique(key, return_counts=True)
    return keys // width, keys % width, counts.astype(np.float64), lengths


def _reference_balance(table, target, max_iterations, tolerance):
    """The iteration over the dense form of a `_reference_table`."""
    block, klass, count, lengths = table
    dense = np.zeros((lengths.size, target.size), np.int64)
    dense[block, klass] = count.astype(np.int64)
    return balance_oracle.balance(dense, lengths, target, max_iterations, tolerance)


@st.composite
def tables(draw):
    n_obs = draw(st.lists(st.integers(1, 400), min_size=1, max_size=3))
    n = sum(n_obs)
    block_size = draw(st.sampled_from([1, 3, 4, 16]))
    n_classes = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    layout = draw(st.sampled_from(["sorted", "interleaved", "runs"]))
    if layout == "sorted":
        codes = np.sort(rng.integers(-1, n_classes, n))
    elif layout == "interleaved":
        codes = rng.integers(-1, n_classes, n)
    else:
        codes = np.repeat(rng.integers(-1, n_classes, n // 7 + 1), 7)[:n]
    grid = BlockTable.grid(n_obs, block_size)
    if draw(st.booleans()):
        starts, stops = grid.ranges(np.arange(len(grid)))[1:]
    else:
        mask = rng.random(n) < 0.7
        mask[0] = True
        starts, stops = blocks_over_runs(mask, grid.cell_offsets, block_size)
    return codes.astype(np.int8), starts, stops, n_classes


@pytest.mark.parametrize("dense_cost", [0, 1 << 30], ids=["sparse", "dense"])
@pytest.mark.parametrize("chunk_cells", [5, 64, 1 << 20], ids=["tiny", "small", "one"])
@settings(max_examples=60, deadline=None)
@given(case=tables())
def test_weights_match_the_straightforward_computation(chunk_cells, dense_cost, case):
    codes, starts, stops, n_classes = case
    width = n_classes + 1
    shape = (codes, lambda a, b: (starts[a:b], stops[a:b]), starts.size, 16, width)
    drawn = np.arange(1.0, len(starts) + 1)  # block weights of a sampler
    old = _pairs._PIECE_CELLS
    _pairs._PIECE_CELLS = chunk_cells  # many pieces (sums carried across)
    try:
        found = list(_pairs.entries(*shape))
        counts = _pairs.class_sums(*shape)
        shares = _pairs.class_sums(*shape, drawn)
    finally:
        _pairs._PIECE_CELLS = old
    table = _reference_table(codes, starts, stops, width)
    block = np.concatenate([a + b for a, b, _, _ in found])
    np.testing.assert_array_equal(block, table[0])
    for i in (2, 3):  # class, count
        got = np.concatenate([e[i] for e in found])
        np.testing.assert_array_equal(got, table[i - 1])
    np.testing.assert_array_equal(
        counts, np.bincount(table[1], table[2], minlength=width)
    )
    present = counts > 0
    present[0] = False
    if not present.any():
        return
    target = np.where(present, 1.0 / present.sum(), 0.0)
    want = _reference_balance(table, target, 30, 1e-6)
    old = _pairs._PIECE_CELLS, _pairs._DENSE_COST
    _pairs._PIECE_CELLS = chunk_cells  # many pieces
    _pairs._DENSE_COST = dense_cost
    try:
        pairs = _pairs.pairs(
            codes, lambda a, b: (starts[a:b], stops[a:b]), starts.size, 16, width
        )
        multiplier, got, gap = _weighting.balance(pairs, target, 30, 1e-6)
        weights = _pairs.block_sums(
            codes, lambda a, b: (starts[a:b], stops[a:b]), starts.size, 16, multiplier
        )
    finally:
        _pairs._PIECE_CELLS, _pairs._DENSE_COST = old
    np.testing.assert_array_equal(
        pairs.counts, np.bincount(table[1], table[2], minlength=width)
    )
    assert multiplier.tobytes() == want[3].tobytes()
    assert weights.tobytes() == want[0].tobytes()
    assert got.tobytes() == want[1].tobytes()
    assert gap == want[2]
    block, klass, count, _ = table
    emitted = np.bincount(klass, drawn[block] * count, width)
    assert shares.tobytes() == emitted.tobytes()


def test_pairs_multiply_with_one_blas_thread(monkeypatch):
    """OpenBLAS's idle threads spin: on busy cores they cost 6x the CPU."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    seen = []
    piece_counts = _pairs._piece_counts

    def counting(*args):
        seen.extend(
            i["num_threads"]
            for i in threadpoolctl.threadpool_info()
            if i["user_api"] == "blas"
        )
        return piece_counts(*args)

    monkeypatch.setattr(_pairs, "_piece_counts", counting)
    codes = np.arange(64) % 5
    starts, stops = np.arange(0, 64, 16), np.arange(16, 65, 16)
    _pairs.pairs(codes, lambda a, b: (starts[a:b], stops[a:b]), 4, 16, 6)
    assert seen and set(seen) == {1}
