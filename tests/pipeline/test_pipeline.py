"""cell_dataset: the DataLoader pipeline on Grain's dataset API."""

from __future__ import annotations

import anndata as ad
import grain
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from absl import flags

import grain_cells

N_OBS, N_VARS = 150, 20


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    rng = np.random.default_rng(0)
    mask = rng.random((N_OBS, N_VARS)) < 0.3
    rows, cols = np.nonzero(mask)
    x = sp.csr_matrix(
        ((rows * 100 + cols + 1).astype(np.float32), (rows, cols)),
        shape=(N_OBS, N_VARS),
    )
    obs = pd.DataFrame({"idx": np.arange(N_OBS)}, index=[f"c{i}" for i in range(N_OBS)])
    p = tmp_path_factory.mktemp("pipe") / "a.h5ad"
    ad.AnnData(
        x, obs=obs, var=pd.DataFrame(index=[f"g{j}" for j in range(N_VARS)])
    ).write_h5ad(p)
    return p


def _rows(batches):
    return np.concatenate([b["row_ids"][b["mask"]] for b in batches])


def test_one_epoch_visits_every_cell_once_with_right_values(path):
    source = grain_cells.AnnDataSource(path, block_size=4, obs_columns=["idx"])
    ds = grain_cells.cell_dataset(source, batch_size=8, fetch_factor=2, seed=1)
    x = ad.read_h5ad(path).X
    batches = list(ds)
    assert all(b["mask"].shape == (8,) for b in batches)
    for b in batches:
        real = np.flatnonzero(b["mask"])
        m = sp.csr_matrix((b["data"], b["indices"], b["indptr"]), shape=(8, N_VARS))
        np.testing.assert_array_equal(
            m[real].toarray(), x[b["row_ids"][real]].toarray()
        )
        np.testing.assert_array_equal(b["obs/idx"][real], b["row_ids"][real])
    rows = _rows(batches)
    np.testing.assert_array_equal(np.sort(rows), np.arange(N_OBS))
    assert not np.array_equal(rows, np.arange(N_OBS))  # shuffled


@pytest.mark.parametrize("stop", [0, 3, 4, 9])
def test_resume_at_any_minibatch(path, stop):
    source = grain_cells.AnnDataSource(path, block_size=4)
    ds = grain_cells.cell_dataset(
        source, batch_size=8, fetch_factor=2, seed=2, num_epochs=2
    )
    it = iter(ds)
    for _ in range(stop):
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(5)]
    again = iter(ds)
    again.set_state(state)
    for a, b in zip(want, (next(again) for _ in range(5)), strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


@pytest.mark.slow
def test_workers_give_the_same_minibatches(path):
    flags.FLAGS.mark_as_parsed()
    source = grain_cells.AnnDataSource(path, block_size=4)
    ds = grain_cells.cell_dataset(source, batch_size=8, fetch_factor=2, seed=3)
    inline = {tuple(b["row_ids"]) for b in ds}
    mp = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    with_workers = {tuple(b["row_ids"]) for b in mp}
    assert inline == with_workers  # fetches are formed before the worker split


def test_shards_are_disjoint_and_equal(path):
    source = grain_cells.AnnDataSource(path, block_size=4)  # 38 blocks
    per_shard = []
    for i in range(3):
        ds = grain_cells.cell_dataset(
            source,
            batch_size=4,
            fetch_factor=1,
            seed=4,
            shard_options=grain.sharding.ShardOptions(i, 3),
        )
        per_shard.append(_rows(list(ds)))
    sampler = grain_cells.BlockSampler(
        38, seed=4, shard_options=grain.sharding.ShardOptions(0, 3)
    )
    skipped = sampler.skipped_blocks(0)
    assert skipped.size == 38 % 3
    all_rows = np.concatenate(per_shard)
    assert np.unique(all_rows).size == all_rows.size
    _, starts, stops = source.block_ranges(skipped)
    missing = np.concatenate(
        [np.arange(a, b) for a, b in zip(starts, stops, strict=True)]
    )
    np.testing.assert_array_equal(
        np.sort(np.concatenate([all_rows, missing])), np.arange(N_OBS)
    )
    assert len({len(r) for r in per_shard}) <= 2  # equal blocks; a short one


def test_live_fetches_do_not_share_read_buffers(path):
    """A fetch's lazily formatted minibatches survive another fetch's read."""
    source = grain_cells.AnnDataSource(path, block_size=4)
    split = grain_cells.fetch_operations(source, batch_size=8, fetch_factor=4)[1]
    x = ad.read_h5ad(path).X
    first = split.flat_map(np.array([tuple(source[k]) for k in (0, 5, 9, 13)]))
    second = split.flat_map(np.array([tuple(source[k]) for k in (20, 22, 30, 33)]))
    for fetch in (first, second, first):
        for i in range(len(fetch)):
            batch = fetch[i]
            real = np.flatnonzero(batch["mask"])
            m = sp.csr_matrix(
                (batch["data"], batch["indices"], batch["indptr"]), shape=(8, N_VARS)
            )
            np.testing.assert_array_equal(
                m[real].toarray(), x[batch["row_ids"][real]].toarray()
            )


def test_weighted_sampler_drives_cell_dataset(path):
    source = grain_cells.AnnDataSource(path, block_size=4, obs_columns=["idx"])
    weights = np.zeros(source.num_cells)
    weights[:8] = 1.0  # only the first two blocks may be drawn
    sampler = grain_cells.WeightedBlockSampler(
        source, grain_cells.block_weights(source, weights), epoch_blocks=12, seed=1
    )
    ds = grain_cells.cell_dataset(source, batch_size=8, fetch_factor=2, sampler=sampler)
    rows = _rows(list(ds))
    assert rows.size == 12 * 4
    assert set(rows.tolist()) <= set(range(8))
    it = iter(ds)
    next(it)
    state = it.get_state()
    want = next(it)
    again = iter(ds)
    again.set_state(state)
    np.testing.assert_array_equal(next(again)["row_ids"], want["row_ids"])
