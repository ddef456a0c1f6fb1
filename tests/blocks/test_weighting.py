"""Weighted and class-balanced block sampling: shares, determinism, resume."""

from __future__ import annotations

import collections
import pickle

import anndata as ad
import cloudpickle
import grain
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from grain import sharding

import grain_cells
from grain_cells import WeightedBlockSampler
from grain_cells._util import counter_rng

# A label-sorted atlas, 80/15/5, in two files; the class boundaries (1601,
# 1898) fall inside blocks of 4, so two blocks mix classes.
FILE_SIZES = (1203, 797)
COUNTS = {"common": 1601, "mid": 297, "rare": 102}
N_CELLS, N_GENES, BLOCK = sum(FILE_SIZES), 6, 4


def _write(directory, labels, sizes) -> list[str]:
    paths, offset = [], 0
    categories = list(dict.fromkeys(labels))
    for f, n in enumerate(sizes):
        rows = np.arange(offset, offset + n)
        x = sp.csr_matrix(
            ((rows * 100 + 1).astype(np.float32), (np.arange(n), rows % N_GENES)),
            shape=(n, N_GENES),
        )
        obs = pd.DataFrame(
            {
                "label": pd.Categorical(labels[offset : offset + n], categories),
                "idx": rows,
            },
            index=[f"c{r}" for r in rows],
        )
        var = pd.DataFrame(index=[f"g{j}" for j in range(N_GENES)])
        path = str(directory / f"part{f}.h5ad")
        ad.AnnData(x, obs=obs, var=var).write_h5ad(path)
        paths.append(path)
        offset += n
    return paths


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    labels = np.repeat(list(COUNTS), list(COUNTS.values()))
    return _write(tmp_path_factory.mktemp("sorted"), labels, FILE_SIZES)


@pytest.fixture(scope="module")
def source(paths):
    s = grain_cells.AnnDataSource(paths, block_size=BLOCK, obs_columns=["label", "idx"])
    yield s
    s.close()


def loader_for(source, sampler, *, worker_count=0, batch_size=16, fetch_factor=4):
    return grain_cells.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=grain_cells.fetch_operations(
            source, batch_size=batch_size, fetch_factor=fetch_factor, seed=sampler.seed
        ),
        worker_count=worker_count,
    )


def real(batches, key="row_ids") -> np.ndarray:
    return np.concatenate([b[key][b["mask"]] for b in batches])


# -- block weights -------------------------------------------------------------


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_block_weights(source, reduce):
    rng = np.random.default_rng(0)
    w = rng.random(N_CELLS)
    view = source.select(rng.random(N_CELLS) < 0.7)  # gaps: short blocks
    got = grain_cells.block_weights(view, w, reduce=reduce)
    _, starts, stops = view.block_ranges(np.arange(len(view)))
    want = [getattr(np, reduce)(w[a:b]) for a, b in zip(starts, stops, strict=True)]
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize(
    "shares, tolerance",
    [
        pytest.param(None, 1e-6, id="equal"),
        pytest.param({"common": 0.5, "mid": 0.3, "rare": 0.2}, 1e-6, id="given"),
        pytest.param({"common": 1, "mid": 1, "rare": 2}, 1e-6, id="unnormalised"),
        # The two blocks that mix "mid" with its neighbours keep it above 0.
        pytest.param({"common": 1, "rare": 1}, 0.01, id="a-zero-share"),
    ],
)
def test_balanced_weights_hit_the_targets(source, shares, tolerance):
    if tolerance > 1e-6:
        with pytest.warns(UserWarning, match="mix classes"):
            weights = grain_cells.balanced_block_weights(source, "label", shares=shares)
    else:
        weights = grain_cells.balanced_block_weights(source, "label", shares=shares)
    assert weights.shape == (len(source),) and (weights >= 0).all()
    got = grain_cells.expected_shares(source, "label", weights)
    if shares is None:
        want = dict.fromkeys(COUNTS, 1 / 3)
    else:
        total = sum(shares.values())
        want = {k: shares.get(k, 0) / total for k in COUNTS}
    assert got == pytest.approx(want, abs=tolerance)
    # Uniform weights give the file's own composition.
    uniform = grain_cells.expected_shares(source, "label", np.ones(len(source)))
    assert uniform == pytest.approx(
        {k: v / N_CELLS for k, v in COUNTS.items()}, abs=2e-3
    )


