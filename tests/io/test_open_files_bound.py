"""A process keeps at most `max_open_files` files open (issue 33).

A collection used to keep two descriptors and about a megabyte per touched
file until the process ended. Now each process holds an LRU of open files:
reads pin the files they use, the least recently used unpinned file closes
when another must open, and a reopened file is checked again.

Files: 300 copies of one small file written by anndata, each patched in
place (same layout) so that the value at (file f, local row r, gene j) is
`f * 1000 + r * 10 + j + 1` and obs `idx` is the global row.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import threading
import time

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from processes import worker_pids

import grain_cells
from grain_cells import errors
from grain_cells.io import _file_lru as file_lru
from grain_cells.io._range_reads import HINT_FILES

N_FILES = 300
FEW = 40  # what the tests other than the 300-file epoch use
CELLS = 8
GENES = 6


def _expected_data(f: int, n: int) -> np.ndarray:
    r = np.repeat(np.arange(n), 2)
    j = np.stack([np.arange(n) % GENES, (np.arange(n) + 1) % GENES], 1)
    j = np.sort(j, 1).reshape(-1)
    return (f * 1000 + r * 10 + j + 1).astype(np.float32), j


class _Files:
    """The files of the module docstring, written when first asked for:
    only the slow test reads all 300, the others at most 40."""

    def __init__(self, folder):
        data, j = _expected_data(0, CELLS)
        x = sp.csr_matrix(
            (data, j, np.arange(0, 2 * CELLS + 1, 2)), shape=(CELLS, GENES)
        )
        adata = anndata.AnnData(
            X=x,
            obs=pd.DataFrame(
                {"idx": np.arange(CELLS, dtype=np.int64)},
                index=[f"c{r}" for r in range(CELLS)],
            ),
            var=pd.DataFrame(index=[f"g{j}" for j in range(GENES)]),
        )
        self.folder, self.template = folder, folder / "template.h5ad"
        adata.write_h5ad(self.template)
        self.paths: list[str] = []
        self.dense: list[np.ndarray] = []

    def first(self, n: int) -> list[str]:
        for f in range(len(self.paths), n):
            path = self.folder / f"part{f:03d}.h5ad"
            shutil.copyfile(self.template, path)
            with h5py.File(path, "r+") as h5:
                h5["X/data"][...] = _expected_data(f, CELLS)[0]
                h5["obs/idx"][...] = np.arange(CELLS) + f * CELLS
            self.paths.append(str(path))
        return self.paths[:n]

    def truth(self, n: int) -> np.ndarray:
        """Dense X of the first `n` files' cells, read back by anndata."""
        for p in self.first(n)[len(self.dense) :]:
            self.dense.append(anndata.read_h5ad(p).X.toarray())
        return np.concatenate(self.dense[:n]).astype(np.float32)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> _Files:
    return _Files(tmp_path_factory.mktemp("many"))


@pytest.fixture(scope="module")
def many_paths(files) -> list[str]:
    return files.first(N_FILES)


@pytest.fixture(scope="module")
def few_paths(files) -> list[str]:
    return files.first(FEW)


def _data_fds(pid, folder: str) -> int:
    """Descriptors of process `pid` open on files under `folder`."""
    n = 0
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for name in names:
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith(folder):
                n += 1
        except OSError:  # closed meanwhile
            continue
    return n


