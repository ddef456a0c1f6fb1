"""The suite never writes to the user's `~/.cache/grain_cells` (conftest's
`private_cache`): corpus statistics computed by a test land in the
session's folder."""

from __future__ import annotations

import os
import pathlib

import grain_cells


def test_the_cache_is_the_sessions(csr_paths, private_cache, tmp_path_factory):
    folder = pathlib.Path(os.environ["GRAIN_CELLS_CACHE"])
    assert folder == private_cache
    assert folder.is_relative_to(tmp_path_factory.getbasetemp())
    made = set(folder.glob("*.npz"))
    source = grain_cells.AnnDataSource(csr_paths)
    grain_cells.tokens.corpus_stats(source, progress=False)
    assert len(set(folder.glob("*.npz")) - made) == 1
