"""benchmarks/scale.py runs at tiny size (`--smoke`), so it does not rot.

Checked: exit status 0 and its JSON: one point per one-file size and per
collection, each asked measure present with its figures (no failure), and
the collection compared with the one file of the same cells. The figures at
this size say nothing about scale.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

# A fresh Python process per point (`--smoke` runs a point's measures in one)
# and a worker start per worker measure: ~15 s.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_scale_smoke(tmp_path):
    out = tmp_path / "scale.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "scale.py"),
            "--smoke",
            "--measures=construct,first_batch,epoch,workers,get_state,weights,splits",
            f"--data_dir={tmp_path / 'data'}",
            f"--json={out}",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    points = {p["point"]: p for p in record["points"]}
    assert list(points) == ["3k-none", "f3-none"]
    assert points["f3-none"]["files"] == 3
    assert points["f3-none"]["file"]["shape"] == [1_000, 2_000]
    for p in points.values():
        m = p["measures"]
        assert not [k for k, v in m.items() if "error" in v], m
        assert m["construct"]["cells"] == 3_000
        assert m["construct"]["construct_cpu_s"] > 0
        assert m["first_batch"]["cells_per_s"] > 0
        assert m["epoch"]["all_cells_once"] and m["epoch"]["cells"] == 3_000
        worker = m["workers"]["worker"]
        assert len(worker) == 1
        assert 0 < worker[0]["anon_mb"] <= worker[0]["rss_mb"]
        assert worker[0]["fds"] > 0
        assert m["get_state"]["state_bytes"] > 0
        assert m["weights"]["sampler_pickled_bytes"] > 0
        assert set(m["splits"]["split_pickled_bytes"]) == {"train", "val"}
    assert points["f3-none"]["vs_one_file"]["vs_point"] == "3k-none"


def test_a_failing_measure_is_recorded(tmp_path):
    out = tmp_path / "scale.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "scale.py"),
            "--smoke",
            "--files=",
            "--measures=construct,get_state",
            "--max_rss_gb=0.01",
            f"--json={out}",
        ],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (point,) = json.loads(out.read_text())["points"]
    # Each killed, and the run went on: the one after it in a process of its own.
    for measure in ("construct", "get_state"):
        assert point["measures"][measure]["error"].startswith(
            "killed: process tree PSS"
        )
