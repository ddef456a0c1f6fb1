"""A file evicted by the open-file bound reopens from its byte layouts (issue 33).

A collection read in random order closes and reopens files all the time.
A file whose arrays are all uncompressed is read positionally, so once a
process has opened it through h5py it keeps the arrays' byte layouts
(`grain_cells.io._open_file.reopen`) and reopens it with one descriptor, no h5py;
read-ahead hints open no file through h5py at all.

Files are written by anndata; the value at (global row r, gene j) is
`r * 10 + j + 1`, so a row read from the wrong file or offset shows.
"""

from __future__ import annotations

import os
import pickle
import time

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from processes import calls_to

import grain_cells
from grain_cells.errors import SourceChangedError
from grain_cells.io import _file_set as file_set
from grain_cells.io import _h5ad, _meta_cache

N_FILES = 5
CELLS = 12
GENES = 5


def _write(path: str, f: int, dense: bool) -> None:
    rows = np.arange(f * CELLS, (f + 1) * CELLS)
    values = rows[:, None] * 10 + np.arange(GENES)[None, :] + 1.0
    values[(rows[:, None] + np.arange(GENES)[None, :]) % 3 == 0] = 0  # sparse
    x = values.astype(np.float32)
    anndata.AnnData(
        X=x if dense else sp.csr_matrix(x),
        obs=pd.DataFrame({"idx": rows}, index=[f"c{r}" for r in rows]),
        var=pd.DataFrame(index=[f"g{j}" for j in range(GENES)]),
    ).write_h5ad(path)


@pytest.fixture(params=["csr", "dense"])
def paths(request, tmp_path) -> list[str]:
    out = [str(tmp_path / f"part{f}.h5ad") for f in range(N_FILES)]
    for f, p in enumerate(out):
        _write(p, f, request.param == "dense")
    return out


@pytest.fixture
def opens(monkeypatch) -> list[str]:
    """Every open of a file through its format (h5py) to read it, in this process.

    (`_h5ad.open_unchanged` opens for `open_member`; the build's own opens
    take `open_file` by name and are not counted.)
    """
    return calls_to(monkeypatch, _h5ad, "open_file")


def _truth(paths) -> np.ndarray:
    return np.concatenate(
        [np.asarray(anndata.read_h5ad(p).to_df().to_numpy()) for p in paths]
    ).astype(np.float32)


def _dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def test_reopens_from_layouts_open_no_hdf5_and_read_the_same(paths, opens):
    truth = _truth(paths)
    source = grain_cells.AnnDataSource(
        paths, block_size=3, obs_columns=["idx"], max_open_files=2
    )
    rng = np.random.default_rng(0)
    for _ in range(4):
        for f in rng.permutation(N_FILES).tolist():
            rows = f * CELLS + rng.permutation(CELLS)[:7]
            cells = source.read(rows)
            np.testing.assert_array_equal(_dense(cells.X), truth[rows])
            np.testing.assert_array_equal(cells.obs["idx"], rows)
    assert source._handles.open_count <= 2
    assert sorted(opens) == sorted(paths)  # once per file, though 20 reads
    source.close()


# Worker starts (~1.5 s each) are the slow loop's (BUILD.md, "Tests").
WORKERS = [0, pytest.param(2, marks=pytest.mark.slow, id="2")]


@pytest.mark.parametrize("workers", WORKERS)
def test_an_epoch_through_two_open_files_equals_anndata(paths, workers):
    truth = _truth(paths)
    source = grain_cells.AnnDataSource(
        paths, block_size=3, obs_columns=["idx"], max_open_files=2
    )
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=1, num_epochs=1),
        operations=grain_cells.fetch_operations(
            source, batch_size=6, fetch_factor=2, output=grain_cells.DenseOutput()
        ),
        worker_count=workers,
    )
    seen = np.zeros(N_FILES * CELLS, int)
    iterator = iter(loader)
    try:
        for b in iterator:
            mask, ids = np.asarray(b["mask"]), np.asarray(b["row_ids"])
            np.testing.assert_array_equal(np.asarray(b["X"])[mask], truth[ids[mask]])
            np.testing.assert_array_equal(np.asarray(b["obs/idx"])[mask], ids[mask])
            seen[ids[mask]] += 1
    finally:
        getattr(iterator, "close", lambda: None)()
        source.close()
    assert (seen == 1).all()


def test_a_file_rewritten_while_evicted_is_refused_at_its_layout_reopen(paths, opens):
    source = grain_cells.AnnDataSource(paths, block_size=3, max_open_files=1)
    source.read([0])
    source.read([CELLS])  # file 1 opens, file 0 closes (its layouts kept)
    source.read([0])  # reopened from layouts
    source.read([CELLS])
    assert len(opens) == 2
    # Same bytes, same layout, one value changed: only the stat tells.
    with open(paths[0], "r+b") as fh:
        fh.seek(os.path.getsize(paths[0]) - 1)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(last)
    os.utime(paths[0], ns=(1, 1))
    with pytest.raises(SourceChangedError, match=r"part0\.h5ad"):
        source.read([0])
    source.close()


