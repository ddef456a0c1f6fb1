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


# Epochs of up to 4,096 blocks are computed whole, once (`_small_epoch`): the
# sizes around the cipher's smallest block and the 4,096 edge.
SMALL = [2, 3, 16, 17, 74, 625, 4_095, 4_096]


@pytest.fixture
def fresh_memo():
    _samplers._small_epoch.cache_clear()
    _samplers._agrees.cache_clear()
    yield
    _samplers._small_epoch.cache_clear()
    _samplers._agrees.cache_clear()


def _grains(num_blocks, seed, offsets):
    last = num_blocks - 1
    return [grain.experimental.index_shuffle(o, last, seed, 4) for o in offsets]


@pytest.mark.parametrize("num_blocks", SMALL)
@pytest.mark.parametrize("seed", [0, 2**31 - 1])
def test_a_small_epoch_equals_grain_at_every_offset(num_blocks, seed):
    got = _samplers._whole(num_blocks - 1, seed, 4)
    assert got.tolist() == _grains(num_blocks, seed, range(num_blocks))


@pytest.mark.parametrize("disagree", [False, True], ids=["numpy", "grain"])
@pytest.mark.parametrize("num_blocks", [17, 625])
def test_small_epochs_of_a_block_sampler_are_grains(
    monkeypatch, fresh_memo, disagree, num_blocks
):
    if disagree:  # a Grain whose cipher changed: the NumPy copy is not used
        whole = _samplers._whole
        monkeypatch.setattr(_samplers, "_whole", lambda *a: whole(*a)[::-1].copy())
    sampler = grain_cells.BlockSampler(num_blocks, seed=5, num_epochs=None)
    for epoch in range(6):  # more epochs than are kept
        want = _grains(num_blocks, sampler._epoch_seed(epoch), range(num_blocks))
        start = epoch * num_blocks
        assert sampler.epoch_order(epoch).tolist() == want
        assert [sampler[start + o].record_key for o in (0, 7, num_blocks - 1)] == [
            want[0],
            want[7],
            want[-1],
        ]
    positions = np.arange(3 * num_blocks - 40, 3 * num_blocks + 40)  # two epochs
    epochs, offsets = np.divmod(positions, num_blocks)
    seeds = [sampler._epoch_seed(int(e)) for e in epochs]
    want = [
        _grains(num_blocks, s, [int(o)])[0] for s, o in zip(seeds, offsets, strict=True)
    ]
    assert sampler.blocks_at(positions).tolist() == want
