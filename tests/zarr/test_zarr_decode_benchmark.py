"""benchmarks/zarr_decode.py runs on a tiny config and writes its figures."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a subprocess writing two stores: seconds
def test_zarr_decode_runs(tmp_path, forked_runs):
    out = tmp_path / "r.json"
    done = forked_runs.run(
        [
            str(ROOT / "benchmarks" / "zarr_decode.py"),
            f"--workdir={tmp_path}",
            "--formats=v2,v3-sharded",
            "--n_cells=2000",
            "--n_genes=300",
            "--nnz_per_cell=20",
            "--batches=2",
            "--threads=2",
            "--digest_keys=50",
            f"--out={out}",
        ],
        timeout=180,
        cwd=os.getcwd(),
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    stores = [r for r in results if "store" in r]
    assert [r["store"].split("-n")[0] for r in stores] == [
        "csr-v2",
        "csr-v3-sharded",
    ]
    for r in stores:
        assert r["ceiling_cells_per_s"] > 0
        for key in (
            "stub_default_warm",
            "stub_default_cold",
            "fast_cold",
            "fast_pool2_warm",
        ):
            assert r[key]["cells_per_s"] > 0 and r[key]["cpu_ms_per_batch"] > 0
    assert results[-1]["digest_keys"] == 50
