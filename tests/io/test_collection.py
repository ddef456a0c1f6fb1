"""A many-file fetch through the source's layout table and joined obs (issue 33).

A source of local, uncompressed CSR files keeps every file's byte pieces in
one table (`io._collection.LayoutTable`); a fetch of several files reads
through it with descriptors of its own and takes obs rows from the joined
columns, so no per-file record is made and nothing is kept open. Files are
written by anndata; the value at (global row r, gene j) is `r * 10 + j + 1`
and obs `idx` is r, so a row read from the wrong file or offset shows.
"""

from __future__ import annotations

import os
import time

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.errors import SourceChangedError
from grain_cells.io import _collection, _file_set, _meta_cache

N_FILES = 6
CELLS = 40
GENES = 5
OBS = ["idx", "kind"]


def _write(path: str, f: int, dtype=np.float32) -> None:
    rows = np.arange(f * CELLS, (f + 1) * CELLS)
    values = rows[:, None] * 10 + np.arange(GENES)[None, :] + 1.0
    values[(rows[:, None] + np.arange(GENES)[None, :]) % 3 == 0] = 0
    kinds = pd.Categorical([f"k{r % 7}" for r in rows])
    anndata.AnnData(
        X=sp.csr_matrix(values.astype(dtype)),
        obs=pd.DataFrame({"idx": rows, "kind": kinds}, index=[f"c{r}" for r in rows]),
        var=pd.DataFrame(index=[f"g{j}" for j in range(GENES)]),
    ).write_h5ad(path)


@pytest.fixture
def paths(tmp_path) -> list[str]:
    out = [str(tmp_path / f"part{f}.h5ad") for f in range(N_FILES)]
    for f, p in enumerate(out):
        _write(p, f)
    return out


def _check(source, rows, cells) -> None:
    truth = np.concatenate(
        [anndata.read_h5ad(p).X.toarray() for p in source._handles.files.paths]
    )
    np.testing.assert_array_equal(cells.X.toarray(), truth[rows])
    np.testing.assert_array_equal(cells.obs["idx"], rows)
    kinds = np.asarray(source.categories["kind"])[cells.obs["kind"]]
    np.testing.assert_array_equal(kinds, [f"k{r % 7}" for r in rows])


def test_a_many_file_fetch_keeps_no_record_and_no_file_open(paths):
    source = grain_cells.AnnDataSource(paths, obs_columns=OBS, max_open_files=2)
    handles = source._handles
    assert handles.files.layouts.member.all()
    rng = np.random.default_rng(0)
    for _ in range(6):
        rows = np.sort(rng.choice(N_FILES * CELLS, 50, replace=False))
        _check(source, rows, source.read(rows))
    assert len(handles._checked) == 0 and handles.open_count == 0
    source.close()


def test_a_file_changed_after_the_build_is_refused_by_name(paths):
    source = grain_cells.AnnDataSource(paths, obs_columns=OBS)
    source.read([0, CELLS])
    _write(paths[3], 9)  # other values, same shape
    with pytest.raises(SourceChangedError, match=r"part3\.h5ad"):
        source.read([0, 3 * CELLS])
    source.read([0, CELLS])  # the unchanged files still read
    source.close()


def test_a_file_of_other_dtypes_is_read_file_by_file(tmp_path, paths, monkeypatch):
    _write(paths[2], 2, np.float64)
    source = grain_cells.AnnDataSource(paths, obs_columns=OBS)
    table = source._handles.files.layouts
    assert table.member.tolist() == [True, True, False, True, True, True]
    reads = []
    real = _collection.table_fds

    def counting(handles, indices):
        reads.append(list(indices))
        return real(handles, indices)

    monkeypatch.setattr("grain_cells.io._range_reads.table_fds", counting)
    rows = np.arange(0, N_FILES * CELLS, 7)
    _check(source, rows, source.read(rows))  # file 2 in it: not through the table
    rows = np.array([1, CELLS + 1, 3 * CELLS + 1])
    _check(source, rows, source.read(rows))
    assert len(source._handles._checked) == N_FILES  # the first, per-file read
    source.close()


