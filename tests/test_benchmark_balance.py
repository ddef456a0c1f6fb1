"""benchmarks/balance.py runs on a tiny config (as tests/test_benchmarks.py
runs the other binaries), so it does not rot.

Checked: exit status 0, its lines, and its JSON: the file and shape it ran
on, the three runs, and that the grouped copy's shares are closer to the
targets than the original's at the same block size. Speed figures at this
size mean nothing and are not checked.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

# A subprocess that writes a synthetic file, a grouped copy and reads three
# loaders: seconds.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_balance(tmp_path, forked_runs):
    out = tmp_path / "balance.json"
    done = forked_runs.run(
        [
            str(ROOT / "benchmarks" / "balance.py"),
            "--n_cells=3000",
            "--n_genes=200",
            "--mean_nnz=20",
            "--n_donors=4",
            "--n_types=5",
            "--window_cells=1500",
            f"--output_dir={tmp_path / 'grouped'}",
            f"--json={out}",
        ],
        timeout=180,
        cwd=tmp_path,
        env={**os.environ, "GRAIN_CELLS_CACHE": str(tmp_path / "cache")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "grouped block 16 vs block 1" in done.stdout
    figures = json.loads(out.read_text())
    assert figures["file"]["cells"] == 3000 and figures["file"]["genes"] == 200
    assert len(figures["file"]["natural_shares"]) == 5
    assert figures["flags"]["n_cells"] == 3000
    runs = {r["run"]: r for r in figures["results"]}
    assert set(runs) == {"original-b16", "original-b1", "grouped-b16"}
    assert runs["grouped-b16"]["whole_epoch"] and runs["grouped-b16"]["cells"] >= 2900
    assert runs["original-b16"]["warning"]  # the weights said they miss
    assert runs["grouped-b16"]["max_gap"] < runs["original-b16"]["max_gap"]
    assert pathlib.Path(figures["preshuffle"]["grouped_file"]).is_file()
    for r in runs.values():
        assert r["cells_per_cpu_s"] > 0
        assert sum(r["shares"].values()) == pytest.approx(1.0, abs=1e-3)
