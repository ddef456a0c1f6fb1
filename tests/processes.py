"""Child processes of the tests: Grain's workers, and trainer scripts.

* `worker_pids()`: the live worker processes under the test process;
  `alive(pid)`, `wait_until(condition)`, and `mapped_rings()`: the workers
  whose slot rings this process maps.
* `trainer_script(tmp_path, main)`: a user's training script (with its
  `__main__` guard) that builds `two_workers(paths)`, an endless loader over
  the conftest files with two worker processes; `run_trainer` and
  `start_trainer` run it in a subprocess on those files.
* `calls_to(monkeypatch, module, name)`: the paths that this process passes
  to `module.name` from now on (the tests that count file opens).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_NOT_WORKERS = ("resource_tracker", "moto.server", "# forked_runs server")


def worker_pids() -> set[int]:
    """Live processes under this one that are neither multiprocessing's
    resource tracker, the session's moto S3 servers (`s3_server.py`), nor
    the pre-imported processes that fork benchmark runs (`forked_runs.py`)."""
    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
            if any(m in cmdline for m in _NOT_WORKERS):
                continue
            if child.status() != psutil.STATUS_ZOMBIE:
                out.add(child.pid)
        except psutil.Error:
            continue
    return out


def calls_to(monkeypatch, module, name: str) -> list[str]:
    """Wraps `module.name` for the test; returns the list of the first
    argument (a path) of each call made through it."""
    calls: list[str] = []
    real = getattr(module, name)

    def counting(path, *args, **kwargs):
        calls.append(os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(condition, timeout: float = 15.0) -> bool:
    """Whether `condition()` came true within `timeout` seconds (looked at
    every 0.1 s, after a garbage collection: abandoned iterators close)."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        gc.collect()
        time.sleep(0.1)
    return True


def mapped_rings() -> set[int]:
    """Workers whose slot-ring segments this process maps (no fd kept)."""
    with open("/proc/self/maps") as maps:
        return {
            int(line.split("/dev/shm/gcells_")[1].split("_")[0])
            for line in maps
            if "/dev/shm/gcells_" in line
        }


# What every trainer script starts with: in the trainer and (re-imported as
# `__mp_main__`) in each spawned worker.
PRELUDE = '''
import json, os, signal, sys, time

import grain
import numpy as np
import psutil

import grain_cells


def two_workers(paths, loader=grain_cells.DataLoader, fetch_factor=5):
    """An endless loader (5-cell blocks, minibatches of 4) with 2 workers."""
    source = grain_cells.AnnDataSource(paths, block_size=5, obs_columns=["idx"])
    return loader(
        data_source=source,
        # Endless: a worker always has work left.
        sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=None),
        operations=grain_cells.fetch_operations(
            source, batch_size=4, fetch_factor=fetch_factor),
        worker_count=2,
    )


def workers():
    """This trainer's live worker processes."""
    return [
        c.pid for c in psutil.Process().children()
        if "resource_tracker" not in " ".join(c.cmdline())
        and c.status() != psutil.STATUS_ZOMBIE
    ]


def rows_right(batches):
    """Whether each minibatch's obs `idx` is still its row ids."""
    return all(
        np.array_equal(b["obs/idx"][b["mask"]], b["row_ids"][b["mask"]])
        for b in batches
    )
'''


def trainer_script(tmp_path, main: str) -> str:
    """Writes `PRELUDE` and `main` (which defines `main()`) with the guard."""
    script = tmp_path / "trainer.py"
    script.write_text(
        PRELUDE + textwrap.dedent(main) + '\n\nif __name__ == "__main__":\n    main()\n'
    )
    return str(script)


def _command(script: str, paths) -> list[str]:
    return [sys.executable, script, json.dumps(list(paths))]


def _env(env) -> dict:
    return {**os.environ, "PYTHONPATH": ROOT, **(env or {})}


def run_trainer(
    script: str, paths, *, env=None, timeout: float = 240, hung: str = "hung"
) -> subprocess.CompletedProcess:
    """Runs the script on `paths` to its end; fails the test, saying `hung`
    and what it printed, if it takes more than `timeout` seconds."""
    try:
        return subprocess.run(
            _command(script, paths),
            env=_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the trainer {hung}: {e.stdout!r}")


def start_trainer(script: str, paths, *, env=None) -> subprocess.Popen:
    """Starts the script on `paths`, its stdout and stderr piped (text)."""
    return subprocess.Popen(
        _command(script, paths),
        env=_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