def test_joined_obs_come_from_metadata_entries(paths, monkeypatch, tmp_path):
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_meta_cache, "QUIET_NS", 100_000_000)
    time.sleep(0.2)  # the files quiet: the build stores their entries
    source = grain_cells.AnnDataSource(paths, obs_columns=OBS)
    assert os.listdir(os.path.join(tmp_path, "cache", "file-meta"))
    opened = []
    real = _collection._h5ad.open_unchanged
    monkeypatch.setattr(
        _collection._h5ad,
        "open_unchanged",
        lambda *a: opened.append(a[0].path) or real(*a),
    )
    rows = np.array([3, CELLS + 5, 5 * CELLS + 1])
    _check(source, rows, source.read(rows))
    assert opened == []  # every file's obs read by its entry's byte layouts
    source.close()


def test_with_the_obs_cache_off_a_large_source_keeps_records(paths, monkeypatch):
    monkeypatch.setenv("GRAIN_CELLS_OBS_CACHE", "off")
    # "Large": at least MIN_CELLS cells (each process would copy the columns).
    monkeypatch.setattr(_collection, "MIN_CELLS", 100)
    monkeypatch.setattr(_file_set, "MIN_CELLS", 100)
    source = grain_cells.AnnDataSource(paths, obs_columns=OBS)
    rows = np.arange(0, N_FILES * CELLS, 5)
    _check(source, rows, source.read(rows))
    assert source._handles.joined_obs() is None
    assert len(source._handles._checked) == N_FILES
    source.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_through_the_table_equals_anndata(paths, helpers, workers):
    source = grain_cells.AnnDataSource(paths, block_size=4, obs_columns=OBS)
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=1, num_epochs=1),
        operations=grain_cells.fetch_operations(
            source, batch_size=8, fetch_factor=4, output=grain_cells.DenseOutput()
        ),
        worker_count=workers,
    )
    truth = np.concatenate([anndata.read_h5ad(p).X.toarray() for p in paths])
    seen = np.zeros(N_FILES * CELLS, int)
    for b in helpers.run(loader, 10_000):
        mask, ids = np.asarray(b["mask"]), np.asarray(b["row_ids"])
        np.testing.assert_array_equal(np.asarray(b["X"])[mask], truth[ids[mask]])
        np.testing.assert_array_equal(np.asarray(b["obs/idx"])[mask], ids[mask])
        seen[ids[mask]] += 1
    assert (seen == 1).all()


