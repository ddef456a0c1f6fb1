"""The suite never writes to the user's `~/.cache/grain_cells` (conftest's
`private_cache`): corpus statistics computed by a test land in the
session's folder."""

from __future__ import annotations

import os
import pathlib

import pytest

import grain_cells


def test_the_cache_is_the_sessions(csr_paths, private_cache, tmp_path_factory):
    folder = pathlib.Path(os.environ["GRAIN_CELLS_CACHE"])
    assert folder == private_cache
    assert folder.is_relative_to(tmp_path_factory.getbasetemp())
    made = set(folder.glob("*.npz"))
    source = grain_cells.AnnDataSource(csr_paths)
    grain_cells.tokens.corpus_stats(source, progress=False)
    assert len(set(folder.glob("*.npz")) - made) == 1


def test_cache_folders_follow_the_environment_as_before(monkeypatch, tmp_path):
    # Each cache keeps the folder it had before the folders were resolved in
    # one place: chunk starts and corpus statistics honour XDG_CACHE_HOME,
    # obs codes and synthetic files never did.
    from grain_cells.io import _obs_cache
    from grain_cells.source import _chunk_grid
    from grain_cells.tokens import _corpus_stats

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("GRAIN_CELLS_CACHE", raising=False)
    monkeypatch.delenv("GRAIN_CELLS_OBS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _chunk_grid.cache_dir() == str(tmp_path / "xdg/grain_cells/chunk-starts")
    assert _corpus_stats.cache_root() == str(tmp_path / "xdg/grain_cells")
    assert _obs_cache.cache_folder() == home / ".cache/grain_cells/obs"
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "own"))
    assert _chunk_grid.cache_dir() == str(tmp_path / "own/chunk-starts")
    assert _corpus_stats.cache_root() == str(tmp_path / "own")
    assert _obs_cache.cache_folder() == tmp_path / "own/obs"


def test_a_failed_cache_write_leaves_no_file(tmp_path):
    from grain_cells._util.cache_files import write_atomic

    target = tmp_path / "sub" / "entry.npy"

    def fail(fh):
        fh.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, fail)
    assert list((tmp_path / "sub").iterdir()) == []
    write_atomic(target, lambda fh: fh.write(b"whole"))
    assert target.read_bytes() == b"whole"
    assert target.stat().st_mode & 0o777 == 0o644
