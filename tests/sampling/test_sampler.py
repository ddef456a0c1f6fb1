"""BlockSampler: stream length, order, sharding, validation and identity."""

from __future__ import annotations

import pickle
import sys

import cloudpickle
import grain
import numpy as np
import pytest
from grain import sharding

from grain_cells import AnnDataSource, BlockSampler


def keys(sampler, positions) -> np.ndarray:
    return np.array([sampler[p].record_key for p in positions], np.int64)


def stream(sampler) -> np.ndarray:
    return keys(sampler, range(len(sampler)))


SIZES = [
    pytest.param(1, id="1"),
    pytest.param(2, id="2"),
    pytest.param(3, id="3"),
    pytest.param(7, id="7"),
    pytest.param(59, id="59"),
    pytest.param(288, id="288"),
    pytest.param(4097, id="4097"),
]


@pytest.mark.parametrize(
    "kwargs, length",
    [
        pytest.param({"num_blocks": 59}, 59, id="one-epoch"),
        pytest.param({"num_blocks": 59, "num_epochs": 3}, 177, id="three-epochs"),
        pytest.param(
            {"num_blocks": 59, "shard_options": sharding.ShardOptions(1, 3)},
            57,
            id="3-shards",
        ),
        pytest.param(
            {
                "num_blocks": 59,
                "num_epochs": 2,
                "shard_options": sharding.ShardOptions(0, 2),
            },
            116,
            id="2-shards-2-epochs",
        ),
        pytest.param({"num_blocks": 59, "num_epochs": None}, sys.maxsize, id="endless"),
        pytest.param({"num_blocks": 1}, 1, id="one-block"),
    ],
)
def test_len_and_end(kwargs, length):
    sampler = BlockSampler(**kwargs)
    assert len(sampler) == length
    if kwargs.get("num_epochs", 1) is None:
        far = sampler[10**12]  # an endless stream has no end
        assert far.index == 10**12
        assert 0 <= far.record_key < kwargs["num_blocks"]
        return
    last = sampler[length - 1]
    assert last.index == length - 1
    assert 0 <= last.record_key < kwargs["num_blocks"]
    for past in (length, length + 1, 10**9):
        with pytest.raises(IndexError, match="past the end"):
            sampler[past]
    with pytest.raises(IndexError):
        sampler[-1]


@pytest.mark.parametrize("num_blocks", SIZES)
def test_metadata(num_blocks):
    sampler = BlockSampler(num_blocks, seed=3, num_epochs=2)
    for p in range(len(sampler)):
        meta = sampler[p]
        assert isinstance(meta, grain.RecordMetadata)
        assert meta.index == p
        assert meta.record_key == sampler.block_at(p)
        assert 0 <= meta.record_key < num_blocks


@pytest.mark.parametrize("num_blocks", SIZES)
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffle", "in-order"])
def test_epoch_order_is_a_permutation(num_blocks, shuffle):
    sampler = BlockSampler(num_blocks, shuffle=shuffle, seed=11, num_epochs=3)
    for epoch in range(3):
        order = sampler.epoch_order(epoch)
        assert order.dtype == np.int64
        np.testing.assert_array_equal(np.sort(order), np.arange(num_blocks))
        positions = range(epoch * num_blocks, (epoch + 1) * num_blocks)
        np.testing.assert_array_equal(keys(sampler, positions), order)
        if not shuffle:
            np.testing.assert_array_equal(order, np.arange(num_blocks))


def test_in_order_stream():
    sampler = BlockSampler(59, shuffle=False, seed=5, num_epochs=2)
    np.testing.assert_array_equal(stream(sampler), np.tile(np.arange(59), 2))