def test_a_source_alive_at_interpreter_shutdown_closes_quietly(paths, tmp_path):
    """`OpenFiles.__del__` may run after module globals are cleared."""
    import subprocess
    import sys

    script = tmp_path / "teardown.py"
    script.write_text(
        "import gc, grain_cells\n"
        f"source = grain_cells.AnnDataSource({paths!r}, obs_columns=['idx'])\n"
        "source.read([0, 41])\n"
        "keep = gc.get_objects()  # freed only at interpreter teardown\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr


@pytest.mark.parametrize("kind", ["table", "file by file", "dense"])
def test_a_fetch_of_more_files_than_the_budget_reads_in_parts(
    tmp_path, paths, monkeypatch, kind
):
    """A read holds a descriptor per file it touches: past the budget, in parts."""
    if kind != "table":  # file 2 not in the table: every file read by itself
        _write(paths[2], 2, np.float64)
    if kind == "dense":
        for p in paths:
            adata = anndata.read_h5ad(p)
            adata.X = adata.X.toarray()
            adata.write_h5ad(p)
    monkeypatch.setattr("grain_cells.io._range_reads.default_budget", lambda: 2)
    source = grain_cells.AnnDataSource(paths, obs_columns=OBS, max_open_files=1)
    read = [anndata.read_h5ad(p).X for p in paths]
    truth = np.concatenate([x.toarray() if sp.issparse(x) else x for x in read])
    rng = np.random.default_rng(3)
    for rows in [np.arange(1, N_FILES * CELLS, 3), rng.permutation(N_FILES * CELLS)]:
        cells = source.read(rows)
        X = cells.X.toarray() if sp.issparse(cells.X) else cells.X
        np.testing.assert_array_equal(X, truth[rows])
        np.testing.assert_array_equal(cells.obs["idx"], rows)
    # Fetched rows come back in file order, one run of ranges per file.
    fetched = source.fetch_ranges(
        [5 * CELLS, 0, 3 * CELLS + 2], [5 * CELLS + 3, 4, 3 * CELLS + 9]
    )
    expect = np.r_[0:4, 3 * CELLS + 2 : 3 * CELLS + 9, 5 * CELLS : 5 * CELLS + 3]
    np.testing.assert_array_equal(fetched.row_ids, expect)
    source.close()


def test_a_fetch_of_more_files_than_descriptors_allowed_does_not_fail(tmp_path):
    """A soft `RLIMIT_NOFILE` under the files one fetch touches: read in parts."""
    import subprocess
    import sys

    n = 48
    for f in range(n):
        _write(str(tmp_path / f"part{f}.h5ad"), f)
    script = tmp_path / "few_fds.py"
    script.write_text(
        "import glob, resource, numpy as np, grain_cells\n"
        f"paths = sorted(glob.glob({str(tmp_path)!r} + '/part*.h5ad'), "
        "key=lambda p: int(p.rsplit('part', 1)[1][:-5]))\n"
        "source = grain_cells.AnnDataSource(paths, obs_columns=['idx'])\n"
        "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (40, hard))\n"
        f"rows = np.arange(0, {n * CELLS}, {CELLS}) + 7\n"
        "cells = source.read(rows)\n"
        "assert (cells.obs['idx'] == rows).all(), cells.obs['idx']\n"
        "expect = np.where((rows + 1) % 3 == 0, 0, rows * 10 + 2)\n"
        "assert (cells.X.toarray()[:, 1] == expect).all()\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_cold_build_of_many_local_files_opens_them_in_processes(
    paths, monkeypatch, tmp_path
):
    """Files not in the cache, past `MIN_LOCAL_OPENS`, are opened in processes."""
    from grain_cells.io import _build

    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cold"))
    monkeypatch.setattr(_build, "MIN_LOCAL_OPENS", 2)
    monkeypatch.setattr(_build.cores, "available", lambda: 2)
    made = []
    real = _build._pool
    monkeypatch.setattr(_build, "_pool", lambda n, r: made.append((n, r)) or real(n, r))
    source = grain_cells.AnnDataSource(paths, obs_columns=OBS)
    assert made == [(N_FILES, False)]
    assert source._handles.files.layouts.member.all()
    rows = np.random.default_rng(5).permutation(N_FILES * CELLS)
    _check(source, rows, source.read(rows))
    source.close()


def test_a_build_process_that_dies_is_named_not_a_hang(paths, monkeypatch, tmp_path):
    """A process of the build that dies (the OOM killer, say) is reported with
    the files it was opening, and the build does not wait for its pool.
    """
    import concurrent.futures
    import multiprocessing

    from grain_cells.io import _build

    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cold"))
    monkeypatch.setattr(_build, "MIN_LOCAL_OPENS", 2)
    monkeypatch.setattr(_build.cores, "available", lambda: 2)

    def dying_pool(n, remote):  # each process exits as it starts
        return concurrent.futures.ProcessPoolExecutor(
            1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=os._exit,
            initargs=(9,),
        )

    monkeypatch.setattr(_build, "_pool", dying_pool)
    with pytest.raises(RuntimeError, match="died") as raised:
        grain_cells.AnnDataSource(paths, obs_columns=OBS)
    message = str(raised.value)
    assert f"opening {N_FILES} files" in message
    assert paths[0] in message
    assert "out-of-memory" in message
