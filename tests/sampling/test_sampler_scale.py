"""Samplers at scale: compact pickles, vectorised `blocks_at`.

`WeightedBlockSampler` pickles large weights as the path of a shared table.

A worker maps or unpickles the cumulative weights; they must be the very
same floats (draws are `searchsorted` on them).
"""

from __future__ import annotations

import pickle

import cloudpickle
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from grain_cells import WeightedBlockSampler


@st.composite
def weights(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n_runs = draw(st.integers(1, 40))
    values = rng.choice([0.0, -0.0, 0.1, 1 / 3, 2.5, 7.0], n_runs)
    values[draw(st.integers(0, n_runs - 1))] = 1.0  # never all 0
    if draw(st.booleans()):
        values = rng.random(n_runs)  # distinct
    counts = rng.integers(1, draw(st.sampled_from([2, 50])), n_runs)
    return np.repeat(values, counts)


@settings(max_examples=100, deadline=None)
@given(w=weights(), dumps=st.sampled_from([pickle.dumps, cloudpickle.dumps]))
def test_pickled_sampler_draws_the_same_blocks(w, dumps):
    sampler = WeightedBlockSampler(w.size, w, seed=3, num_epochs=2)
    again = pickle.loads(dumps(sampler))
    assert again._cdf.tobytes() == sampler._cdf.tobytes()
    assert repr(again) == repr(sampler)
    positions = np.arange(len(sampler))
    np.testing.assert_array_equal(
        again.blocks_at(positions), sampler.blocks_at(positions)
    )
    assert pickle.loads(pickle.dumps(again))._cdf.tobytes() == sampler._cdf.tobytes()


def test_runs_of_equal_weights_pickle_small():
    w = np.repeat([0.5, 2.0, 0.25], 1_000_000)  # pure blocks of three classes
    sampler = WeightedBlockSampler(w.size, w, seed=0)
    assert len(pickle.dumps(sampler)) < 10_000
    distinct = WeightedBlockSampler(1000, np.arange(1.0, 1001.0), seed=0)
    assert len(pickle.dumps(distinct)) > 8_000  # the cumulative sums, as before


@settings(max_examples=40, deadline=None)
@given(
    num_blocks=st.integers(1, 120),  # 3 epochs of a few blocks per shard: 3 s at 300
    shuffle=st.booleans(),
    seed=st.integers(0, 2**40),
    count=st.integers(1, 3),
)
def test_block_sampler_blocks_at_matches_block_at(num_blocks, shuffle, seed, count):
    from grain import sharding

    from grain_cells import BlockSampler

    if num_blocks < count:
        return
    sampler = BlockSampler(
        num_blocks,
        shuffle=shuffle,
        seed=seed,
        num_epochs=3,
        shard_options=sharding.ShardOptions(0, count),
    )
    positions = np.arange(len(sampler))[::-1]  # epochs out of order
    want = [sampler.block_at(int(p)) for p in positions]
    np.testing.assert_array_equal(sampler.blocks_at(positions), want)