@pytest.mark.parametrize(
    "a, b, same",
    [
        pytest.param({"seed": 1}, {"seed": 1}, True, id="same-seed"),
        pytest.param({"seed": 1}, {"seed": 2}, False, id="other-seed"),
        pytest.param({"seed": 0}, {"seed": 2**31 - 1}, False, id="extreme-seeds"),
        # The stream is a pure function of (seed, epoch, position).
        pytest.param({"num_epochs": 1}, {"num_epochs": None}, True, id="endless"),
    ],
)
def test_determinism(a, b, same):
    sa, sb = BlockSampler(288, **a), BlockSampler(288, **b)
    first_a, first_b = sa.epoch_order(0), sb.epoch_order(0)
    assert np.array_equal(first_a, first_b) == same
    assert np.array_equal(keys(sa, range(288)), keys(sb, range(288))) == same
    # A fresh, unpickled or cloudpickled copy gives the same stream.
    for copy in (
        BlockSampler(288, **a),
        pickle.loads(pickle.dumps(sa)),
        cloudpickle.loads(cloudpickle.dumps(sa)),
    ):
        np.testing.assert_array_equal(keys(copy, range(288)), first_a)


def test_epochs_differ():
    sampler = BlockSampler(288, seed=4, num_epochs=None)
    orders = [sampler.epoch_order(e) for e in range(5)]
    for i in range(5):
        for j in range(i + 1, 5):
            assert not np.array_equal(orders[i], orders[j]), (i, j)
    # Not the identity either, nor a rotation of it.
    assert not np.array_equal(np.diff(orders[0]) % 288, np.ones(287))


@pytest.mark.parametrize(
    "num_blocks, count",
    [
        pytest.param(59, 1, id="59/1"),
        pytest.param(59, 2, id="59/2"),
        pytest.param(59, 3, id="59/3"),
        pytest.param(60, 3, id="60/3"),
        pytest.param(20, 7, id="20/7"),
        pytest.param(5, 5, id="5/5"),
    ],
)
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffle", "in-order"])
def test_shard_sizing(num_blocks, count, shuffle):
    epochs = 2
    samplers = [
        BlockSampler(
            num_blocks,
            shuffle=shuffle,
            seed=9,
            num_epochs=epochs,
            shard_options=sharding.ShardOptions(i, count),
        )
        for i in range(count)
    ]
    epoch_length = num_blocks - num_blocks % count
    orders = [samplers[0].epoch_order(e) for e in range(epochs)]
    skipped = [samplers[0].skipped_blocks(e) for e in range(epochs)]
    for epoch, (order, skip) in enumerate(zip(orders, skipped, strict=True)):
        assert skip.size == num_blocks % count
        assert order.size == epoch_length
        assert np.unique(order).size == epoch_length
        assert not np.isin(skip, order).any()
        np.testing.assert_array_equal(
            np.sort(np.concatenate([order, skip])), np.arange(num_blocks)
        )
        if not shuffle:
            np.testing.assert_array_equal(skip, np.arange(epoch_length, num_blocks))
        # Grain gives shard i of n the positions i, i + n, ...: the shards of
        # one epoch are equal in size, disjoint, and cover the epoch.
        base = epoch * epoch_length
        parts = [
            keys(samplers[i], range(base + i, base + epoch_length, count))
            for i in range(count)
        ]
        assert {p.size for p in parts} == {epoch_length // count}
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.sort(order))
    for s in samplers:
        assert s.epoch_length == epoch_length
        assert s.epoch_length % count == 0
        assert len(s) == epochs * epoch_length
    # Every shard agrees on what an epoch skips (the shard only picks positions).
    np.testing.assert_array_equal(samplers[-1].skipped_blocks(1), skipped[1])
    if shuffle and num_blocks % count and num_blocks > 20:
        # Different blocks are skipped in different epochs.
        assert not np.array_equal(skipped[0], skipped[1])


