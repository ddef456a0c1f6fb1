"""Iterator states of collections: a few KB whatever the number of files.

Past `LISTED_FILES` files a stamp records the files by one digest
(`grain_cells.io._identity.files_entry`), so `get_state` does not grow with
the files; states that list every file (saved by an older grain_cells) are
refused by name, and other data is still refused.
"""

from __future__ import annotations

import json

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.errors import CheckpointMismatchError
from grain_cells.io import _identity as identity

CELLS = 6  # per file


def _write(folder, n_files: int, first: int = 0) -> list[str]:
    paths = []
    for k in range(first, first + n_files):
        rows = np.arange(k * CELLS, (k + 1) * CELLS)
        x = sp.csr_matrix(
            (rows.astype(np.float32) + 1, (np.arange(CELLS), rows % 5)),
            shape=(CELLS, 5),
        )
        obs = pd.DataFrame(
            {"kind": pd.Categorical(np.where(rows % 2, "a", "b"))},
            index=[f"c{r}" for r in rows],
        )
        var = pd.DataFrame(index=[f"g{j}" for j in range(5)])
        path = str(folder / f"f{k:04d}.h5ad")
        anndata.AnnData(x, obs=obs, var=var).write_h5ad(path)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> list[str]:
    return _write(tmp_path_factory.mktemp("many"), 24)


def _loader(paths, worker_count=0):
    source = grain_cells.AnnDataSource(paths, block_size=2, obs_columns=["kind"])
    return grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=1, num_epochs=1),
        operations=grain_cells.fetch_operations(
            source, batch_size=4, fetch_factor=2, seed=1
        ),
        worker_count=worker_count,
    )


def _plain(batch) -> dict:
    return {k: np.array(v) for k, v in batch.items()}


def _state_after(loader, n: int) -> tuple[bytes, list]:
    iterator = iter(loader)
    seen = [next(iterator) for _ in range(n)]
    state = iterator.get_state()
    iterator.close()
    return state, seen


def _rest(loader, state) -> list[dict]:
    iterator = iter(loader)
    iterator.set_state(state)
    out = [_plain(b) for b in iterator]
    iterator.close()
    return out


def test_state_size_does_not_grow_with_files(many):
    small, _ = _state_after(_loader(many[:18]), 3)
    large, _ = _state_after(_loader(many), 3)
    assert len(large) < 4096
    assert abs(len(large) - len(small)) < 64
    files = json.loads(large)["grain_cells"]["data_source"]["files"]
    assert files["count"] == 24 and files["cells"] == 24 * CELLS


def test_few_files_are_still_listed(many):
    state, _ = _state_after(_loader(many[:3]), 1)
    files = json.loads(state)["grain_cells"]["data_source"]["files"]
    assert [f["cells"] for f in files] == [CELLS] * 3


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_restore_under_any_worker_count(many, workers):
    whole = [_plain(b) for b in _loader(many)]
    state, seen = _state_after(_loader(many), 7)
    rest = _rest(_loader(many, worker_count=workers), state)
    assert len(seen) + len(rest) == len(whole)
    for a, b in zip(rest, whole[7:], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_a_state_that_lists_every_file_is_refused_as_older(many):
    """Such a stamp was saved before states summarised the files (0.x: refused)."""
    state, _ = _state_after(_loader(many), 5)
    old = json.loads(state)
    source = grain_cells.AnnDataSource(many, block_size=2, obs_columns=["kind"])
    old["grain_cells"]["data_source"]["files"] = identity.file_entries(source)
    refused = (
        r"saved by an older grain_cells \(its stamp records every one of its 24 "
        r"files, not their summary.*Start the data iterator afresh"
    )
    with pytest.raises(CheckpointMismatchError, match=refused):
        _rest(_loader(many), json.dumps(old).encode())


def test_other_files_are_refused(many, tmp_path):
    state, _ = _state_after(_loader(many), 2)
    other = many[:-1] + _write(tmp_path, 1, first=22)  # other values
    refused = r"data_source: saved files\.sha256="
    with pytest.raises(CheckpointMismatchError, match=refused):
        _rest(_loader(other), state)
    fewer = many[:-1]
    with pytest.raises(CheckpointMismatchError, match=r"saved files\.count=24"):
        _rest(_loader(fewer), state)
