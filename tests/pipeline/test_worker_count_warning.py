"""`worker_count` above the cores this process may run on (issue 34).

Each library spelling warns once, where the loader is built, with the cores
found and the count asked for; within the cores it says nothing. Nothing here
starts a worker (building a loader starts none).
"""

from __future__ import annotations

import warnings

import grain
import pytest

import grain_cells
from grain_cells import errors
from grain_cells._util import cores

SPELLINGS = ["loader", "DataLoader", "cell_dataset", "mp_prefetch"]


def _spellings(source, workers):
    yield (
        "loader",
        lambda: grain_cells.loader(source, batch_size=16, worker_count=workers),
    )
    yield (
        "DataLoader",
        lambda: grain_cells.DataLoader(
            data_source=source,
            sampler=grain_cells.BlockSampler(source, seed=0),
            operations=grain_cells.fetch_operations(source, batch_size=16),
            worker_count=workers,
        ),
    )
    yield (
        "cell_dataset",
        lambda: grain_cells.pipeline.cell_dataset(
            source, batch_size=16, worker_count=workers
        ),
    )
    yield (
        "mp_prefetch",
        lambda: grain_cells.pipeline.cell_dataset(source, batch_size=16).mp_prefetch(
            grain.MultiprocessingOptions(num_workers=workers)
        ),
    )


@pytest.fixture
def source(csr_paths):
    return grain_cells.AnnDataSource(csr_paths, block_size=8)


@pytest.mark.parametrize(
    "spelling", ["loader", "DataLoader", "cell_dataset", "mp_prefetch"]
)
def test_more_workers_than_cores_warns_once(source, spelling):
    found = cores.available()
    build = dict(_spellings(source, found + 3))[spelling]
    with pytest.warns(errors.WorkerCountWarning) as seen:
        loader = build()
    assert len(seen) == 1
    message = str(seen[0].message)
    assert f"worker_count={found + 3}" in message
    assert f"the {found} cores" in message
    assert "slow reading down" in message
    assert seen[0].filename == __file__  # points at the caller's line
    del loader


@pytest.mark.parametrize(
    "spelling", ["loader", "DataLoader", "cell_dataset", "mp_prefetch"]
)
def test_workers_within_the_cores_say_nothing(source, spelling):
    build = dict(_spellings(source, cores.available()))[spelling]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build()


def test_the_cores_are_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(
        cores.os, "sched_getaffinity", lambda pid: {0, 3}, raising=False
    )
    assert cores.available() == 2
    with pytest.warns(
        errors.WorkerCountWarning, match=r"worker_count=3 .* the 2 cores"
    ):
        cores.warn_if_oversubscribed(3)
