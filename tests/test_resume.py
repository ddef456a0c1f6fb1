"""One pipeline: the minibatch sequence does not depend on the worker count, and a
state restores under another worker count or shard count (JAX processes),
visiting every remaining cell exactly once."""

from __future__ import annotations

import json

import grain
import numpy as np
import pytest
from absl import flags
from grain import sharding

import grain_cells
from grain_cells.errors import CheckpointMismatchError

# 74 blocks of 4 cells (an even count: epochs are equally long for 1 and 2
# shards); fetches of 4 blocks, 4 minibatches of 4 cells; files of 97, 130
# and 61 cells end in short blocks, so some fetches are short.
CONFIG = {"block_size": 4, "batch_size": 4, "fetch_factor": 4, "seed": 7}

# 3 workers on purpose, more than 2 cores (CI): errors.WorkerCountWarning
OVERSUBSCRIBED = "ignore::grain_cells.errors.WorkerCountWarning"


def rows(batches) -> list[tuple]:
    return [tuple(b["row_ids"]) for b in batches]


def real_rows(batches) -> np.ndarray:
    if not batches:
        return np.zeros(0, np.int64)
    return np.concatenate([b["row_ids"][b["mask"]] for b in batches])


def build(helpers, paths, *, workers=0, shard=None, num_epochs=2, **change):
    return helpers.build(
        paths,
        **{**CONFIG, **change},
        worker_count=workers,
        shard=shard,
        num_epochs=num_epochs,
    )[2]


@pytest.fixture(scope="module")
def reference(csr_paths, helpers):
    """The 0-worker run of two epochs: minibatches and the state before each."""
    it = iter(build(helpers, csr_paths))
    states, batches = [it.get_state()], []
    for batch in it:
        batches.append(helpers.detach(batch))
        states.append(it.get_state())
    return states, batches


def test_reference_crosses_an_epoch_boundary_with_short_fetches(reference, helpers):
    states, batches = reference
    ids = real_rows(batches)
    assert ids.size == 2 * helpers.N_CELLS  # two epochs, every cell twice
    assert np.bincount(ids, minlength=helpers.N_CELLS).tolist() == [2] * 288
    counts = {}
    for s in states[:-1]:
        pos = json.loads(s)["position"]
        counts[pos["fetch"]] = pos["minibatch"] + 1
    assert len(set(counts.values())) > 1  # short fetches exist


@pytest.mark.slow
@pytest.mark.filterwarnings(
    "ignore::grain_cells.errors.WorkerCountWarning"
)  # 3 > 2 cores
@pytest.mark.parametrize("saved_with", [0, 2, 3])
def test_restore_under_every_other_worker_count(
    reference, csr_paths, helpers, saved_with
):
    """Saved at random steps (mid-fetch, either side of the epoch boundary).

    The saving run goes on to the end of its two epochs: with 2 or 3 workers
    it gives the 0-worker reference's minibatches, every array of each (the
    sequence does not depend on the worker count)."""
    flags.FLAGS.mark_as_parsed()
    states, expected = reference
    rng = np.random.default_rng(saved_with)
    epoch = len(expected) // 2
    steps = [int(rng.integers(1, epoch)), int(rng.integers(epoch, len(expected)))]
    saver = iter(build(helpers, csr_paths, workers=saved_with))
    saved, got = {}, []
    for step in range(len(expected)):
        if step in steps:
            saved[step] = saver.get_state()
            # The state is a position: the same whatever the worker count.
            assert json.loads(saved[step]) == json.loads(states[step])
        got.append(helpers.detach(next(saver)))
    assert next(saver, None) is None  # two epochs, then the end
    saver.close()
    assert rows(got) == rows(expected)
    for a, b in zip(got, expected, strict=True):
        for key in b:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    # The states equal the reference's whatever the worker count (checked
    # above), so each state is restored under one other count: over the three
    # cases every ordered (saved, restored) pair of counts runs once, and each
    # count restores one step before the epoch boundary and one after (all
    # four restores per case: 25 worker starts in all, 15 now).
    others = {0: (2, 3), 2: (3, 0), 3: (0, 2)}[saved_with]
    for restore_with, (step, state) in zip(others, sorted(saved.items()), strict=True):
        it = iter(build(helpers, csr_paths, workers=restore_with))
        it.set_state(state)
        rest = helpers.take(it)
        it.close()
        assert rows(rest) == rows(expected[step:]), (restore_with, step)
        # Before + after: every cell once per epoch (fetches may span the
        # epoch boundary, so epochs are not whole minibatches).
        both = np.concatenate([real_rows(expected[:step]), real_rows(rest)])
        counts = np.bincount(both, minlength=helpers.N_CELLS)
        assert counts.tolist() == [2] * helpers.N_CELLS


@pytest.mark.slow  # a restore at every step (~5 s)
def test_grain_checks_restores_at_every_step(csr_paths):
    source = grain_cells.AnnDataSource(csr_paths, block_size=4)
    ds = grain_cells.cell_dataset(
        source, batch_size=4, fetch_factor=4, seed=3, num_epochs=1
    )
    grain.experimental.assert_equal_output_after_checkpoint(ds)


