"""The per-file metadata cache: a second build opens no file, a changed file
is never described by its old entry (`grain_cells.io._meta_cache`)."""

from __future__ import annotations

import os
import time

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from processes import calls_to

import grain_cells
from grain_cells._util.cache_files import write_new
from grain_cells.io import _meta_cache as meta_cache
from grain_cells.io import _open_file

OBS = ["kind", "n"]


def _write(path, *, labels=("aa", "bb"), scale=1.0) -> None:
    rows = np.arange(8)
    x = sp.csr_matrix(
        ((rows + 1).astype(np.float32) * scale, (rows, rows % 4)), shape=(8, 4)
    )
    obs = pd.DataFrame(
        {
            "kind": pd.Categorical([labels[r % 2] for r in rows]),
            "n": rows.astype(np.int32),
        },
        index=[f"c{r}" for r in rows],
    )
    var = pd.DataFrame(index=[f"g{j}" for j in range(4)])
    anndata.AnnData(x, obs=obs, var=var).write_h5ad(path)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(folder))
    return folder


@pytest.fixture
def opens(monkeypatch):
    return calls_to(monkeypatch, meta_cache, "open_file")


# The quiet period of the tests that need quiet files: 0.1 s instead of 2 s
# (they waited 2.2 s each). Still far above the file system's timestamp tick
# (a change within one tick of the entry's write is what the period guards
# against); `test_a_just_written_file_is_not_cached` keeps the real 2 s.
SHORT_QUIET_NS = 100_000_000


@pytest.fixture
def files(tmp_path, monkeypatch) -> list[str]:
    monkeypatch.setattr(meta_cache, "QUIET_NS", SHORT_QUIET_NS)
    paths = [str(tmp_path / f"f{k}.h5ad") for k in range(3)]
    for k, p in enumerate(paths):
        _write(p, scale=k + 1)
    # Entries are written only for files quiet for `QUIET_NS`.
    time.sleep(meta_cache.QUIET_NS / 1e9 + 0.2)
    return paths


def _source(paths, obs=OBS):
    return grain_cells.AnnDataSource(paths, block_size=2, obs_columns=obs)


def _check_against_anndata(source, paths) -> None:
    adatas = [anndata.read_h5ad(p) for p in paths]
    cells = source.read(np.arange(source.num_cells))
    want = sp.vstack([a.X for a in adatas]).toarray()
    np.testing.assert_array_equal(cells.X.toarray(), want)
    for c in source.obs_columns:
        values = np.concatenate([a.obs[c].to_numpy() for a in adatas])
        got = source.obs_values(c)
        categories = source.categories.get(c)
        if categories is not None:
            got = np.asarray(categories)[got]
        np.testing.assert_array_equal(got, values)


def test_a_second_build_opens_no_file(files, cache, opens):
    first = _source(files)
    assert len(opens) == 3
    assert (cache / "file-meta").is_dir()
    second = _source(files)
    assert len(opens) == 3  # no file opened the second time
    for i in range(3):
        assert second.file_info(i) == first.file_info(i)
        assert second.file_identity(i) == first.file_identity(i)
    np.testing.assert_array_equal(second.var_names, first.var_names)
    assert {c: list(v) for c, v in second.categories.items() if v is not None} == {
        c: list(v) for c, v in first.categories.items() if v is not None
    }
    _check_against_anndata(second, files)


def test_a_file_changed_in_place_with_its_mtime_restored_is_read_again(
    files, cache, opens
):
    first = _source(files)
    st = os.stat(files[1])
    with h5py.File(files[1], "r+") as f:  # same size, same inode
        f["X/data"][0] = 99.0
    os.utime(files[1], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(files[1]).st_size == st.st_size
    del opens[:]
    second = _source(files)
    assert opens == [files[1]]
    assert second.file_identity(1).sample != first.file_identity(1).sample
    _check_against_anndata(second, files)


def test_a_file_rewritten_at_the_same_size_is_not_described_by_its_old_entry(
    files, cache, opens
):
    first = _source(files)
    size, mtime = os.path.getsize(files[0]), os.stat(files[0]).st_mtime_ns
    _write(files[0], labels=("zz", "yy"), scale=7.0)  # other labels, same size
    os.utime(files[0], ns=(mtime, mtime))
    assert os.path.getsize(files[0]) == size
    del opens[:]
    second = _source(files)
    assert opens == [files[0]]
    assert list(second.categories["kind"]) != list(first.categories["kind"])
    _check_against_anndata(second, files)


def test_a_damaged_entry_is_rebuilt(files, cache, opens):
    _source(files)
    for p in (cache / "file-meta").glob("*.json"):
        p.write_bytes(p.read_bytes()[:20])
    for p in (cache / "file-meta" / "arrays").glob("*.npy"):
        p.write_bytes(p.read_bytes()[:-3] + b"xyz")
    del opens[:]
    again = _source(files)
    assert len(opens) == 3
    _check_against_anndata(again, files)
    del opens[:]
    _source(files)
    assert opens == []  # written again


def test_an_entry_is_created_in_place_and_a_taken_name_replaced_whole(tmp_path):
    """Entries are created where they belong (no rename); a name already taken
    (a whole entry, or one a crash cut short) is replaced atomically."""
    path = tmp_path / "file-meta" / "e.json"
    write_new(path, b'{"a": 1}')  # no folder yet: made
    assert path.read_bytes() == b'{"a": 1}'
    path.write_bytes(b'{"a"')  # cut short
    write_new(path, b'{"a": 2}')
    assert path.read_bytes() == b'{"a": 2}'
    write_new(tmp_path / "file-meta" / "f.json", b"{}")
    assert sorted(p.name for p in path.parent.iterdir()) == ["e.json", "f.json"]
    for p in path.parent.iterdir():
        assert p.stat().st_mode & 0o777 == 0o644


def test_another_obs_column_opens_the_files(files, cache, opens):
    _source(files, obs=["kind"])
    del opens[:]
    both = _source(files, obs=["kind", "n"])
    assert len(opens) == 3
    _check_against_anndata(both, files)


def test_a_just_written_file_is_not_cached(tmp_path, cache, opens):
    path = str(tmp_path / "new.h5ad")
    _write(path)
    _source([path])
    _source([path])
    assert opens == [path, path]


def test_a_build_writes_one_entry_per_file_and_first_opens_read_it(
    files, cache, monkeypatch
):
    """Layouts for first opens live inside the metadata entry: one file per file."""
    _source(files)
    entries = list((cache / "file-meta").glob("*.json"))
    assert len(entries) == 3
    assert not (cache / "file-meta" / "layouts").exists()
    # A fresh process's first open of each file comes from its entry.
    source = _source(files)
    found = [_open_file.first_open(source.files, i) for i in range(len(files))]
    assert all(f is not None for f in found)
    for _, fd in found:  # the descriptor a first open keeps for its reads
        fd.close()
    _check_against_anndata(source, files)


def test_a_small_file_is_read_ahead_whole_before_its_inspection(
    files, cache, monkeypatch
):
    advised = []
    real = os.posix_fadvise

    def spy(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append((os.fstat(fd).st_size, offset, length))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    _source(files[:2])
    assert advised == [(os.path.getsize(p), 0, os.path.getsize(p)) for p in files[:2]]
    del advised[:]
    monkeypatch.setattr(meta_cache, "READ_AHEAD_BYTES", 100)  # larger files: not
    _source(files[2:])
    assert advised == []
