"""A many-file fetch opens closed files for that fetch alone (issue 33).

A collection read in random order touches more files than a process keeps
open. A closed file whose CSR byte pieces the process knows is read
through a descriptor of the fetch's own (`os.open`, `fstat` checked
against its identity, `os.close` after the read), not reopened into the
open-file bound (`io._open_file.reopen`), which closed another file to
make room. The bound, the values and the checks stay as they were.

Files are written by anndata; the value at (global row r, gene j) is
`r * 10 + j + 1`, so a row read from the wrong file or offset shows.
"""

from __future__ import annotations

import os

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.errors import SourceChangedError
from grain_cells.io import _file_set as file_set
from grain_cells.io import _open_file as open_file_mod
from grain_cells.storage import _readers

N_FILES = 6
CELLS = 40
GENES = 5


def _write(path: str, f: int) -> None:
    rows = np.arange(f * CELLS, (f + 1) * CELLS)
    values = rows[:, None] * 10 + np.arange(GENES)[None, :] + 1.0
    values[(rows[:, None] + np.arange(GENES)[None, :]) % 3 == 0] = 0
    anndata.AnnData(
        X=sp.csr_matrix(values.astype(np.float32)),
        obs=pd.DataFrame({"idx": rows}, index=[f"c{r}" for r in rows]),
        var=pd.DataFrame(index=[f"g{j}" for j in range(GENES)]),
    ).write_h5ad(path)


@pytest.fixture
def paths(tmp_path) -> list[str]:
    out = [str(tmp_path / f"part{f}.h5ad") for f in range(N_FILES)]
    for f, p in enumerate(out):
        _write(p, f)
    return out


@pytest.fixture
def reopens(monkeypatch) -> list[int]:
    """Files reopened into the open-file bound from their byte layouts."""
    calls: list[int] = []
    real = open_file_mod.reopen

    def counting(files, i, known, fd=None):
        calls.append(i)
        return real(files, i, known, fd)

    monkeypatch.setattr(open_file_mod, "reopen", counting)
    monkeypatch.setattr(file_set, "reopen", counting)
    return calls


def _truth(paths) -> np.ndarray:
    return np.concatenate([anndata.read_h5ad(p).X.toarray() for p in paths]).astype(
        np.float32
    )


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux /proc")
def test_known_closed_files_are_read_without_a_reopen(paths, reopens):
    truth = _truth(paths)
    source = grain_cells.AnnDataSource(
        paths, block_size=4, obs_columns=["idx"], max_open_files=2
    )
    handles = source._handles
    for f in range(N_FILES):  # every file opened (and checked) once
        source.read([f * CELLS])
    rng = np.random.default_rng(0)
    reopens.clear()
    fds = _fds()
    for _ in range(10):  # fetches over every file: four of six closed
        rows = rng.choice(N_FILES * CELLS, 60, replace=False)
        cells = source.read(rows)
        np.testing.assert_array_equal(cells.X.toarray(), truth[rows])
        np.testing.assert_array_equal(cells.obs["idx"], rows)
    assert reopens == []
    assert handles.open_count <= 2
    # Each fetch's own descriptors closed after it (the bound's files too:
    # room is made for them).
    assert _fds() <= fds
    source.close()


def test_a_file_changed_while_closed_is_refused_at_a_fetch(paths):
    source = grain_cells.AnnDataSource(paths, block_size=4, max_open_files=1)
    for f in range(N_FILES):
        source.read([f * CELLS])
    source.read([CELLS, 2 * CELLS])  # file 0 closed, its byte pieces known
    os.utime(paths[0], ns=(1, 1))
    with pytest.raises(SourceChangedError, match=r"part0\.h5ad"):
        source.read([0, CELLS])
    source.close()


@pytest.mark.parametrize("change", ["touched", "replaced"])
def test_a_file_changed_after_its_pieces_are_known_is_refused(paths, change):
    source = grain_cells.AnnDataSource(
        paths, block_size=4, obs_columns=["idx"], max_open_files=1
    )
    for f in range(N_FILES):
        source.read([f * CELLS])
    source.read([0, 2 * CELLS])  # file 0's pieces learnt; it stays closed
    np.testing.assert_array_equal(source.read([0, CELLS]).obs["idx"], [0, CELLS])
    if change == "touched":
        os.utime(paths[0], ns=(1, 1))
    else:  # another file of the same size under the name
        _write(paths[0] + ".new", 0)
        os.replace(paths[0] + ".new", paths[0])
    with pytest.raises(SourceChangedError, match=r"part0\.h5ad"):
        source.read([0, CELLS])
    source.close()


