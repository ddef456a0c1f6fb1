"""The card's spelling, `grain.DataLoader(..., worker_count=2)`, unguarded (issue 24).

A script without `if __name__ == "__main__":` that iterates a plain
`grain.DataLoader` over `fetch_operations` used to hang for ever once the
workers' start-up payload outgrew a pipe's buffer (a source of a few
thousand genes): each spawned child died re-running the script before it
read the payload, and the parent blocked writing it. It must now fail in the
parent, at once, with `MainGuardError`. The script runs in a fresh
interpreter under a timeout, so a hang fails the test instead of CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENES = 8_000  # var names alone outgrow a 64 KiB pipe buffer

UNGUARDED = """
import grain
import grain_cells

source = grain_cells.AnnDataSource(["a.h5ad"], block_size=8)
loader = grain.DataLoader(
    data_source=source,
    sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=1),
    operations=grain_cells.fetch_operations(source, batch_size=16),
    worker_count=2,
)
for batch in loader:
    print("ROWS", *batch["row_ids"][batch["mask"]])
"""


def _write(folder) -> None:
    rows = np.arange(64)
    x = np.zeros((rows.size, GENES), np.float32)
    x[rows, rows * 7] = rows + 1
    var = pd.DataFrame(index=[f"gene{j:05d}" for j in range(GENES)])
    anndata.AnnData(sp.csr_matrix(x), var=var).write_h5ad(folder / "a.h5ad")


def _run(folder, code: str, timeout: float):
    path = folder / "script.py"
    path.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, str(path)],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:  # the child is killed by run()
        pytest.fail(f"the unguarded script hung for {timeout} s: {e.stderr!r:.2000}")
    return done, time.monotonic() - start


@pytest.mark.slow
def test_unguarded_grain_dataloader_with_workers_raises_in_the_parent(tmp_path):
    _write(tmp_path)
    done, seconds = _run(tmp_path, UNGUARDED, timeout=90)
    assert done.returncode != 0
    assert "MainGuardError" in done.stderr, done.stderr[-3000:]
    assert "script.py (line 12)" in done.stderr  # the `for` that starts workers
    assert 'if __name__ == "__main__":' in done.stderr
    # Raised in the parent before a worker started: no child re-ran the
    # script (that would print multiprocessing's bootstrapping error).
    assert "bootstrapping phase" not in done.stderr
    assert "terminated unexpectedly with exit code" not in done.stderr
    assert "ROWS" not in done.stdout
    assert seconds < 60
    # One message, not Grain's retry of the pickle chained to the first one
    # and its note that the dataset "cannot be pickled" (issue 34).
    assert done.stderr.count("was started from the top level of") == 1, done.stderr
    assert "During handling of the above exception" not in done.stderr
    assert "cannot be pickled" not in done.stderr


@pytest.mark.slow
def test_unguarded_grain_dataloader_without_workers_runs(tmp_path):
    """worker_count=0 starts no process: an unguarded script is fine."""
    _write(tmp_path)
    code = UNGUARDED.replace("worker_count=2", "worker_count=0")
    done, _ = _run(tmp_path, code, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        int(r)
        for line in done.stdout.splitlines()
        if line.startswith("ROWS")
        for r in line.split()[1:]
    ]
    assert sorted(rows) == list(range(64))


BUILT_AT_TOP_ITERATED_UNDER_THE_GUARD = """
import grain
import grain_cells

source = grain_cells.AnnDataSource(["a.h5ad"], block_size=8)
operations = grain_cells.fetch_operations(source, batch_size=16)

def main():
    loader = grain.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=1),
        operations=operations,
        worker_count=2,
    )
    for batch in loader:
        print("ROWS", *batch["row_ids"][batch["mask"]])

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_operations_built_at_the_top_and_iterated_under_the_guard_run(tmp_path):
    """Workers re-run the unguarded top level (building the source again),
    which is wasteful but harmless: only starting workers from it is refused."""
    _write(tmp_path)
    done, _ = _run(tmp_path, BUILT_AT_TOP_ITERATED_UNDER_THE_GUARD, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        int(r)
        for line in done.stdout.splitlines()
        if line.startswith("ROWS")
        for r in line.split()[1:]
    ]
    assert sorted(rows) == list(range(64))


def _padding(lines: int) -> str:
    """`lines` lines of nested top-level functions (a long training script)."""
    out = []
    for i in range(lines // 3):
        out += [
            f"def helper{i}(x):",
            f"    return [[[(x + {i}) * k for k in range(3) if k] for _ in (1, 2)]"
            " for _ in ((1,),)]",
            "",
        ]
    return "\n".join(out) + "\n"


@pytest.mark.slow
def test_a_long_guarded_script_with_workers_runs(tmp_path):
    """Grain's worker-start threads check the guard at once: a script of
    ~2,500 lines used to crash with `SystemError: AST constructor recursion
    depth mismatch` (the guard's cache is cold in a fresh interpreter)."""
    _write(tmp_path)
    code = textwrap.dedent(BUILT_AT_TOP_ITERATED_UNDER_THE_GUARD)
    code = code.replace("def main():", _padding(2_500) + "def main():", 1)
    done, _ = _run(tmp_path, code, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SystemError" not in done.stderr
    rows = [
        int(r)
        for line in done.stdout.splitlines()
        if line.startswith("ROWS")
        for r in line.split()[1:]
    ]
    assert sorted(rows) == list(range(64))
