"""benchmarks/trainer_cpu.py runs on a tiny file, three spellings, with a baseline.

As tests/test_benchmarks.py does for the other binaries: a subprocess, as a
person runs it, checking its exit status, its lines and its JSON.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from grain_cells.synthetic import _tahoe as synthetic

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_trainer_cpu(tmp_path, forked_runs):
    data = tmp_path / "tiny.h5ad"
    synthetic.write_tahoe_like(data, 2_000, n_genes=300, mean_nnz=30)
    out = tmp_path / "trainer_cpu.json"
    done = forked_runs.run(
        [
            str(ROOT / "benchmarks" / "trainer_cpu.py"),
            f"--data={data}",
            "--worker_counts=0",
            "--spellings=loader,card,card_buffered",
            "--warmup=2",
            "--minibatches=10",
            f"--baseline_tree={ROOT}",
            f"--json={out}",
        ],
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "GRAIN_CELLS_CACHE": str(tmp_path / "cache")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["setup"]["shape"] == [2_000, 300]
    records = report["records"]
    assert {(r["tree"], r["spelling"]) for r in records} == {
        (tree, spelling)
        for tree in ("this", "baseline")
        for spelling in ("loader", "card", "card_buffered")
    }
    for r in records:
        assert r["trainer_cpu_us_per_minibatch"] > 0
        assert "obs/plate" in r["minibatch_keys"]
    assert "CPU µs/minibatch, ceiling" in done.stdout
