"""Read-ahead hints stop while reads find the page cache warm (issue 33).

Every local positional read asks first without waiting (`preadv` with
`RWF_NOWAIT`) and counts the pieces the kernel could not hand over from
memory (`storage.read_counts`). A source whose recent reads missed at most
`WARM_MISSES` of `WARM_PIECES` pieces sends no `posix_fadvise` hints (on
2,000 files each hint reopened a closed file); as soon as more miss, hints
start again, and they stop again once the hints themselves, which ask for
each piece without waiting before advising it, find the pages in memory.
The bytes read never depend on any of it.

Files are written by anndata; values are checked against anndata's rows.
"""

from __future__ import annotations

import errno
import os

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.io import _file_set as file_set
from grain_cells.storage import _readers

pytestmark = pytest.mark.skipif(
    not hasattr(os, "posix_fadvise") or not hasattr(os, "RWF_NOWAIT"),
    reason="Linux page-cache hints",
)

CELLS = 3000
GENES = 40


def _write(path: str, seed: int) -> anndata.AnnData:
    rng = np.random.default_rng(seed)
    x = sp.random(CELLS, GENES, density=0.1, format="csr", random_state=rng)
    adata = anndata.AnnData(
        X=x.astype(np.float32),
        obs=pd.DataFrame(index=[f"c{seed}_{r}" for r in range(CELLS)]),
        var=pd.DataFrame(index=[f"g{j}" for j in range(GENES)]),
    )
    adata.write_h5ad(path)
    return adata


@pytest.fixture(params=[1, 2], ids=["one_file", "two_files"])
def written(request, tmp_path):
    """`(paths, adatas)`: one file, or two (the many-file fetch)."""
    paths = [str(tmp_path / f"part{k}.h5ad") for k in range(request.param)]
    return paths, [_write(p, k) for k, p in enumerate(paths)]


@pytest.fixture
def hints(monkeypatch) -> list[int]:
    """Every `posix_fadvise(WILLNEED)` call of this process (counted, then done)."""
    calls: list[int] = []
    real = os.posix_fadvise

    def fadvise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            calls.append(fd)
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    return calls


def _read_much(source, rng, fetches: int = 6) -> None:
    """Fetches of 300 scattered one-cell ranges, over every file."""
    for _ in range(fetches):
        rows = np.sort(rng.choice(source.num_cells, 300, replace=False))
        source.fetch_ranges(rows, rows + 1)


def _expected(adatas, rows) -> np.ndarray:
    dense = np.concatenate([a.X.toarray() for a in adatas])
    return dense[rows]


def test_hints_stop_once_reads_find_the_page_cache_warm(written, hints):
    paths, adatas = written
    source = grain_cells.AnnDataSource(paths, block_size=16)
    keys = np.arange(0, len(source), 7)
    source.advise(keys)  # nothing read yet: nothing known, nothing hinted
    rng = np.random.default_rng(0)
    source.fetch_ranges(np.array([0]), np.array([CELLS]))  # every page read once
    _read_much(source, rng)
    hints.clear()
    source.advise(keys)
    assert hints == []  # a few thousand pieces read, all in memory
    assert source._handles.cache_warm
    assert not source.hints_wanted  # the fetch stage works none out
    rows = np.sort(rng.choice(source.num_cells, 50, replace=False))
    got = source.read(rows)
    np.testing.assert_array_equal(got.X.toarray(), _expected(adatas, rows))
    source.close()


def test_hints_start_again_when_reads_miss(written, hints, monkeypatch):
    paths, _ = written
    source = grain_cells.AnnDataSource(paths, block_size=16)
    rng = np.random.default_rng(1)
    source.fetch_ranges(np.array([0]), np.array([CELLS]))
    _read_much(source, rng)
    handles = source._handles
    assert handles.cache_warm
    real = os.preadv

    def cold(fd, buffers, offset, flags=0):  # nothing in memory any more
        if flags & os.RWF_NOWAIT:
            raise BlockingIOError(errno.EAGAIN, "would block")
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", cold)
    _read_much(source, rng)  # a miss per read call: a few fetches
    assert not handles.cache_warm
    assert source.hints_wanted
    hints.clear()
    source.advise(np.arange(0, len(source), 7))
    assert hints  # hinted again
    source.close()