def test_unreachable_targets_warn(tmp_path):
    # Every block holds one cell of each class: no weighting can change shares.
    labels = np.tile(["a", "b"], 50)
    paths = _write(tmp_path, labels, (100,))
    source = grain_cells.AnnDataSource(paths, block_size=2, obs_columns=["label"])
    with pytest.warns(UserWarning, match="mix classes"):
        w = grain_cells.balanced_block_weights(
            source, "label", shares={"a": 0.8, "b": 0.2}
        )
    assert grain_cells.expected_shares(source, "label", w) == pytest.approx(
        {"a": 0.5, "b": 0.5}
    )
    source.close()


# -- sampling ------------------------------------------------------------------


@pytest.mark.parametrize(
    "shares",
    [
        pytest.param(None, id="equal"),
        pytest.param({"common": 0.2, "mid": 0.3, "rare": 0.5}, id="given"),
    ],
)
def test_class_balance_over_an_epoch(source, helpers, shares):
    weights = grain_cells.balanced_block_weights(source, "label", shares=shares)
    sampler = WeightedBlockSampler(source, weights, epoch_cells=12_000, seed=7)
    # Short blocks (file ends) make a draw hold slightly fewer cells than 4.
    _, starts, stops = source.block_ranges(np.arange(len(source)))
    per_draw = sampler.probabilities @ (stops - starts)
    assert 3.9 < per_draw < BLOCK
    assert sampler.epoch_length == np.ceil(12_000 / per_draw)
    batches = helpers.run(loader_for(source, sampler))
    labels = source.categories["label"][real(batches, "obs/label")]
    counts = collections.Counter(labels.tolist())
    n = sum(counts.values())
    assert n == pytest.approx(12_000, rel=0.02)
    target = shares or dict.fromkeys(COUNTS, 1 / 3)
    for label, share in target.items():
        assert counts[label] / n == pytest.approx(share, abs=0.03), counts
    # Without weights the rare class is as rare as in the file.
    flat = WeightedBlockSampler(
        source, np.ones(len(source)), epoch_cells=12_000, seed=7
    )
    keys = flat.epoch_order(0)
    rare_blocks = np.flatnonzero(
        source.block_ranges(np.arange(len(source)))[1] >= N_CELLS - COUNTS["rare"]
    )
    assert np.isin(keys, rare_blocks).mean() < 0.1


def test_stream_is_a_pure_function_of_seed_epoch_position(source):
    weights = grain_cells.balanced_block_weights(source, "label")
    a = WeightedBlockSampler(source, weights, seed=3, num_epochs=3)
    b = WeightedBlockSampler(source, weights, seed=3, num_epochs=None)
    c = WeightedBlockSampler(source, weights, seed=4, num_epochs=3)
    positions = np.arange(len(a))
    stream = np.array([a[int(p)].record_key for p in positions])
    np.testing.assert_array_equal(a.blocks_at(positions), stream)  # both paths
    np.testing.assert_array_equal(b.blocks_at(positions), stream)
    assert (c.blocks_at(positions) != stream).mean() > 0.5
    for copy in (
        pickle.loads(pickle.dumps(a)),
        cloudpickle.loads(cloudpickle.dumps(a)),
    ):
        np.testing.assert_array_equal(copy.blocks_at(positions), stream)
    # Epochs differ; every record is a drawable block.
    assert not np.array_equal(a.epoch_order(0), a.epoch_order(1))
    assert (weights[stream] > 0).all()


def test_golden_draws():
    """Cross-version determinism: the hash and the draws are pinned."""
    assert counter_rng.hash64_int(7, 0, 0) == 11241344834629033336
    np.testing.assert_array_equal(
        counter_rng.hash64(7, 0, np.arange(3)),
        np.array(
            [11241344834629033336, 17770702679626417888, 5398316625919644772], np.uint64
        ),
    )
    sampler = WeightedBlockSampler(10, np.arange(10.0), seed=5, num_epochs=None)
    np.testing.assert_array_equal(
        sampler.blocks_at([0, 1, 2, 3, 10, 11, 10**9]), GOLDEN
    )


GOLDEN = [8, 9, 7, 3, 8, 9, 6]


def test_draw_frequencies_follow_weights():
    weights = np.array([0.0, 1.0, 2.0, 0.0, 5.0, 0.0])
    sampler = WeightedBlockSampler(6, weights, epoch_blocks=80_000, seed=1)
    counts = np.bincount(sampler.epoch_order(0), minlength=6) / 80_000
    np.testing.assert_allclose(counts, weights / weights.sum(), atol=0.01)
    assert counts[[0, 3, 5]].sum() == 0
    np.testing.assert_allclose(sampler.probabilities, weights / 8)


