"""`WeightedBlockSampler` pickles its weights run-length encoded.

A worker rebuilds the cumulative weights from the runs; they must be the
very same floats (draws are `searchsorted` on them).
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
