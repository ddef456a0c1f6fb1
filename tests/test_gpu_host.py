"""The prepared GPU-host benchmark and the feed benchmark run end to end here.

`benchmarks/gpu_host/run.sh --quick` on CPU (tiny data, the stages that
finish in seconds; the training and loader stages are the example's
`--measure_loader_overhead` and `grid.py`, tested on their own), the feed
benchmark, and the wheel-folder recipe.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # subprocesses that import JAX

ROOT = pathlib.Path(__file__).resolve().parent.parent
GPU_HOST = ROOT / "benchmarks" / "gpu_host"


def run(command, **kw) -> str:
    env = {**os.environ, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=240, env=env, check=False, **kw
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_run_sh_quick_prints_one_table(tmp_path):
    out = run(
        [
            str(GPU_HOST / "run.sh"),
            "--quick",
            f"--out={tmp_path}",
            "--stages=feed,decode",
        ]
    )
    table = out[out.index("| measurement |") :]
    for row in ("| data |", "| feed: device_put |", "| feed: feed |", "decode ceiling"):
        assert row in table, table
    assert (tmp_path / "table.md").read_text().strip().endswith(table.strip()[-40:])
    assert (tmp_path / "results.json").is_file()


def test_run_sh_refuses_an_empty_wheel_folder(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        [str(GPU_HOST / "run.sh"), f"--wheels={tmp_path}"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 2 and "no .whl files" in done.stderr


def test_wheelhouse_lists_what_the_host_lacks(tmp_path):
    out = run([sys.executable, str(GPU_HOST / "wheelhouse.py"), f"--dest={tmp_path}"])
    download = next(line for line in out.splitlines() if "pip download" in line)
    assert "grain==" in download and "anndata==" in download
    assert " jax==" not in download and " torch==" not in download  # the host's
    assert "pip wheel --no-deps" in out


def test_feed_overhead_prints_each_variant(tmp_path):
    out = run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "feed_overhead.py"),
            "--batch_sizes=16",
            "--width=8",
            "--steps=20",
            "--rounds=1",
            f"--json={tmp_path / 'feed.json'}",
        ]
    )
    for name in ("device_put", "feed", "feed+state", "feed pinned", "loader get_state"):
        assert f"| 16 | {name} |" in out, out
