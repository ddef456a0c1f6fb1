"""benchmarks/splits_scale.py runs on a tiny thin file, so it does not rot.

Checked: exit status 0, one line per step, and its JSON: every step with
CPU-seconds, RSS growth and bytes pickled, the split's blocks and the
loader's minibatches. Figures at this size mean nothing and are not checked.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

# A subprocess that writes a 20,000-cell file and imports jax: seconds.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = (
    "open",
    "balanced_block_weights",
    "balanced (plate)",
    "split_by_obs",
    "len(split loader)",
)


def test_splits_scale(tmp_path, forked_runs):
    out = tmp_path / "splits_scale.json"
    done = forked_runs.run(
        [
            str(ROOT / "benchmarks" / "splits_scale.py"),
            "--n_cells=20000",
            "--donors=40",
            f"--workdir={tmp_path}",
            f"--json={out}",
        ],
        timeout=300,
        cwd=os.getcwd(),
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for step in STEPS:
        assert step in done.stdout, done.stdout
    result = json.loads(out.read_text())
    assert result["n_cells"] == 20_000
    steps = result["steps"]
    assert list(steps) == list(STEPS)
    for row in steps.values():
        assert row["cpu_s"] >= 0 and row["pickled_bytes"] > 0
    assert steps["open"]["blocks"] == 20_000 // 16
    blocks = steps["split_by_obs"]["blocks"]
    assert set(blocks) == {"val", "train"} and all(blocks.values())
    assert steps["len(split loader)"]["minibatches"] > 0
