"""benchmarks/zarr_read.py runs on a tiny config, so it does not rot.

Checked: exit status 0, one result line per point, the JSON's files (the
same cells in every storage) and its ratios. The annbatch points run where
annbatch is importable (Python >= 3.12, the CI's second leg); elsewhere the
binary is asked for the grain_cells points only. Speed figures at this size
mean nothing and are not checked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import pytest

# A subprocess that makes three (five) stores and reads each: seconds.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
HAS_ANNBATCH = importlib.util.find_spec("annbatch") is not None


def test_zarr_read(tmp_path, forked_runs):
    points = ["h5ad", "zarr", "zarr_raw", "zarr_aligned"]
    if HAS_ANNBATCH:
        points += ["collection", "annbatch"]
    out = tmp_path / "zarr_read.json"
    done = forked_runs.run(
        [
            str(ROOT / "benchmarks" / "zarr_read.py"),
            "--n_cells=1500",
            "--n_genes=200",
            "--mean_nnz=20",
            f"--points={','.join(points)}",
            "--workers=0",
            "--caches=warm",
            "--warmup=1",
            "--minibatches=3",
            "--max_seconds=2",
            f"--json={out}",
        ],
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "GRAIN_CELLS_CACHE": str(tmp_path / "cache")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    files = figures["files"]
    assert {"h5ad", "zarr", "zarr_raw"} <= set(files)
    for name in files:
        assert files[name]["shape"] == [1500, 200], name
        assert files[name]["nnz"] == files["h5ad"]["nnz"], name  # the same cells
    assert files["zarr"]["shards"] and files["zarr"]["codecs"]
    assert not files["zarr_raw"]["codecs"]
    results = {r["point"]: r for r in figures["results"]}
    assert set(results) == set(points)
    for r in results.values():
        assert "error" not in r and r["cells_per_s"] > 0 and r["entropy_mean"] > 2
    assert {c["store"] for c in figures["decode_ceilings"]} == {
        files["zarr"]["path"],
        files["zarr_raw"]["path"],
    }
    ceiling = next(
        c for c in figures["decode_ceilings"] if c["store"] == files["zarr"]["path"]
    )
    assert ceiling["zarr_python_cells_per_s"] > 0 and ceiling["codec_cells_per_s"] > 0
    overs = {(r["point"], r["over"]) for r in figures["ratios"]}
    assert {("zarr", "h5ad"), ("zarr_raw", "h5ad"), ("zarr_aligned", "h5ad")} <= overs
    if HAS_ANNBATCH:
        assert files["collection"]["stores"] >= 1
        assert ("collection", "annbatch") in overs
    assert figures["flags"]["n_cells"] == 1500