def test_one_shard_skips_nothing():
    sampler = BlockSampler(59, num_epochs=2)
    assert sampler.skipped_blocks(0).size == 0
    assert sampler.skipped_blocks(1).size == 0
    assert sampler.epoch_length == 59


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"num_blocks": 59}, id="default"),
        pytest.param(
            {
                "num_blocks": 7,
                "shuffle": False,
                "seed": 2**31 - 1,
                "num_epochs": None,
                "shard_options": sharding.ShardOptions(2, 3),
            },
            id="everything",
        ),
    ],
)
def test_repr_stable_across_pickling(kwargs):
    sampler = BlockSampler(**kwargs)
    text = repr(sampler)
    assert text == repr(BlockSampler(**kwargs))
    for copy in (
        pickle.loads(pickle.dumps(sampler)),
        cloudpickle.loads(cloudpickle.dumps(sampler)),
    ):
        assert repr(copy) == text
        for p in (0, 1, 5, 6):
            assert copy[p] == sampler[p]
    # repr is evaluated-once stable: using the sampler does not change it.
    sampler[3]
    sampler.epoch_order(0)
    assert repr(sampler) == text


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"num_blocks": 60}, id="num_blocks"),
        pytest.param({"shuffle": False}, id="shuffle"),
        pytest.param({"seed": 1}, id="seed"),
        pytest.param({"num_epochs": 2}, id="num_epochs"),
        pytest.param({"num_epochs": None}, id="endless"),
        pytest.param({"shard_options": sharding.ShardOptions(0, 2)}, id="shard_count"),
    ],
)
def test_repr_names_every_setting(change):
    """Grain compares repr(sampler) on restore: every setting must show in it."""
    base = {"num_blocks": 59, "shuffle": True, "seed": 0, "num_epochs": 1}
    assert repr(BlockSampler(**base)) != repr(BlockSampler(**{**base, **change}))


def test_repr_names_shard_index():
    a = BlockSampler(59, shard_options=sharding.ShardOptions(0, 2))
    b = BlockSampler(59, shard_options=sharding.ShardOptions(1, 2))
    assert repr(a) != repr(b)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        pytest.param({"num_blocks": 0}, ValueError, "num_blocks", id="no-blocks"),
        pytest.param({"num_blocks": -3}, ValueError, "num_blocks", id="negative"),
        pytest.param({"num_epochs": 0}, ValueError, "num_epochs", id="zero-epochs"),
        pytest.param({"num_epochs": -1}, ValueError, "num_epochs", id="neg-epochs"),
        pytest.param({"num_epochs": 1.5}, ValueError, "num_epochs", id="frac-epochs"),
        pytest.param({"seed": -1}, ValueError, "seed", id="negative-seed"),
        pytest.param({"seed": 2**63}, ValueError, "seed", id="seed-too-big"),
        pytest.param(
            {"num_blocks": 2, "shard_options": sharding.ShardOptions(0, 3)},
            ValueError,
            "cannot be split over 3 shards",
            id="fewer-blocks-than-shards",
        ),
    ],
)
def test_argument_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        BlockSampler(**{"num_blocks": 10, **kwargs})


def test_accepts_a_source(csr_paths):
    source = AnnDataSource(csr_paths, block_size=16)
    sampler = BlockSampler(source, seed=2)
    assert sampler.num_blocks == len(source) == 7 + 9 + 4
    np.testing.assert_array_equal(
        sampler.epoch_order(0), BlockSampler(len(source), seed=2).epoch_order(0)
    )
    assert repr(sampler) == repr(BlockSampler(len(source), seed=2))
    source.close()


def test_shard_by_jax_process():
    shard = sharding.ShardByJaxProcess(drop_remainder=True)
    sampler = BlockSampler(59, seed=1, shard_options=shard)
    assert (sampler.shard_options.shard_index, sampler.shard_options.shard_count) == (
        0,
        1,
    )
    assert sampler.epoch_length == 59
    assert len(sampler) == 59
    assert sampler.skipped_blocks(0).size == 0
    assert "shard_index=0, shard_count=1" in repr(sampler)
    np.testing.assert_array_equal(
        stream(sampler), BlockSampler(59, seed=1).epoch_order(0)
    )


def test_sampler_sharding_reaches_the_dataloader(csr_paths):
    """grain.DataLoader takes its shard options from the sampler."""
    import grain_cells

    source = AnnDataSource(csr_paths, block_size=16)
    shard = sharding.ShardOptions(1, 3)
    sampler = BlockSampler(len(source), seed=2, shard_options=shard)
    loader = grain.DataLoader(
        data_source=source,
        sampler=sampler,
        read_options=grain_cells.pipeline.READ_OPTIONS,
    )
    blocks = [b.index for b in loader]
    np.testing.assert_array_equal(blocks, sampler.epoch_order(0)[1::3])
    source.close()