@pytest.mark.parametrize(
    "workers, stop",
    [
        pytest.param(0, 0, id="inline-start"),
        pytest.param(0, 5, id="inline-mid-fetch"),
        pytest.param(0, 16, id="inline-fetch-boundary"),
        pytest.param(2, 7, id="two-workers", marks=pytest.mark.slow),
    ],
)
def test_resume_through_the_loader(source, helpers, workers, stop):
    weights = grain_cells.balanced_block_weights(source, "label")

    def build():
        sampler = WeightedBlockSampler(source, weights, epoch_blocks=160, seed=2)
        return loader_for(source, sampler, worker_count=workers)

    everything = helpers.run(build())
    iterator = iter(build())
    try:
        if stop:
            helpers.take(iterator, stop)
        state = iterator.get_state()
    finally:
        helpers.close_iterator(iterator)
    restored = iter(build())
    try:
        restored.set_state(state)
        rest = helpers.take(restored)
    finally:
        helpers.close_iterator(restored)
    assert len(rest) == len(everything) - stop
    for a, b in zip(rest, everything[stop:], strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    # A state from another weighting is refused.
    other = WeightedBlockSampler(source, np.ones(len(source)), epoch_blocks=160, seed=2)
    mismatched = iter(loader_for(source, other, worker_count=workers))
    try:
        with pytest.raises(grain_cells.errors.CheckpointMismatchError, match="sampler"):
            mismatched.set_state(state)
    finally:
        helpers.close_iterator(mismatched)


@pytest.mark.parametrize("count", [2, 3])
def test_shards_are_equal_and_disjoint(source, count):
    weights = grain_cells.balanced_block_weights(source, "label")
    samplers = [
        WeightedBlockSampler(
            source,
            weights,
            epoch_blocks=100,
            seed=4,
            num_epochs=2,
            shard_options=sharding.ShardOptions(i, count),
        )
        for i in range(count)
    ]
    length = samplers[0].epoch_length
    assert length % count == 0 and length >= 100
    assert {len(s) for s in samplers} == {2 * length}
    order = np.concatenate([samplers[0].epoch_order(e) for e in range(2)])
    positions = []
    for i, s in enumerate(samplers):
        loader = grain.DataLoader(
            data_source=source,
            sampler=s,
            read_options=grain_cells.pipeline.READ_OPTIONS,
        )
        records = list(loader)
        assert len(records) == 2 * length // count  # equal shards
        np.testing.assert_array_equal([r.index for r in records], order[i::count])
        positions.append(np.arange(i, 2 * length, count))
    everything = np.concatenate(positions)
    assert np.unique(everything).size == everything.size == 2 * length


def test_a_block_twice_in_a_fetch_comes_out_twice(source, helpers):
    weights = np.zeros(len(source))
    weights[[3, 300]] = [1.0, 2.0]  # two blocks: every fetch repeats them
    sampler = WeightedBlockSampler(source, weights, epoch_blocks=40, seed=9)
    batches = helpers.run(loader_for(source, sampler))
    rows = real(batches)
    draws = np.bincount(sampler.epoch_order(0), minlength=len(source))
    assert draws[3] > 1 and draws[300] > 1
    want = {}
    for k in (3, 300):
        for r in range(source[k].start, source[k].stop):
            want[r] = draws[k]
    assert collections.Counter(rows.tolist()) == want
    # And the values are those rows' values.
    for b in batches:
        m = sp.csr_matrix((b["data"], b["indices"], b["indptr"]), shape=(16, N_GENES))
        ids = b["row_ids"][b["mask"]]
        np.testing.assert_array_equal(m.sum(axis=1).A1[: ids.size], ids * 100 + 1)


def test_on_a_split(source, helpers):
    splits = grain_cells.split_by_fraction(source, {"train": 0.8, "val": 0.2}, seed=0)
    train = splits["train"]
    weights = grain_cells.balanced_block_weights(train, "label")
    sampler = WeightedBlockSampler(train, weights, epoch_cells=2000, seed=1)
    rows = real(helpers.run(loader_for(train, sampler)))
    val_rows = splits["val"].block_table.cell_mask()
    assert not val_rows[rows].any()


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="default"),
        pytest.param(
            {
                "epoch_cells": 999,
                "seed": 2**31 - 1,
                "num_epochs": None,
                "shard_options": sharding.ShardOptions(2, 3),
            },
            id="everything",
        ),
    ],
)
def test_repr_stable_across_pickling(source, kwargs):
    weights = grain_cells.balanced_block_weights(source, "label")
    sampler = WeightedBlockSampler(source, weights, **kwargs)
    text = repr(sampler)
    assert text == repr(WeightedBlockSampler(source, weights.copy(), **kwargs))
    for copy in (
        pickle.loads(pickle.dumps(sampler)),
        cloudpickle.loads(cloudpickle.dumps(sampler)),
    ):
        assert repr(copy) == text
        for p in (0, 1, 5, 6):
            assert copy[p] == sampler[p]
    sampler[3]
    sampler.epoch_order(0)
    assert repr(sampler) == text


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"weights": "other"}, id="weights"),
        pytest.param({"epoch_blocks": 7}, id="epoch"),
        pytest.param({"seed": 1}, id="seed"),
        pytest.param({"num_epochs": None}, id="endless"),
        pytest.param({"shard_options": sharding.ShardOptions(1, 2)}, id="shard"),
    ],
)
def test_repr_names_every_setting(change):
    base = {"weights": np.arange(1.0, 11.0), "seed": 0, "num_epochs": 1}
    if change.get("weights") == "other":
        change = {"weights": np.arange(1.0, 11.0)[::-1].copy()}
    a = WeightedBlockSampler(10, **base)
    b = WeightedBlockSampler(10, **{**base, **change})
    assert repr(a) != repr(b)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param({"weights": np.ones(3)}, "one value per block", id="length"),
        pytest.param({"weights": -np.ones(10)}, ">= 0", id="negative"),
        pytest.param({"weights": np.full(10, np.nan)}, "finite", id="nan"),
        pytest.param({"weights": np.zeros(10)}, "all 0", id="zeros"),
        pytest.param({"epoch_blocks": 0}, "epoch_blocks", id="epoch-blocks"),
        pytest.param({"epoch_cells": 5}, "needs the source", id="cells-count"),
        pytest.param({"epoch_blocks": 5, "epoch_cells": 5}, "not both", id="both"),
        pytest.param({"seed": -1}, "seed", id="seed"),
        pytest.param({"num_epochs": 0}, "num_epochs", id="epochs"),
        pytest.param({"readahead_cells": -1}, "readahead_cells", id="readahead"),
    ],
)
def test_sampler_errors(kwargs, message):
    args = {"weights": np.ones(10), **kwargs}
    with pytest.raises(ValueError, match=message):
        WeightedBlockSampler(10, **args)