def test_a_file_removed_while_closed_is_refused_at_a_fetch(paths):
    source = grain_cells.AnnDataSource(paths, block_size=4, max_open_files=1)
    for f in range(N_FILES):
        source.read([f * CELLS])
    source.read([CELLS, 2 * CELLS])
    os.rename(paths[0], paths[0] + ".gone")
    with pytest.raises((SourceChangedError, FileNotFoundError), match=r"part0"):
        source.read([0, CELLS])
    source.close()


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd") or not hasattr(os, "posix_fadvise"),
    reason="Linux /proc and page-cache hints",
)
def test_hints_of_known_closed_files_take_a_bare_descriptor(
    paths, reopens, monkeypatch
):
    source = grain_cells.AnnDataSource(paths, block_size=4, max_open_files=2)
    handles = source._handles
    for f in range(N_FILES):
        source.read([f * CELLS])
    source.read(np.arange(N_FILES) * CELLS)  # every file's pieces known
    hinted: list[int] = []  # descriptors advised, or asked first (RWF_NOWAIT)
    real, real_preadv = os.posix_fadvise, os.preadv

    def fadvise(fd, offset, length, advice):
        hinted.append(fd)
        return real(fd, offset, length, advice)

    def preadv(fd, buffers, offset, flags=0):
        if flags & getattr(os, "RWF_NOWAIT", 0):
            hinted.append(fd)
        return real_preadv(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr(os, "preadv", preadv)
    reopens.clear()
    fds = _fds()
    source.advise(np.arange(len(source)))
    assert reopens == []
    assert len(set(hinted)) >= N_FILES - 2  # the closed files too
    assert _fds() == fds and handles.open_count <= 2
    os.utime(paths[0], ns=(1, 1))  # changed: not hinted, not raised
    source.advise(np.arange(len(source)))
    source.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux /proc")
def test_a_fetchs_own_descriptors_stay_within_the_bound(paths, monkeypatch):
    """Closed files read with descriptors of the fetch's own: the bound makes room."""
    from grain_cells.io import _direct_csr

    source = grain_cells.AnnDataSource(paths, block_size=4, max_open_files=4)
    baseline = _fds()  # nothing open yet
    for f in range(N_FILES):  # the bound fills: four files open
        source.read([f * CELLS])
    source.read(np.arange(N_FILES) * CELLS)  # every file's pieces known
    during: list[int] = []
    real = _direct_csr.read

    def counting(*args, **kwargs):
        during.append(_fds())
        return real(*args, **kwargs)

    monkeypatch.setattr(_direct_csr, "read", counting)
    rng = np.random.default_rng(3)
    for _ in range(8):  # three files a fetch, mostly closed ones
        rows = np.concatenate(
            [
                f * CELLS + rng.choice(CELLS, 5, replace=False)
                for f in rng.choice(N_FILES, 3, replace=False)
            ]
        )
        source.read(rows)
    assert len(during) == 8
    assert max(during) <= baseline + 4
    source.close()


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd") or not hasattr(os, "posix_fadvise"),
    reason="Linux /proc and page-cache hints",
)
@pytest.mark.parametrize("nowait", [False, True], ids=["advised", "asked_first"])
def test_a_hint_reads_each_short_ranges_pointers_in_one_read(
    paths, monkeypatch, nowait
):
    """A hint of known files reads one `indptr` piece per range (its slice),
    not its two ends apart, and hints the same values' pages as before.

    `asked_first`: where `RWF_NOWAIT` works, each value piece is asked for
    first (one more read each) and, all in memory here, not advised.
    """
    if nowait and not getattr(os, "RWF_NOWAIT", 0):
        pytest.skip("RWF_NOWAIT")
    monkeypatch.setattr(_readers.read_counts, "supported", nowait)
    source = grain_cells.AnnDataSource(paths, block_size=4, max_open_files=2)
    source.read(np.arange(N_FILES) * CELLS)  # every file's pieces known
    pieces: list[int] = []
    hinted: list[tuple[int, int]] = []
    real_preadv, real_fadvise = os.preadv, os.posix_fadvise

    def preadv(fd, buffers, offset, *flags):
        pieces.append(fd)
        return real_preadv(fd, buffers, offset, *flags)

    def fadvise(fd, offset, length, advice):
        hinted.append((offset, length))
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    blocks = np.arange(0, len(source), 3)  # blocks of 4 rows, none touching
    source.advise(blocks)
    if nowait:  # its slice, then its data and indices asked: all cached
        assert len(pieces) == 3 * blocks.size and hinted == []
    else:
        assert len(pieces) == blocks.size  # one read per range (was two)
        assert len(hinted) == 2 * blocks.size  # its data and its indices
    source.close()


@pytest.mark.skipif(
    not hasattr(os, "posix_fadvise") or not getattr(os, "RWF_NOWAIT", 0),
    reason="Linux page-cache hints",
)
def test_a_hint_fetches_missing_pointers_together(paths, monkeypatch):
    """Pointers the kernel cannot hand over without waiting are all hinted
    first, then read: one wait for them all, not one per piece. Every
    range's values are hinted still, and the read is right."""
    source = grain_cells.AnnDataSource(paths, block_size=4, max_open_files=2)
    for f in range(N_FILES):
        source.read([f * CELLS])
    source.read(np.arange(N_FILES) * CELLS)  # every file's pieces known
    events: list[str] = []
    real_preadv, real_fadvise = os.preadv, os.posix_fadvise

    def preadv(fd, buffers, offset, flags=0):
        if flags & os.RWF_NOWAIT:
            raise BlockingIOError  # as if nothing were in memory
        events.append("wait")
        return real_preadv(fd, buffers, offset, flags)

    def fadvise(fd, offset, length, advice):
        events.append("hint")
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    blocks = np.arange(0, len(source), 3)
    source.advise(blocks)
    n = blocks.size  # each range's pointers hinted, read, then its values
    assert events == ["hint"] * n + ["wait"] * n + ["hint"] * 2 * n
    monkeypatch.setattr(os, "preadv", real_preadv)
    rows = np.arange(0, N_FILES * CELLS, 7)
    got = source.read(rows).X.toarray()
    values = rows[:, None] * 10 + np.arange(GENES)[None, :] + 1.0
    values[(rows[:, None] + np.arange(GENES)[None, :]) % 3 == 0] = 0
    np.testing.assert_array_equal(got, values)
    source.close()
