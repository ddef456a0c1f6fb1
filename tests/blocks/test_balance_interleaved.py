"""Class balance on a real-shaped file: donors in order, cell types
interleaved within each donor (issue 24, item 4).

At block 16 no block weighting can balance such a file; the weights say so
(the shares they reach, and the grouped copy that fixes it). A copy written
with `preshuffle(..., group_by="cell_type")` reaches every target at block
16, checked on the cells a loader emits over an epoch. Also: the weighting
calls take (source, weights, column) in one order, and check types by name.
"""

from __future__ import annotations

import collections
import warnings

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells

DONORS = 4
PER_DONOR = 600
N_GENES = 5
# Natural shares far from equal: T cells a third, Mono 4%.
TYPES = {"T": 0.34, "B": 0.22, "NK": 0.2, "DC": 0.12, "Plasma": 0.08, "Mono": 0.04}
BLOCK = 16


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory) -> str:
    rng = np.random.default_rng(0)
    n = DONORS * PER_DONOR
    rows = np.arange(n)
    labels = rng.choice(list(TYPES), n, p=list(TYPES.values()))
    x = sp.csr_matrix(
        ((rows * 100 + 1).astype(np.float32), (rows, rows % N_GENES)),
        shape=(n, N_GENES),
    )
    obs = pd.DataFrame(
        {
            "donor": pd.Categorical(
                np.repeat([f"D{d}" for d in range(DONORS)], PER_DONOR)
            ),
            "cell_type": pd.Categorical(labels, categories=list(TYPES)),
            "idx": rows,
        },
        index=[f"c{r}" for r in rows],
    )
    path = tmp_path_factory.mktemp("interleaved") / "atlas.h5ad"
    ad.AnnData(
        x, obs=obs, var=pd.DataFrame(index=[f"g{j}" for j in range(N_GENES)])
    ).write_h5ad(path)
    return str(path)


def _epoch_shares(source, weights, seed=0) -> dict:
    sampler = grain_cells.WeightedBlockSampler(
        source, weights, epoch_cells=20_000, seed=seed
    )
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=grain_cells.fetch_operations(
            source, batch_size=64, fetch_factor=4, seed=seed
        ),
    )
    counts = collections.Counter()
    categories = source.categories["cell_type"]
    for batch in loader:
        codes = batch["obs/cell_type"][batch["mask"]]
        counts.update(categories[codes].tolist())
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()}


def test_interleaved_file_misses_and_says_what_to_do(interleaved):
    source = grain_cells.AnnDataSource(
        interleaved, block_size=BLOCK, obs_columns=["cell_type"]
    )
    with pytest.warns(UserWarning) as caught:
        weights = grain_cells.balanced_block_weights(source, "cell_type")
    message = str(caught[0].message)
    shares = grain_cells.expected_shares(source, weights, "cell_type")
    # The message lists the shares reached: T's among them, far off 1/6.
    assert f"T: {shares['T']:.1%} (target 16.7%)" in message
    assert shares["T"] > 1 / 6 + 0.05
    assert "group_by='cell_type'" in message
    source.close()


def test_grouped_copy_reaches_every_target_at_block_16(interleaved, tmp_path):
    (part,) = grain_cells.preshuffle(
        interleaved, tmp_path / "grouped", group_by="cell_type", progress=False
    )
    source = grain_cells.AnnDataSource(
        part, block_size=BLOCK, obs_columns=["cell_type", "idx"]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reachable: no warning
        weights = grain_cells.balanced_block_weights(source, "cell_type")
    expected = grain_cells.expected_shares(source, weights, "cell_type")
    assert expected == pytest.approx(dict.fromkeys(TYPES, 1 / 6), abs=1e-6)
    got = _epoch_shares(source, weights)
    assert got == pytest.approx(dict.fromkeys(TYPES, 1 / 6), abs=0.02)
    # The same weights on the interleaved original stay near its own shares.
    original = grain_cells.AnnDataSource(
        interleaved, block_size=BLOCK, obs_columns=["cell_type"]
    )
    with pytest.warns(UserWarning, match="group_by"):
        w = grain_cells.balanced_block_weights(original, "cell_type")
    assert _epoch_shares(original, w)["T"] > 1 / 6 + 0.05
    source.close()
    original.close()


def test_weighting_calls_take_one_order_and_check_types(interleaved):
    source = grain_cells.AnnDataSource(
        interleaved, block_size=BLOCK, obs_columns=["cell_type"]
    )
    w = np.ones(len(source))
    new = grain_cells.expected_shares(source, w, "cell_type")
    assert grain_cells.expected_shares(source, "cell_type", w) == new  # earlier order
    assert grain_cells.expected_shares(source, weights=w, column="cell_type") == new
    with pytest.raises(TypeError, match="balanced_block_weights"):
        grain_cells.block_weights(source, "cell_type")
    with pytest.raises(TypeError, match="column must be the name"):
        grain_cells.expected_shares(source, w, w)
    with pytest.raises(TypeError, match="weights must be an array of numbers"):
        grain_cells.expected_shares(source, "cell_type", "cell_type")
    with pytest.raises(TypeError, match=r"source must be a grain_cells\.AnnDataSource"):
        grain_cells.balanced_block_weights(np.ones(3), "cell_type")
    with pytest.raises(TypeError, match="column must be the name"):
        grain_cells.balanced_block_weights(source, ["cell_type"])
    source.close()


def _recipe(path) -> None:
    """The selection recipe: types, a held-out donor, a validation fraction."""
    source = grain_cells.AnnDataSource(
        path, block_size=BLOCK, obs_columns=["cell_type", "donor"]
    )
    tcells = source.select(where={"cell_type": ["T", "B"]})
    splits = grain_cells.split_by_obs(tcells, "donor", {"test": ["D3"]}, rest="train")
    grain_cells.split_by_fraction(splits["train"], {"train": 0.9, "val": 0.1})
    source.close()


def test_selection_recipe_warns_once_with_advice_that_works(
    interleaved, tmp_path, caplog
):
    with caplog.at_level("WARNING", logger="grain_cells"):
        _recipe(interleaved)
    said = [r.getMessage() for r in caplog.records if "fragmented" in r.getMessage()]
    assert len(said) == 1, said  # not once per split of the selection
    assert "group_by=[column, ...]" in said[0]
    # The advice, followed, gives a copy on which the recipe is not fragmented.
    (part,) = grain_cells.preshuffle(
        interleaved,
        tmp_path / "grouped",
        group_by=["cell_type", "donor"],
        progress=False,
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="grain_cells"):
        _recipe(str(part))
    assert not [r for r in caplog.records if "fragmented" in r.getMessage()]


def test_condition_blocks_are_full_on_a_grouped_copy(interleaved, tmp_path, caplog):
    """One condition per fetch reads full blocks from a grouped copy."""
    (part,) = grain_cells.preshuffle(
        interleaved, tmp_path / "grouped", group_by="cell_type", progress=False
    )
    mean_cells = {}
    for name, path in (("original", interleaved), ("grouped", str(part))):
        source = grain_cells.AnnDataSource(
            path, block_size=BLOCK, obs_columns=["cell_type"]
        )
        with caplog.at_level("ERROR", logger="grain_cells"):  # fragmented: known
            view = grain_cells.condition_blocks(source, "cell_type")
        mean_cells[name] = view.num_selected_cells / len(view)
        source.close()
    assert mean_cells["original"] < 3  # a type change every few cells
    assert mean_cells["grouped"] > BLOCK - 1  # one short block per type