def test_read_ahead_hints_open_no_file_through_hdf5(paths, opens, monkeypatch):
    source = grain_cells.AnnDataSource(paths, block_size=3, max_open_files=1)
    handles = source._handles
    every = np.arange(len(source))
    source.advise(every)  # nothing opened yet: nothing hinted, nothing opened
    assert opens == [] and handles.open_count == 0
    source.read([0])
    source.read([CELLS])  # file 0 evicted, its layouts kept; file 1 open
    advised = []
    real = file_set.reopen

    def reopen(files, i, known):
        advised.append(i)
        return real(files, i, known)

    monkeypatch.setattr(file_set, "reopen", reopen)
    from grain_cells.io import _direct_csr

    tables = []
    real_advise = _direct_csr.advise

    def advise(table, which, *args):
        tables.append(None if which is None else which.tolist())
        return real_advise(table, which, *args)

    monkeypatch.setattr(_direct_csr, "advise", advise)
    source.advise(every)
    assert len(opens) == 2  # no open through h5py for the hint
    if handles.files.sparse:
        # Every file at once through the source's table of byte pieces, with
        # descriptors of the hint's own: no record reopened, none kept open.
        assert advised == [] and tables == [list(range(len(paths)))]
    else:
        assert advised == [0]  # the known file, through a descriptor of its own
    # (the table's hint made room for its descriptors: the open file closed)
    assert handles.open_count == (0 if handles.files.sparse else 1)
    source.close()


def _write_genes(path: str, f: int, genes: list[str]) -> None:
    """File `f` with genes in the order given; value (row r, gene gJ) = r*10+J+1."""
    rows = np.arange(f * CELLS, (f + 1) * CELLS)
    js = np.array([int(g[1:]) for g in genes])
    x = rows[:, None] * 10 + js[None, :] + 1.0
    x[(rows[:, None] + js[None, :]) % 3 == 0] = 0
    anndata.AnnData(
        X=sp.csr_matrix(x.astype(np.float32)),
        obs=pd.DataFrame({"idx": rows}, index=[f"c{r}" for r in rows]),
        var=pd.DataFrame(index=genes),
    ).write_h5ad(path)


def test_a_fetch_over_many_files_reads_them_at_once(tmp_path, monkeypatch):
    """Files with genes in other orders: one vectorised read, equal to anndata."""
    from grain_cells.io import _direct_csr, _range_reads

    genes = [f"g{j}" for j in range(GENES)]
    paths = []
    for f in range(N_FILES):
        order = genes[f:] + genes[:f]  # each file its own gene order
        paths.append(str(tmp_path / f"part{f}.h5ad"))
        _write_genes(paths[-1], f, order)
    together = anndata.concat([anndata.read_h5ad(p) for p in paths], join="outer")
    truth = together[:, genes].X.toarray()
    done = []
    real = _direct_csr.read

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        done.append(out is not None)
        return out

    monkeypatch.setattr(_range_reads._direct_csr, "read", counting)
    source = grain_cells.AnnDataSource(
        paths, join="inner", genes=genes, max_open_files=2
    )
    rows = np.random.default_rng(3).permutation(N_FILES * CELLS)[:40]
    cells = source.read(rows)
    np.testing.assert_array_equal(cells.X.toarray(), truth[rows])
    assert done == [True]
    source.close()


def test_a_bad_index_in_one_file_of_a_fetch_is_named(tmp_path):
    import h5py

    paths = [str(tmp_path / f"part{f}.h5ad") for f in range(3)]
    for f, p in enumerate(paths):
        _write(p, f, dense=False)
    with h5py.File(paths[1], "r+") as h5:
        h5["X/indices"][2] = GENES + 7
    source = grain_cells.AnnDataSource(paths)
    with pytest.raises(grain_cells.errors.CorruptDataError, match=r"part1\.h5ad"):
        source.read(np.arange(3 * CELLS))
    source.close()