@pytest.mark.slow
@pytest.mark.parametrize("workers", [pytest.param(0, id="0-workers"), 2])
def test_an_epoch_over_300_files_keeps_8_open(many_paths, files, workers, monkeypatch):
    truth = files.truth(N_FILES)
    bound = 8
    folder = os.path.dirname(many_paths[0])
    most = {"trainer": 0, "workers": 0}
    from grain_cells.io import _direct_csr

    real = _direct_csr.read

    def counting(*args):  # a many-file read holds its files' descriptors
        most["trainer"] = max(most["trainer"], _data_fds(os.getpid(), folder))
        return real(*args)

    monkeypatch.setattr(_direct_csr, "read", counting)
    source = grain_cells.AnnDataSource(
        many_paths, block_size=4, obs_columns=["idx"], max_open_files=bound
    )
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=1),
        operations=grain_cells.fetch_operations(
            source, batch_size=8, fetch_factor=4, output=grain_cells.CsrOutput()
        ),
        worker_count=workers,
    )
    seen = np.zeros(N_FILES * CELLS, int)
    pids: set[int] = set()
    done = threading.Event()

    def watch_workers():  # a fetch holds its files only while it reads them
        while not done.wait(0.0005):
            for pid in list(pids):
                most["workers"] = max(most["workers"], _data_fds(pid, folder))

    watcher = threading.Thread(target=watch_workers, daemon=True)
    watcher.start()
    iterator = iter(loader)
    try:
        for b in iterator:
            mask, ids = np.asarray(b["mask"]), np.asarray(b["row_ids"])
            m = mask.size
            x = sp.csr_matrix(
                (b["data"], b["indices"], b["indptr"]), shape=(m, GENES)
            ).toarray()
            np.testing.assert_array_equal(x[mask], truth[ids[mask]])
            np.testing.assert_array_equal(np.asarray(b["obs/idx"])[mask], ids[mask])
            seen[ids[mask]] += 1
            most["trainer"] = max(most["trainer"], _data_fds(os.getpid(), folder))
            if workers:
                pids |= worker_pids()
                for pid in pids:
                    most["workers"] = max(most["workers"], _data_fds(pid, folder))
    finally:
        done.set()
        watcher.join()
        getattr(iterator, "close", lambda: None)()
        source.close()
    assert (seen == 1).all()
    # One descriptor per open file once it was opened through h5py (its
    # reopens: from its byte layouts, `io._open_file.reopen`); a fetch's files and a
    # read-ahead hint's may be pinned beyond the bound for a moment, and a
    # first open holds h5py's descriptor too while it inspects the file. A
    # process's first opens come from cached byte layouts (`io._meta_cache`)
    # once the build cached them, so hints reach files soon: up to
    # `HINT_FILES` descriptors of their own.
    limit = bound + HINT_FILES + 3
    assert most["trainer"] <= limit, most
    if workers:
        assert len(pids) >= 2
        assert 0 < most["workers"] <= limit, most
    else:
        assert most["trainer"] > 0


