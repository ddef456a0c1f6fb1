"""`read_threads="auto"`: threads sized from the cores and the worker count.

The rule (`grain_cells._util.cores`): `max(1, min(4, C // W))` threads per
process, `C` the cores the process may use, `W` its worker count (1 outside
a worker); one thread reads inline. Checked as a table with the cores and
worker count set, then in real worker processes of a loader, where each
worker reports the pool its source's reads use.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import close_iterator

import grain_cells
from grain_cells._util import cores
from grain_cells.io._file_set import OpenFiles


@pytest.fixture
def machine(monkeypatch):
    """Sets the cores and worker count the rule sees; restores them after."""

    def set_(n_cores, workers, child=False):
        monkeypatch.setattr(cores, "available", lambda: n_cores)
        monkeypatch.setattr(cores, "_worker_count", None)
        monkeypatch.setattr(
            cores.multiprocessing, "parent_process", lambda: object() if child else None
        )
        if workers:
            cores.set_worker_count(workers)

    yield set_
    cores.set_worker_count(0)


@pytest.mark.parametrize(
    ("n_cores", "workers", "threads"),
    [
        pytest.param(2, 0, 2, id="2-cores-inline"),
        pytest.param(2, 2, 1, id="2-cores-2-workers"),
        pytest.param(8, 0, 4, id="8-cores-inline-capped"),
        pytest.param(8, 2, 4, id="8-cores-2-workers"),
        pytest.param(8, 4, 2, id="8-cores-4-workers"),
        pytest.param(8, 16, 1, id="more-workers-than-cores"),
        pytest.param(1, 0, 1, id="1-core"),
    ],
)
def test_rule(machine, n_cores, workers, threads):
    machine(n_cores, workers)
    assert cores.read_threads("auto") == threads
    assert cores.read_threads(3) == 3  # a count is kept as given
    assert cores.read_threads(0) == 0


def test_worker_never_told_reads_with_one_thread(machine):
    machine(8, 0, child=True)
    assert cores.read_threads("auto") == 1


@pytest.mark.parametrize(
    ("n_cores", "workers", "pool_threads"),
    [(8, 0, 4), (8, 4, 2), (2, 2, None), (1, 0, None)],
)
def test_open_files_pool(machine, csr_paths, n_cores, workers, pool_threads):
    machine(n_cores, workers)
    files = grain_cells.AnnDataSource(csr_paths).files
    handles = OpenFiles(files, "auto")
    try:
        pool = handles.thread_pool()
        assert (None if pool is None else pool.threads) == pool_threads
    finally:
        handles.close()
    explicit = OpenFiles(files, 3)
    try:
        assert explicit.thread_pool().threads == 3  # not sized
    finally:
        explicit.close()


@dataclasses.dataclass(frozen=True)
class _ThreadsOutput(grain_cells.CsrOutput):
    """CSR, plus the read threads the formatting process resolves for "auto"."""

    def format(self, fetch, rows, batch_size, empty=np.empty):
        out = super().format(fetch, rows, batch_size, empty)
        threads = empty((2,), np.int64)
        threads[:] = (cores.read_threads("auto"), cores.processes_sharing())
        return {**out, "threads": threads}


@pytest.mark.slow
def test_workers_are_told_their_count(csr_paths):
    source = grain_cells.AnnDataSource(csr_paths, block_size=5)
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=1),
        operations=grain_cells.fetch_operations(
            source, batch_size=4, fetch_factor=5, output=_ThreadsOutput()
        ),
        worker_count=2,
    )
    iterator = iter(loader)
    try:
        seen = {tuple(b["threads"]) for b in iterator}
    finally:
        close_iterator(iterator)
    expected = max(1, min(cores.MAX_READ_THREADS, cores.available() // 2))
    assert seen == {(expected, 2)}