def lock_step(iterators, steps):
    """`steps` minibatches from each iterator, as in data-parallel training."""
    out = [[] for _ in iterators]
    for _ in range(steps):
        for got, it in zip(out, iterators, strict=True):
            got.append(next(it))
    return out


def shards(helpers, paths, count, **kw):
    return [
        iter(build(helpers, paths, shard=sharding.ShardOptions(i, count), **kw))
        for i in range(count)
    ]


def restore_all(helpers, paths, count, state, **kw):
    """The rest of the stream of each of `count` shards restored from `state`."""
    out = []
    for it in shards(helpers, paths, count, **kw):
        it.set_state(state)
        out.append(helpers.take(it))
    return out


@pytest.mark.parametrize("step", [1, 3, 6, 9])
@pytest.mark.parametrize("old, new", [(2, 1), (1, 2)])
def test_shard_count_change_visits_the_rest_exactly_once(
    csr_paths, helpers, step, old, new
):
    kw = {"num_epochs": 1}
    olds = shards(helpers, csr_paths, old, **kw)
    before = lock_step(olds, step)
    states = [it.get_state() for it in olds]
    after = restore_all(helpers, csr_paths, new, states[0], **kw)
    # Every old shard's state (same step) hands over the same way.
    for state in states[1:]:
        again = restore_all(helpers, csr_paths, new, state, **kw)
        assert [rows(a) for a in again] == [rows(a) for a in after]
    seen = np.concatenate([real_rows(b) for b in before + after])
    assert np.sort(seen).tolist() == list(range(helpers.N_CELLS))


def test_shard_change_twice_through_pieces(csr_paths, helpers):
    """2 -> 1 mid-fetch, then 1 -> 2 while the hand-over's pieces are left."""
    kw = {"num_epochs": 1}
    olds = shards(helpers, csr_paths, 2, **kw)
    first = lock_step(olds, 3)
    one = shards(helpers, csr_paths, 1, **kw)[0]
    one.set_state(olds[0].get_state())
    middle = [helpers.detach(next(one))]
    assert json.loads(one.get_state())["position"]["pieces"]
    last = restore_all(helpers, csr_paths, 2, one.get_state(), **kw)
    seen = np.concatenate([real_rows(b) for b in [*first, middle, *last]])
    assert np.sort(seen).tolist() == list(range(helpers.N_CELLS))


def test_shard_change_that_changes_the_epoch_is_refused(csr_paths, helpers):
    # block_size 5: 59 blocks; 2 shards walk 58 per epoch, 1 shard 59.
    kw = {"num_epochs": 1, "block_size": 5, "fetch_factor": 5}
    it = shards(helpers, csr_paths, 2, **kw)[0]
    next(it)
    target = iter(build(helpers, csr_paths, **kw))
    with pytest.raises(CheckpointMismatchError, match="epoch_length: saved 58, now 59"):
        target.set_state(it.get_state())


def test_shard_change_with_a_condition_is_refused(csr_paths):
    source = grain_cells.AnnDataSource(csr_paths, block_size=4, obs_columns=["plate"])
    kw = {"batch_size": 4, "fetch_factor": 4, "condition": "plate"}
    ds = grain_cells.cell_dataset(
        source, shard_options=sharding.ShardOptions(0, 2), **kw
    )
    it = iter(ds)
    next(it)
    one = iter(grain_cells.cell_dataset(source, **kw))
    with pytest.raises(CheckpointMismatchError, match="condition='plate'"):
        one.set_state(it.get_state())


def test_hand_over_at_a_fetch_boundary_hands_no_fetch_over_whole(csr_paths, helpers):
    """Saved with nothing of the next fetch emitted: the new shards continue the
    stream from there, evenly; mid-fetch, the rest of that fetch is a piece."""
    kw = {"num_epochs": None}
    (one,) = shards(helpers, csr_paths, 1, **kw)
    next(one)
    mid = one.get_state()
    while json.loads(one.get_state())["position"]["fetch"] < 3:
        next(one)
    boundary = one.get_state()
    saved = json.loads(boundary)["position"]
    assert (saved["fetch"], saved["minibatch"]) == (3, 0)
    g = CONFIG["batch_size"] * CONFIG["fetch_factor"] // CONFIG["block_size"]
    for q, it in enumerate(shards(helpers, csr_paths, 2, **kw)):
        it.set_state(boundary)
        position = json.loads(it.get_state())["position"]
        assert (position["pieces"], position["origin"]) == ([], 3 * g)
        it.set_state(mid)
        position = json.loads(it.get_state())["position"]
        assert len(position["pieces"]) == 1 and position["origin"] == g
        # Shard 0 goes on with the piece's second minibatch; shard 1 with the plan.
        assert (position["fetch"], position["minibatch"]) == (0, 1 - q)
