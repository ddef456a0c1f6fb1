"""Golden orders: fixed seeds give fixed row ids, on every platform and version.

A saved iterator is a position; what it resumes into is recomputed from
(seed, epoch, position). If a dependency upgrade changed any of these orders,
every checkpoint would silently resume into other cells. So each order is
pinned here by value: the block order (Grain's `index_shuffle`, seeded per
epoch through NumPy's `SeedSequence`), the in-fetch shuffle
(`counter_rng.permutation`, owned by grain_cells), the weighted draws
(`counter_rng.uniform`) and the splits (`counter_rng.hash64`). A failure
here after an upgrade means: pin the old dependency, or own the order and
say in the release notes that old checkpoints resume differently.

Also restores iterators at every step with Grain's own checker,
`grain.experimental.assert_equal_output_after_checkpoint`.
"""

from __future__ import annotations

import grain
import numpy as np
import pytest

import grain_cells
from grain_cells._util import counter_rng

# The conftest files: 97 + 130 + 61 = 288 cells; blocks of 4 give 74 blocks.
BLOCK = 4


@pytest.fixture(scope="module")
def source(csr_paths):
    src = grain_cells.AnnDataSource(csr_paths, block_size=BLOCK, obs_columns=["plate"])
    assert len(src) == 74
    yield src
    src.close()


def test_counter_rng_values():
    assert counter_rng.hash64(7, 0, np.arange(3)).tolist() == [
        11241344834629033336,
        17770702679626417888,
        5398316625919644772,
    ]
    assert [counter_rng.hash64_int(7, 0, i) for i in range(3)] == (
        counter_rng.hash64(7, 0, np.arange(3)).tolist()
    )
    assert counter_rng.uniform(7, 1, np.arange(2)).tolist() == [
        0.43775600474440823,
        0.7901067743608727,
    ]
    assert counter_rng.permutation(12, 7, 42).tolist() == [
        8, 10, 3, 6, 9, 11, 7, 0, 1, 4, 5, 2,
    ]  # fmt: skip


def test_grain_index_shuffle_values():
    # BlockSampler's permutation is Grain's Feistel network (C++): pinned here
    # so that a Grain upgrade that changes it fails loudly.
    order = [
        grain.experimental.index_shuffle(i, max_index=9, seed=12345, rounds=4)
        for i in range(10)
    ]
    assert order == [0, 4, 7, 8, 3, 6, 9, 5, 1, 2]


def test_block_sampler_order():
    sampler = grain_cells.BlockSampler(18, seed=3, num_epochs=2)
    assert sampler.epoch_order(0).tolist() == [
        0, 3, 14, 17, 4, 5, 10, 7, 9, 15, 6, 1, 11, 8, 12, 13, 16, 2,
    ]  # fmt: skip
    assert sampler.epoch_order(1).tolist() == [
        4, 17, 16, 7, 5, 3, 1, 12, 15, 0, 2, 13, 14, 8, 11, 10, 9, 6,
    ]  # fmt: skip
    assert [sampler[p].record_key for p in (18, 19, 35)] == [4, 17, 6]


def test_block_sampler_order_with_shards():
    sampler = grain_cells.BlockSampler(
        18,
        seed=3,
        num_epochs=None,
        shard_options=grain.sharding.ShardOptions(1, 4),
    )
    # Same order as one shard, less the last 18 % 4 blocks.
    assert sampler.epoch_order(0).tolist() == [
        0, 3, 14, 17, 4, 5, 10, 7, 9, 15, 6, 1, 11, 8, 12, 13,
    ]  # fmt: skip
    assert sampler.skipped_blocks(0).tolist() == [2, 16]


def test_weighted_draws(source):
    weights = (np.arange(len(source)) % 3).astype(float)
    sampler = grain_cells.WeightedBlockSampler(
        source, weights, seed=11, epoch_blocks=30, num_epochs=None
    )
    first = [19, 55, 16, 14, 40, 50, 23, 56, 22, 56, 64, 32]
    assert sampler.blocks_at(np.arange(12)).tolist() == first
    assert [sampler.block_at(p) for p in range(12)] == first
    assert sampler.blocks_at(np.arange(30, 36)).tolist() == [22, 7, 38, 43, 31, 14]


# Row ids of the first three minibatches: block 4, batch 8, fetch factor 2
# (so 4 blocks per fetch), seed 5.
FIRST_MINIBATCHES = [
    [262, 265, 59, 57, 263, 266, 264, 29],
    [259, 28, 260, 261, 58, 56, 31, 30],
    [52, 129, 206, 109, 130, 110, 55, 54],
]


def test_in_fetch_shuffle_through_the_data_loader(csr_paths, helpers):
    _, _, loader = helpers.build(
        csr_paths, block_size=BLOCK, batch_size=8, fetch_factor=2, seed=5
    )
    batches = helpers.run(loader, 3)
    assert [b["row_ids"].tolist() for b in batches] == FIRST_MINIBATCHES


def test_in_fetch_shuffle_through_cell_dataset(source):
    ds = grain_cells.cell_dataset(source, batch_size=8, fetch_factor=2, seed=5)
    iterator = iter(ds)
    assert [next(iterator)["row_ids"].tolist() for _ in range(3)] == (FIRST_MINIBATCHES)


def _first_rows(view) -> list[int]:
    return view.block_ranges(np.arange(len(view)))[1].tolist()


def test_split_by_fraction_over_blocks(source):
    splits = grain_cells.split_by_fraction(source, {"a": 0.7, "b": 0.3}, seed=2)
    assert _first_rows(splits["b"]) == [
        4, 8, 20, 68, 80, 97, 101, 105, 109, 113, 117, 125, 133, 137, 169, 189,
        197, 221, 255, 267, 283, 287,
    ]  # fmt: skip


def test_split_by_fraction_over_a_cell_grid(source):
    splits = grain_cells.split_by_fraction(
        source, {"a": 0.7, "b": 0.3}, seed=2, unit_cells=10
    )
    assert _first_rows(splits["b"]) == [
        10, 14, 18, 22, 26, 80, 84, 88, 97, 101, 105, 109, 113, 117, 121, 125,
        137, 141, 145, 149, 153, 267, 271, 275, 287,
    ]  # fmt: skip


def test_split_by_fraction_over_obs_groups(source):
    splits = grain_cells.split_by_fraction(
        source, {"a": 0.7, "b": 0.3}, seed=2, by="plate"
    )
    held = splits["b"].read_blocks(np.arange(len(splits["b"])))
    plates = source.categories["plate"][np.unique(held.obs["plate"])]
    assert plates.tolist() == ["plate1", "plate4"]


@pytest.mark.parametrize(
    "weighted", [pytest.param(False, id="block"), pytest.param(True, id="weighted")]
)
def test_restores_at_every_step(source, weighted):
    """Grain's checker: a state saved before any minibatch restores to the
    rest of the stream, across fetches, mid-fetch and an epoch boundary (15
    blocks are not a multiple of 4 blocks per fetch, so a fetch spans it)."""
    view = source.select(np.arange(58))  # 14 blocks of 4, one of 2
    assert len(view) == 15
    sampler = None
    if weighted:
        weights = (np.arange(len(view)) % 3).astype(float)
        sampler = grain_cells.WeightedBlockSampler(
            view, weights, seed=11, epoch_blocks=10, num_epochs=2
        )
    ds = grain_cells.cell_dataset(
        view, batch_size=8, fetch_factor=2, seed=5, num_epochs=2, sampler=sampler
    )
    grain.experimental.assert_equal_output_after_checkpoint(ds)