@pytest.mark.parametrize("how", ["eagain", "short", "refused"])
def test_reads_that_would_block_are_read_waiting(written, monkeypatch, how):
    """A piece not (all) in memory is read again waiting: same values.

    After a miss, a read call's other pieces are read waiting, not asked.

    `refused`: a file system that takes no `RWF_NOWAIT` (EOPNOTSUPP): reads
    wait from then on, and nothing is counted (the source never turns
    warm: hints stay).
    """
    paths, adatas = written
    monkeypatch.setattr(_readers.read_counts, "supported", True)
    real = os.preadv
    asked = []

    def partly(fd, buffers, offset, flags=0):
        if not flags & os.RWF_NOWAIT:
            return real(fd, buffers, offset, flags)
        asked.append(offset)
        if how == "eagain":
            raise BlockingIOError(errno.EAGAIN, "would block")
        if how == "refused":
            raise OSError(errno.EOPNOTSUPP, "not supported")
        (view,) = buffers
        return real(fd, [view[: len(view) // 2]], offset, flags)

    monkeypatch.setattr(os, "preadv", partly)
    source = grain_cells.AnnDataSource(paths, block_size=16)
    rows = np.sort(
        np.random.default_rng(2).choice(source.num_cells, 400, replace=False)
    )
    before = _readers.read_counts.snapshot()
    got = source.read(rows)
    np.testing.assert_array_equal(got.X.toarray(), _expected(adatas, rows))
    pieces, missed = (
        a - b for a, b in zip(_readers.read_counts.snapshot(), before, strict=True)
    )
    if how == "refused":  # asked once, never again, nothing counted
        assert len(asked) == 1 and not _readers.read_counts.supported
        assert missed == pieces == 0
    else:  # one piece asked per read call: it misses, the rest wait
        assert missed == len(asked) == pieces > 0
    assert not source._handles.cache_warm
    source.close()


def test_a_source_of_objects_is_never_warm(monkeypatch, tmp_path):
    """Reads of an object in a store are not counted: its hints never stop."""
    path = str(tmp_path / "part0.h5ad")
    _write(path, 0)
    monkeypatch.setattr(file_set, "is_url", lambda p: True)
    files = file_set.FileSet.inspect(
        [path],
        element="X",
        obs_names=(),
        genes=None,
        join="exact",
        obs_missing="error",
    )
    handles = file_set.OpenFiles(files, read_threads=0)
    handles._warm = True
    assert not handles.cache_warm


def test_reads_that_missed_never_ask_again(written, monkeypatch):
    """Once reads miss, the source hints for good: its reads stop asking.

    (Reads that hit because hints fetched their pages are no evidence.)
    """
    paths, adatas = written
    monkeypatch.setattr(_readers.read_counts, "supported", True)
    real = os.preadv
    asked = []

    def cold(fd, buffers, offset, flags=0):
        if flags & os.RWF_NOWAIT:
            asked.append(offset)
            raise BlockingIOError(errno.EAGAIN, "would block")
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", cold)
    source = grain_cells.AnnDataSource(paths, block_size=16)
    rng = np.random.default_rng(4)
    _read_much(source, rng)  # unjudged: every fetch asks, and misses
    assert asked and source._handles.cache_warm is False
    asked.clear()

    def warm(fd, buffers, offset, flags=0):  # all in memory now
        if flags & os.RWF_NOWAIT:
            asked.append(offset)
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", warm)
    for _ in range(8):
        rows = np.sort(rng.choice(source.num_cells, 100, replace=False))
        got = source.read(rows)
        np.testing.assert_array_equal(got.X.toarray(), _expected(adatas, rows))
    assert asked == [] and source._handles.cache_warm is False
    source.close()


def test_hints_that_find_their_pages_cached_stop_again(written, hints, monkeypatch):
    """A source judged cold turns warm again when its hints find pages cached.

    (A page cache emptied for a while, then filled again: the hints' own
    asks, made before anything is advised, are the evidence; the reads'
    are not, since earlier hints fetched their pages.)
    """
    paths, adatas = written
    monkeypatch.setattr(_readers.read_counts, "supported", True)
    real, evicted = os.preadv, [True]

    def preadv(fd, buffers, offset, flags=0):
        if flags & os.RWF_NOWAIT and evicted[0]:
            raise BlockingIOError(errno.EAGAIN, "would block")
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", preadv)
    source = grain_cells.AnnDataSource(paths, block_size=16)
    rng = np.random.default_rng(5)
    _read_much(source, rng)
    keys = np.arange(len(source))
    for _ in range(3):  # every piece missing: hinted, still cold
        hints.clear()
        source.advise(keys)
        assert hints and source.hints_wanted
    evicted[0] = False  # every page in memory again
    source.fetch_ranges(np.array([0]), np.array([CELLS]))
    for _ in range(8):
        hints.clear()
        source.advise(keys)
        assert hints == []  # cached pieces are not advised
        if not source.hints_wanted:
            break
    assert source._handles.cache_warm
    rows = np.sort(rng.choice(source.num_cells, 50, replace=False))
    got = source.read(rows)
    np.testing.assert_array_equal(got.X.toarray(), _expected(adatas, rows))
    source.close()
