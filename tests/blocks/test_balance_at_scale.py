"""Class balance at atlas scale (issue 33, item 4): what the weights are, and
what reaches the workers.

* `balanced_block_weights` on an interleaved file written by anndata equals,
  bit for bit, the documented computation done with plain numpy over a dense
  blocks x classes table read with anndata: class x class sums exact per
  block length, the fixed-point iteration on them, the block weights of the
  final multipliers.
* `obs_values` of one file is a read-only view (of the obs cache's map), not
  a copy of the column.
* A `WeightedBlockSampler` over weights without runs pickles its cumulative
  weights as a shared cache file's path, not as 8 bytes per block.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings

import anndata as ad
import balance_oracle
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells

N_CELLS, BLOCK, N_TYPES = 5_003, 16, 7


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory) -> str:
    rng = np.random.default_rng(3)
    rows = np.arange(N_CELLS)
    # Uneven shares, and some missing labels, interleaved cell by cell.
    shares = np.arange(1, N_TYPES + 1) / np.arange(1, N_TYPES + 1).sum()
    labels = rng.choice([f"t{i}" for i in range(N_TYPES)], N_CELLS, p=shares)
    cell_type = pd.Categorical(labels, categories=[f"t{i}" for i in range(N_TYPES)])
    cell_type[rng.random(N_CELLS) < 0.03] = np.nan
    x = sp.csr_matrix(
        (np.ones(N_CELLS, np.float32), (rows, rows % 3)), shape=(N_CELLS, 3)
    )
    obs = pd.DataFrame(
        {
            "cell_type": cell_type,
            "donor": pd.Categorical([f"D{d}" for d in rows * 5 // N_CELLS]),
        },
        index=[f"c{r}" for r in rows],
    )
    path = tmp_path_factory.mktemp("interleaved") / "atlas.h5ad"
    ad.AnnData(x, obs=obs, var=pd.DataFrame(index=["a", "b", "c"])).write_h5ad(path)
    return str(path)


def _oracle(codes, starts, stops, width):
    """The weights as documented, over a dense table of every block."""
    lengths = stops - starts
    table = np.zeros((lengths.size, width), np.int64)
    for b, (lo, hi) in enumerate(zip(starts, stops, strict=True)):
        table[b] = np.bincount(codes[lo:hi] + 1, minlength=width)
    present = table.sum(0) > 0
    present[0] = False
    target = np.where(present, 1.0 / present.sum(), 0.0)
    return balance_oracle.balance(table, lengths, target, 200, 1e-6)[0]


@pytest.mark.parametrize("split", [False, True], ids=["file", "donor-split"])
def test_weights_equal_the_numpy_oracle_bit_for_bit(interleaved, split):
    source = grain_cells.AnnDataSource(
        interleaved, block_size=BLOCK, obs_columns=["cell_type", "donor"]
    )
    if split:  # blocks over runs of a view: short blocks, gaps between them
        source = grain_cells.split_by_obs(source, "donor", {"val": ["D1", "D3"]})[
            "train"
        ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # interleaved: the targets are missed
        weights = grain_cells.balanced_block_weights(source, "cell_type")
    obs = ad.read_h5ad(interleaved, backed="r").obs
    codes = obs["cell_type"].cat.codes.to_numpy().astype(np.int64)
    _, starts, stops = source.block_ranges(np.arange(len(source)))
    want = _oracle(codes, starts, stops, N_TYPES + 1)
    assert weights.tobytes() == want.tobytes()
    source.close()


def test_obs_values_of_one_file_is_a_view_not_a_copy(interleaved):
    source = grain_cells.AnnDataSource(interleaved, obs_columns=["cell_type"])
    a, b = source.obs_values("cell_type"), source.obs_values("cell_type")
    assert np.shares_memory(a, b)  # both views of the file's column
    assert not a.flags.writeable
    want = ad.read_h5ad(interleaved, backed="r").obs["cell_type"].cat.codes
    np.testing.assert_array_equal(a, want.to_numpy())
    source.close()


def test_obs_values_of_a_cached_column_is_a_map_of_its_own(tmp_path):
    from grain_cells.io import _obs_cache

    n = _obs_cache.MIN_CELLS + 5  # large enough for the obs cache
    codes = np.arange(n) % 3
    obs = pd.DataFrame(
        {"plate": pd.Categorical.from_codes(codes, ["p0", "p1", "p2"])},
        index=[f"c{r}" for r in range(n)],
    )
    path = tmp_path / "big.h5ad"
    x = sp.csr_matrix((n, 2), dtype=np.float32)
    ad.AnnData(x, obs=obs, var=pd.DataFrame(index=["a", "b"])).write_h5ad(path)
    source = grain_cells.AnnDataSource(str(path), obs_columns=["plate"])
    values = source.obs_values("plate")
    assert isinstance(values.base, np.memmap)  # mapped, not copied
    assert not values.flags.writeable
    np.testing.assert_array_equal(values, codes)
    source.close()


BIG = 1_500_000  # blocks: 12 MB of cumulative weights


def _sampler(weights):
    return grain_cells.WeightedBlockSampler(BIG, weights, seed=5, num_epochs=None)


def test_pickled_weighted_sampler_is_small_and_draws_the_same():
    weights = np.random.default_rng(0).random(BIG)  # no runs
    sampler = _sampler(weights)
    data = pickle.dumps(sampler)
    assert len(data) < 64 * 1024, len(data)
    positions = np.arange(0, 10 * BIG, 997)
    want = sampler.blocks_at(positions)
    np.testing.assert_array_equal(pickle.loads(data).blocks_at(positions), want)
    # In a fresh process, as a spawned worker unpickles it.
    script = (
        "import pickle, sys, numpy as np\n"
        "s = pickle.loads(sys.stdin.buffer.read())\n"
        f"sys.stdout.buffer.write(s.blocks_at(np.arange(0, {10 * BIG}, 997)).tobytes())"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], input=data, capture_output=True, check=True
    ).stdout
    assert out == want.astype(np.int64).tobytes()
    assert repr(pickle.loads(data)) == repr(sampler)


def test_unwritable_cache_keeps_the_table_in_the_pickle(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder would go
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(blocked))
    weights = np.random.default_rng(1).random(BIG)
    sampler = _sampler(weights)
    data = pickle.dumps(sampler)
    assert len(data) > 8 * BIG
    positions = np.arange(0, 3 * BIG, 101)
    np.testing.assert_array_equal(
        pickle.loads(data).blocks_at(positions), sampler.blocks_at(positions)
    )


def test_a_removed_or_damaged_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path))
    sampler = _sampler(np.random.default_rng(2).random(BIG))
    data = pickle.dumps(sampler)
    (entry,) = (tmp_path / "weights").iterdir()
    entry.unlink()
    with pytest.raises(FileNotFoundError, match=str(entry)):
        pickle.loads(data)
    # Pickled again: written again. A cut entry is refused, then rewritten.
    data = pickle.dumps(sampler)
    with open(entry, "r+b") as fh:
        fh.truncate(entry.stat().st_size - 100)
    with pytest.raises(FileNotFoundError, match="not whole"):
        pickle.loads(data)
    data = pickle.dumps(sampler)
    positions = np.arange(0, BIG, 13)
    np.testing.assert_array_equal(
        pickle.loads(data).blocks_at(positions), sampler.blocks_at(positions)
    )
    from grain_cells.sampling import _weighted

    assert _weighted.SHARED_MIN_BYTES <= 8 * BIG