def test_threads_never_see_a_handle_closed_under_them(few_paths, files):
    """Eight threads read random ranges of 40 files through a bound of 2: a
    handle closed while read would raise or give another file's values."""
    paths, truth = few_paths, files.truth(FEW)
    source = grain_cells.AnnDataSource(
        paths, block_size=4, obs_columns=["idx"], max_open_files=2, read_threads=0
    )
    failures: list = []
    stop = time.monotonic() + 1.5

    def hammer(seed):
        rng = random.Random(seed)
        try:
            while time.monotonic() < stop:
                files = rng.sample(range(len(paths)), rng.randint(1, 3))
                starts = [f * CELLS + rng.randrange(CELLS) for f in files]
                stops = [
                    s + 1 + rng.randrange((s // CELLS + 1) * CELLS - s) for s in starts
                ]
                cells = source.read_ranges(starts, stops)
                ids = np.concatenate(
                    [np.arange(a, b) for a, b in zip(starts, stops, strict=True)]
                )
                np.testing.assert_array_equal(cells.row_ids, ids)
                np.testing.assert_array_equal(cells.X.toarray(), truth[ids])
                np.testing.assert_array_equal(cells.obs["idx"], ids)
                source.advise(rng.sample(range(len(source)), 2))
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]
    assert source._handles.open_count <= 2


class _Handle:
    """A fake file that records a close while a reader uses it."""

    def __init__(self, key, log):
        self.key, self.log, self.busy, self.closed = key, log, 0, False

    def use(self):
        if self.closed:
            self.log.append(f"file {self.key} read after close")
        self.busy += 1
        time.sleep(0.0001)
        self.busy -= 1

    def close(self):
        if self.busy:
            self.log.append(f"file {self.key} closed while read")
        self.closed = True


def test_the_lru_closes_no_pinned_file_and_shrinks_back():
    log: list[str] = []
    opened: list[_Handle] = []

    def opener(key):
        opened.append(_Handle(key, log))
        return opened[-1]

    lru = file_lru.FileLru(opener, max_open=2)

    def reader(seed):
        rng = random.Random(seed)
        for _ in range(300):
            keys = rng.sample(range(10), rng.randint(1, 4))
            with lru.pinned(keys) as handles:
                for h in handles:
                    h.use()

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not log, log[:3]
    assert lru.open_count <= 2
    assert sum(not h.closed for h in opened) == lru.open_count
    # Every file pinned: the bound is exceeded rather than waited for.
    with lru.pinned([0, 1, 2, 3]) as handles:
        assert lru.open_count == 4 and not any(h.closed for h in handles)
        lru.close_all()  # pinned files close when the read ends
        assert not any(h.closed for h in handles)
    assert all(h.closed for h in handles) and lru.open_count == 0


def test_a_file_rewritten_after_its_eviction_is_refused(few_paths, tmp_path):
    paths = [str(tmp_path / f"{i}.h5ad") for i in range(2)]
    for src, dst in zip(few_paths[:2], paths, strict=True):
        shutil.copyfile(src, dst)
    source = grain_cells.AnnDataSource(paths, block_size=4, max_open_files=1)
    first = source.read([0, 1]).X.toarray()
    source.read([CELLS])  # file 1 opens, file 0 closes
    np.testing.assert_array_equal(source.read([0, 1]).X.toarray(), first)  # reopens
    source.read([CELLS])
    os.unlink(paths[0])
    shutil.copyfile(few_paths[2], paths[0])  # same layout, other values
    with pytest.raises(errors.SourceChangedError, match=r"0\.h5ad"):
        source.read([0])


def test_the_option_is_checked_and_travels_to_workers(few_paths):
    for bad in (0, -1, "many"):
        with pytest.raises(ValueError, match="max_open_files"):
            grain_cells.AnnDataSource(few_paths[:1], max_open_files=bad)
    with pytest.raises(TypeError, match="max_open_files"):
        grain_cells.AnnDataSource(few_paths[:1], max_open_files=2.5)
    source = grain_cells.AnnDataSource(few_paths[:3], max_open_files=1)
    copy = pickle.loads(pickle.dumps(source))
    for f in range(3):  # one file a read: each through the bound
        copy.read(np.arange(f * CELLS, (f + 1) * CELLS))
    assert copy._handles.open_count == 1


def test_the_default_budget_follows_a_low_descriptor_limit(monkeypatch):
    monkeypatch.setattr(file_lru.resource, "getrlimit", lambda _: (256, 4096))
    assert file_lru.default_budget() == 64
    assert file_lru.default_max_open() == 21
    monkeypatch.setattr(file_lru.resource, "getrlimit", lambda _: (1024, 4096))
    assert file_lru.default_budget() == file_lru.DEFAULT_BUDGET == 384
    monkeypatch.setattr(file_lru.resource, "getrlimit", lambda _: (1 << 20, 1 << 20))
    assert file_lru.default_budget() == 384
    assert file_lru.default_max_open() == 128


def test_auto_keeps_more_descriptor_only_files_than_format_held_ones():
    opened = []

    class Handle:
        def __init__(self, key):
            self.key, self.closed = key, False
            opened.append(self)

        def close(self):
            self.closed = True

    lru = file_lru.FileLru(
        Handle, 10, max_weight=10, weight=lambda h: 3 if h.key >= 100 else 1
    )
    for key in range(10):
        with lru.pinned([key]):
            pass
    assert lru.open_count == 10  # ten descriptor-only files: weight 10
    for key in (100, 101):
        with lru.pinned([key]):
            pass
    # Two heavy files (6) leave room for four light ones, the newest.
    assert lru.open_count == 6
    assert sorted(h.key for h in opened if not h.closed) == [6, 7, 8, 9, 100, 101]