@pytest.mark.parametrize(
    "call, error, message",
    [
        pytest.param(
            lambda s: grain_cells.balanced_block_weights(s, "idx"),
            ValueError,
            "numeric",
            id="numeric",
        ),
        pytest.param(
            lambda s: grain_cells.balanced_block_weights(s, "plate"),
            KeyError,
            "obs_columns",
            id="column",
        ),
        pytest.param(
            lambda s: grain_cells.balanced_block_weights(s, "label", shares={"x": 1}),
            ValueError,
            "'x' is not a category",
            id="label",
        ),
        pytest.param(
            lambda s: grain_cells.balanced_block_weights(
                s.select(where={"label": ["common"]}), "label", shares={"rare": 1}
            ),
            ValueError,
            "no cell",
            id="absent",
        ),
        pytest.param(
            lambda s: grain_cells.balanced_block_weights(
                s, "label", shares={"rare": -1, "mid": 1}
            ),
            ValueError,
            ">= 0",
            id="negative",
        ),
        pytest.param(
            lambda s: grain_cells.block_weights(s, np.ones(5)),
            ValueError,
            "shape",
            id="cell-weights-shape",
        ),
        pytest.param(
            lambda s: grain_cells.block_weights(s, np.ones(N_CELLS), reduce="max"),
            ValueError,
            "reduce",
            id="reduce",
        ),
    ],
)
def test_weight_errors(source, call, error, message):
    with pytest.raises(error, match=message):
        call(source)


def test_records_are_grain_metadata(source):
    sampler = WeightedBlockSampler(source, np.ones(len(source)), epoch_blocks=9)
    meta = sampler[4]
    assert isinstance(meta, grain.RecordMetadata)
    assert meta.index == 4 and 0 <= meta.record_key < len(source)
    with pytest.raises(IndexError, match="past the end"):
        sampler[9]


def test_read_ahead_hints_the_blocks_to_come(csr_paths):
    source = grain_cells.AnnDataSource(csr_paths, block_size=4)
    hinted = []
    source.advise = lambda keys: hinted.extend(np.asarray(keys).tolist())
    n = len(source)
    sampler = WeightedBlockSampler(
        source, np.arange(1.0, n + 1.0), epoch_blocks=100, seed=1, readahead_cells=40
    )
    keys = [sampler[p].record_key for p in range(0, 60, 2)]  # a worker's stride
    np.testing.assert_array_equal(keys, sampler.blocks_at(np.arange(0, 60, 2)))
    # What the stream reads next was hinted; hints are only blocks it reaches.
    assert set(sampler.blocks_at(np.arange(2, 60, 2)).tolist()) <= set(hinted)
    assert set(hinted) <= set(sampler.blocks_at(np.arange(1, 100)).tolist())
