"""Both spellings of the loader refuse parts built on another source or view.

`grain.DataLoader(data_source=..., sampler=..., operations=fetch_operations(
...))` (the card's spelling, through `pipeline._grain_ops`) and
`grain_cells.DataLoader` / `cell_dataset` take the source more than once; a
fetch transform built on another view or file used to read the wrong rows
without a word.
"""

from __future__ import annotations

import grain
import numpy as np
import pytest
from conftest import write_files

import grain_cells


@pytest.fixture(scope="module")
def source(csr_paths):
    return grain_cells.AnnDataSource(csr_paths, block_size=5, obs_columns=["idx"])


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    paths = write_files(tmp_path_factory.mktemp("other"), seed=7)
    return grain_cells.AnnDataSource(paths, block_size=5, obs_columns=["idx"])


def _card_loader(data_source, ops_source):
    return grain.DataLoader(
        data_source=data_source,
        sampler=grain_cells.BlockSampler(len(data_source), seed=0),
        operations=grain_cells.fetch_operations(ops_source, batch_size=10),
        worker_count=0,
    )


def test_card_spelling_reads_its_own_source(source):
    rows = np.concatenate(
        [b["row_ids"][b["mask"]] for b in _card_loader(source, source)]
    )
    np.testing.assert_array_equal(np.sort(rows), np.arange(source.num_cells))


def test_card_spelling_refuses_operations_of_another_file(source, other):
    with pytest.raises(ValueError, match="another source"):
        next(iter(_card_loader(source, other)))


def test_card_spelling_refuses_operations_of_another_view(source):
    train = grain_cells.split_by_fraction(source, {"a": 0.5, "b": 0.5}, seed=1)["a"]
    with pytest.raises(ValueError, match="another source or view"):
        next(iter(_card_loader(train, source)))


@pytest.mark.parametrize("spelling", ["DataLoader", "CellDataset"])
def test_pipeline_refuses_operations_of_another_view(source, spelling):
    train = grain_cells.split_by_fraction(source, {"a": 0.5, "b": 0.5}, seed=1)["a"]
    ops = grain_cells.fetch_operations(source, batch_size=10)
    sampler = grain_cells.BlockSampler(len(train), seed=0)
    with pytest.raises(ValueError, match="built on another source"):
        if spelling == "DataLoader":
            grain_cells.DataLoader(data_source=train, sampler=sampler, operations=ops)
        else:
            grain_cells.pipeline.CellDataset(train, sampler, ops[1].split)


def test_pipeline_accepts_an_equal_source(csr_paths, source):
    again = grain_cells.AnnDataSource(csr_paths, block_size=5, obs_columns=["idx"])
    loader = grain_cells.DataLoader(
        data_source=again,
        sampler=grain_cells.BlockSampler(len(again), seed=0),
        operations=grain_cells.fetch_operations(source, batch_size=10),
    )
    assert next(iter(loader))["row_ids"].shape == (10,)


def test_pipeline_refuses_a_condition_sampler_striped_for_workers(source):
    view = grain_cells.condition_blocks(source, "idx")
    sampler = grain_cells.ConditionBlockSampler(
        view, "idx", blocks_per_fetch=2, worker_count=2
    )
    with pytest.raises(ValueError, match="worker_count=0"):
        grain_cells.DataLoader(
            data_source=view,
            sampler=sampler,
            operations=grain_cells.fetch_operations(
                view, batch_size=10, condition="idx"
            ),
        )
