"""benchmarks/startup.py and benchmarks/compressed_defaults.py run on tiny files.

As in `tests/test_benchmarks.py`: each binary runs as a subprocess, as a
person runs it, on a tiny synthetic file; checked are the exit status, the
lines printed and the JSON written.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from grain_cells.synthetic import _tahoe as synthetic

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(tmp_path, binary, *flags, timeout=300, forked_runs=None):
    """`python benchmarks/<binary> <flags>`; forked from a pre-imported
    process (tests/forked_runs.py) when given `forked_runs`, not for
    startup.py, which times a fresh interpreter's start."""
    argv = [str(ROOT / "benchmarks" / binary), *flags]
    env = {**os.environ, "GRAIN_CELLS_CACHE": str(tmp_path / "cache")}
    if forked_runs is not None:
        done = forked_runs.run(argv, timeout=timeout, cwd=tmp_path, env=env)
    else:
        done = subprocess.run(
            [sys.executable, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tmp_path,
            env=env,
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_startup(tmp_path):
    out = tmp_path / "startup.json"
    done = _run(
        tmp_path,
        "startup.py",
        f"--baseline={ROOT}",  # this tree twice: both code paths
        "--probes=first_inline,iterators",
        "--iterators=5",
        "--repeats=1",
        "--n_cells=2000",
        "--n_genes=300",
        "--mean_nnz=30",
        f"--cache_dir={tmp_path / 'data'}",
        f"--json={out}",
    )
    result = json.loads(out.read_text())
    assert {(r["tree"], r["probe"]) for r in result["records"]} == {
        (tree, probe)
        for tree in ("after", "before")
        for probe in ("first_inline", "iterators")
    }
    for r in result["records"]:
        assert r["path"].startswith(str(ROOT))  # the tree PYTHONPATH named
    first = [r for r in result["records"] if r["probe"] == "first_inline"]
    assert all(r["first_s"] > 0 and r["import_s"] > 0 for r in first)
    assert [r["iterators"] for r in result["records"] if "iterators" in r] == [5, 5]
    assert len(result["summary"]) == 4
    assert result["flags"]["iterators"] == 5
    assert " after first_inline " in done.stdout


def test_compressed_defaults(tmp_path, forked_runs):
    path = tmp_path / "gz.h5ad"
    synthetic.write_tahoe_like(
        path, 3_000, n_genes=300, mean_nnz=30, compression="gzip", chunks=4096
    )
    out = tmp_path / "compressed.json"
    _run(
        tmp_path,
        "compressed_defaults.py",
        f"--data={path}",
        "--points=defaults,loader,grid16,chunks1",
        "--warmup=1",
        "--minibatches=5",
        "--max_seconds=5",
        "--cache=warm",
        f"--json={out}",
        forked_runs=forked_runs,
    )
    result = json.loads(out.read_text())
    by = {r["point"]: r for r in result["results"]}
    assert set(by) == {"defaults", "loader", "grid16", "chunks1"}
    # grain_cells.loader(path) chooses what the card's spelling chooses.
    for key in ("block_size", "fetch_factor", "blocks"):
        assert by["loader"][key] == by["defaults"][key], key
    assert by["grid16"]["block_size"] == 16 and by["grid16"]["fetch_factor"] == 16
    # 4,096 values of 30-value cells: ~136 cells a chunk, one chunk a block.
    assert by["defaults"]["block_size"] > 16
    # 64 blocks per fetch, fewer where 64 chunks' cells would pass a fetch's
    # 7,680 (here ~136 cells a chunk: 56 blocks).
    blocks = by["defaults"]["fetch_factor"] * 64 // by["defaults"]["block_size"]
    assert 48 <= blocks <= 64, blocks
    assert by["chunks1"]["chunks_per_block"] == 1
    assert all(r["cells_per_s"] > 0 and r["entropy_mean"] > 0 for r in by.values())
    assert result["ratios"] == []  # no scdataset point