def test_remembered_layouts_count_in_the_bound_of_what_a_process_keeps():
    from grain_cells.formats import LAYOUT_OVERHEAD_BYTES, ByteLayout
    from grain_cells.io._file_lru import RECORD_OVERHEAD_BYTES, Checked
    from grain_cells.io._open_file import OpenFile

    def layouts(chunks: int) -> dict:
        offsets = np.arange(chunks, dtype=np.int64) * 4096
        one = ByteLayout(
            "X/data", np.dtype("f4"), (chunks * 1024,), 1024, offsets, 1024
        )
        return {"data": one}

    per_file = 100 * 8 + LAYOUT_OVERHEAD_BYTES + RECORD_OVERHEAD_BYTES
    kept = Checked(max_bytes=3 * per_file)
    for key in range(5):
        kept.put(key, OpenFile(None, {}, None, layouts(100)))
    assert len(kept) == 3  # the oldest two dropped: layouts count as bytes
    assert kept.get(0) is None and kept.get(4).layouts is not None
    kept.put(9, OpenFile(None, {}, None, layouts(10_000)))  # alone over the bound
    assert kept.get(9) is None


def test_a_fetch_split_over_read_threads_reads_the_same(paths, monkeypatch):
    from grain_cells.io import _direct_csr

    monkeypatch.setattr(_direct_csr, "_MIN_BYTES_PER_THREAD", 8)  # split always
    truth = _truth(paths)
    source = grain_cells.AnnDataSource(paths, read_threads=3)
    rows = np.random.default_rng(5).permutation(N_FILES * CELLS)
    np.testing.assert_array_equal(_dense(source.read(rows).X), truth[rows])
    source.close()


# A process's first open of a file (issue 33): the trainer's build caches each
# file's byte layouts (`grain_cells.io._meta_cache`), so another process
# opens an unchanged file with a descriptor and positional reads, no h5py.


@pytest.fixture
def quiet_paths(paths, monkeypatch, tmp_path):
    """`paths`, quiet long enough to be cached, in a cache of this test's own."""
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_meta_cache, "QUIET_NS", 100_000_000)
    time.sleep(0.3)
    return paths


def test_a_first_open_with_cached_layouts_uses_no_hdf5(quiet_paths, opens):
    truth = _truth(quiet_paths)
    built = grain_cells.AnnDataSource(
        quiet_paths, block_size=3, obs_columns=["idx"], max_open_files=2
    )
    source = pickle.loads(pickle.dumps(built))  # as a worker gets it: no record
    rng = np.random.default_rng(0)
    for f in rng.permutation(N_FILES).tolist():
        rows = f * CELLS + rng.permutation(CELLS)[:7]
        cells = source.read(rows)
        np.testing.assert_array_equal(_dense(cells.X), truth[rows])
        np.testing.assert_array_equal(cells.obs["idx"], rows)
    assert opens == []
    source.close()
    built.close()


def test_a_file_changed_after_its_cache_entry_is_refused(quiet_paths, opens):
    built = grain_cells.AnnDataSource(quiet_paths, obs_columns=["idx"])
    _write(quiet_paths[1], 9, dense=False)
    source = pickle.loads(pickle.dumps(built))
    source.read([0])
    with pytest.raises(SourceChangedError):
        source.read([CELLS])
    source.close()
    built.close()


@pytest.mark.parametrize("workers", WORKERS)
def test_an_epoch_from_cached_layouts_equals_anndata(quiet_paths, workers):
    grain_cells.AnnDataSource(quiet_paths, obs_columns=["idx"])  # writes entries
    test_an_epoch_through_two_open_files_equals_anndata(quiet_paths, workers)


def test_chunked_obs_codes_are_read_from_cached_layouts(tmp_path, monkeypatch, opens):
    # Codes written in uncompressed chunks (as large files' are): positional.
    paths = []
    for f in range(2):
        path = str(tmp_path / f"c{f}.h5ad")
        rows = np.arange(f * CELLS, (f + 1) * CELLS)
        anndata.AnnData(
            X=sp.csr_matrix(np.ones((CELLS, GENES), np.float32)),
            obs=pd.DataFrame(
                {"cat": pd.Categorical([f"k{r % 3}" for r in rows])},
                index=[f"c{r}" for r in rows],
            ),
            var=pd.DataFrame(index=[f"g{j}" for j in range(GENES)]),
        ).write_h5ad(path)
        with h5py.File(path, "r+") as h:
            codes = h["obs/cat/codes"]
            values, attrs = codes[...], dict(codes.attrs)
            del h["obs/cat/codes"]
            new = h["obs/cat"].create_dataset("codes", data=values, chunks=(5,))
            new.attrs.update(attrs)
        paths.append(path)
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_meta_cache, "QUIET_NS", 100_000_000)
    time.sleep(0.3)
    built = grain_cells.AnnDataSource(paths, obs_columns=["cat"])
    source = pickle.loads(pickle.dumps(built))
    rows = np.arange(2 * CELLS)
    got = source.read(rows).obs["cat"]
    want = np.concatenate(
        [np.asarray(anndata.read_h5ad(p).obs["cat"].cat.codes) for p in paths]
    )
    np.testing.assert_array_equal(got, want)
    assert opens == []
    source.close()
    built.close()
