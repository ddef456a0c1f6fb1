"""`TruncationWarning`: once per loader, in the trainer (issue 34).

The README's ten-line example used to print it (once per worker process):
its width is fitted to the data at quantile=0.999, which leaves out about
0.1% of the cells by design. A fitted width now warns only when it cuts
clearly more than its quantile leaves out; a width given by hand warns at
its first cut cell. The warning comes from the loader's trainer-side
iterator, so workers print nothing.
"""

from __future__ import annotations

import os
import re
import warnings

import grain
import numpy as np
import pytest

import grain_cells
from grain_cells import errors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ten_lines() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme[readme.index("## Ten lines") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_readme_ten_lines_run_without_a_warning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _ten_lines()
    assert "PaddedSparseOutput()" in code  # a width fitted to the data
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # anndata 0.13 sets a pandas option that pandas 3 deprecates, from
        # the caller's frame (not ours to fix; pyproject ignores it too).
        warnings.filterwarnings(
            "ignore", message="The 'future.infer_string' option is deprecated"
        )
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})


def _ours(seen) -> list:
    """The truncation warnings among those recorded: `pytest.warns` records
    every warning, and a process pool an earlier test left may warn while it
    is collected (CI, leg 2: loky's "semaphore might leak")."""
    return [w for w in seen if issubclass(w.category, errors.TruncationWarning)]


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_given_width_warns_once_per_loader_in_the_trainer(
    csr_paths, helpers, capfd, workers
):
    source = grain_cells.AnnDataSource(csr_paths, block_size=4)
    loader = grain_cells.loader(
        source,
        batch_size=8,
        fetch_factor=2,
        worker_count=workers,
        output=grain_cells.PaddedSparseOutput(width=3),
    )
    with pytest.warns(errors.TruncationWarning) as seen:
        for _ in range(2):  # two epochs of one loader
            batches = helpers.run(loader)
    seen = _ours(seen)
    assert len(seen) == 1, [str(w.message) for w in seen]
    assert seen[0].filename == helpers.run.__code__.co_filename  # user code
    assert "shown once per loader" in str(seen[0].message)
    assert "PaddedSparseOutput(width=3)" in str(seen[0].message)
    assert sum(int(b["truncated"].sum()) for b in batches) > 0
    assert "TruncationWarning" not in capfd.readouterr().err  # not from workers


def test_the_card_spelling_warns_once(csr_paths):
    source = grain_cells.AnnDataSource(csr_paths, block_size=4)
    loader = grain.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=1),
        operations=grain_cells.fetch_operations(
            source, batch_size=8, output=grain_cells.PaddedSparseOutput(width=3)
        ),
        worker_count=0,
    )
    with pytest.warns(errors.TruncationWarning, match="width=3") as seen:
        truncated = sum(int(b["truncated"].sum()) for b in loader)
    assert len(_ours(seen)) == 1
    assert truncated > 0


def _report(output):
    from grain_cells.outputs._padded import TruncationReport

    return TruncationReport({"": output})


def _batch(cut: int, cells: int = 64, nnz: int = 200) -> dict:
    truncated = np.zeros(cells, bool)
    truncated[:cut] = True
    return {
        "truncated": truncated,
        "nnz": np.where(truncated, nnz, 10).astype(np.int32),
        "row_ids": np.arange(cells),
        "mask": np.ones(cells, bool),
    }


@pytest.fixture
def fitted(csr_paths):
    source = grain_cells.AnnDataSource(csr_paths, block_size=4)
    output = grain_cells.PaddedSparseOutput(quantile=0.999).fit_to_source(source)
    assert output.fitted and output.width == 128
    return output


def test_a_fitted_width_cutting_its_share_is_quiet(fitted):
    report = _report(fitted)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(200):  # 12,800 cells, 12 cut: its 0.1%
            report.observe(_batch(1 if i % 16 == 0 else 0))
    assert report  # still watching


def test_a_fitted_width_cutting_clearly_more_warns(fitted):
    report = _report(fitted)
    report.observe(_batch(5))
    with pytest.warns(errors.TruncationWarning, match=r"quantile=0\.999") as seen:
        report.observe(_batch(20))
        report.observe(_batch(20))
    seen = _ours(seen)
    assert len(seen) == 1
    assert "cut 25 of 128 so far" in str(seen[0].message)
    assert not report  # said once


def test_a_given_width_warns_at_its_first_cut_cell():
    report = _report(grain_cells.PaddedSparseOutput(width=128))
    with pytest.warns(errors.TruncationWarning, match=r"1 of 64 cells.*up to 200"):
        report.observe(_batch(1))
