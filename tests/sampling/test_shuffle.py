"""Grain's `index_shuffle` computed with NumPy (`grain_cells.sampling._samplers`).

Equal to Grain's own function position by position (permutation sizes around
the cipher's block-size steps, 32-bit seeds at the edges); a `BlockSampler`'s
epoch order is Grain's either way, and where the NumPy copy disagreed with
Grain it would not be used.
"""

from __future__ import annotations

import grain
import numpy as np
import pytest

import grain_cells
from grain_cells.sampling import _samplers

# A permutation of 2-4 positions still uses the cipher's smallest block (16
# bits): each position cycle-walks about 2**15 times, one NumPy pass each, so
# these take 2-7 s apiece and run in the whole suite only. 100 and 65_535
# cycle-walk in the quick loop.
_TINY = pytest.mark.slow
SIZES = [
    pytest.param(1, marks=_TINY),
    pytest.param(2, marks=_TINY),
    pytest.param(3, marks=_TINY),
    100,
    65_535,
    65_536,
    65_537,
    1 << 20,
    (1 << 20) + 1,
    5_980_419,
]
SEEDS = [0, 1, 12_345, 2**31 - 1, 2**32 - 1]


@pytest.mark.parametrize("max_index", SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_equals_grain_position_by_position(max_index, seed, monkeypatch):
    if max_index < _samplers._CHECKS:
        # `shuffle` would first compare this whole permutation with Grain's
        # (`_agrees` probes every position of one under 16), then compute it
        # again: the assertion below is that same comparison, made once.
        monkeypatch.setattr(_samplers, "_agrees", lambda *args: True)
    rng = np.random.default_rng(max_index ^ seed)
    offsets = np.unique(
        np.concatenate([rng.integers(0, max_index + 1, 300), [0, max_index]])
    )
    want = [
        grain.experimental.index_shuffle(int(o), max_index, seed, 4)
        for o in offsets.tolist()
    ]
    assert _samplers.numpy_index_shuffle(offsets, max_index, seed, 4).tolist() == want


def test_a_whole_permutation():
    got = _samplers.numpy_index_shuffle(np.arange(70_001), 70_000, 7, 4)
    np.testing.assert_array_equal(np.sort(got), np.arange(70_001))


def _grain_order(sampler, epoch):
    start = epoch * sampler.epoch_length
    return [sampler.block_at(p) for p in range(start, start + sampler.epoch_length)]


@pytest.mark.parametrize("disagree", [False, True], ids=["numpy", "grain"])
def test_block_sampler_epoch_order_is_grains(monkeypatch, disagree):
    if disagree:  # a Grain whose cipher changed: the copy is not used
        monkeypatch.setattr(_samplers, "_agrees", lambda *args: False)
    sampler = grain_cells.BlockSampler(9_000, seed=3, num_epochs=3)
    assert sampler.epoch_length >= _samplers._VECTOR_POSITIONS
    for epoch in range(3):
        assert sampler.epoch_order(epoch).tolist() == _grain_order(sampler, epoch)
