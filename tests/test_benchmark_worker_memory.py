"""benchmarks/worker_memory.py runs on a tiny config, so it does not rot.

Checked: exit status 0, one line per point, and its JSON: the file, the
defaults' choice and a peak RSS, PSS and USS for each of the 2 workers and
the trainer. The figures at this size say nothing about the issue's target
and are checked only for being there and plausible.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

# A subprocess that writes two tiny files and runs 2 workers twice: seconds.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_worker_memory(tmp_path):
    out = tmp_path / "memory.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "worker_memory.py"),
            "--n_cells=3000",
            "--n_genes=300",
            "--mean_nnz=30",
            "--gzip_chunks=2048",
            "--minibatches=40",
            f"--json={out}",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env={**os.environ, "GRAIN_CELLS_CACHE": str(tmp_path / "cache")},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("peak RSS per worker") == 2
    record = json.loads(out.read_text())
    assert [r["point"] for r in record["results"]] == ["none", "gzip"]
    assert record["files"][1]["compression"] == "gzip"
    for r in record["results"]:
        assert r["minibatches"] == 40
        assert len(r["workers"]) == 2
        for proc in [r["trainer"], *r["workers"]]:
            assert 20 < proc["peak_rss_mb"] < 4000, proc
            assert 0 < proc["max_uss_mb"] <= proc["max_pss_mb"] <= proc["peak_rss_mb"]
