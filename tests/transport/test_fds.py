"""File descriptors: a slot costs none, and descriptors of 1024 and more work.

A shared-memory slot used to keep one duplicated descriptor per mapping, in
the worker and in the trainer (1,308 in a trainer with 15 workers, issue
33), and a worker waited for hand-backs in `select.select`, which raises
`ValueError: filedescriptor out of range` for any descriptor of 1024 or more.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap

import pytest
from processes import ROOT, run_trainer, trainer_script


def _run(code: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


LOW_LIMIT = """
import resource


def main():
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))  # workers inherit it
    most = 0
    with iter(two_workers(json.loads(sys.argv[1]), fetch_factor=16)) as iterator:
        for i in range(400):
            b = next(iterator)
            ids = b["row_ids"][b["mask"]]
            assert np.array_equal(b["obs/idx"][: ids.size], ids), i
            most = max(most, len(os.listdir("/proc/self/fd")))
    print(json.dumps(most))
"""


@pytest.mark.slow
def test_two_workers_run_under_a_limit_of_64_descriptors(csr_paths, tmp_path):
    """Enough slots are mapped (up to 56 lent per worker, 2 workers) that one
    descriptor per mapping ran out of 64; none per mapping fits easily."""
    done = run_trainer(trainer_script(tmp_path, LOW_LIMIT), csr_paths)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) < 64


HIGH_FDS = """
    import os, pickle, resource

    import numpy as np

    from grain_cells.transport import _ring

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    dummies = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    ring = _ring.SlotRing(max_slots=2)
    try:
        assert ring._listener.fileno() >= 1024
        for i in range(50):  # every put after the first collects hand-backs
            sent = {"v": np.arange(1000.0) + i}
            got = pickle.loads(pickle.dumps(ring.put(sent)))
            assert np.array_equal(got["v"], sent["v"]), i
        print("ok")
    finally:
        ring.close()
        _ring.release_dead_rings()
"""


@pytest.mark.slow
def test_a_ring_whose_descriptors_are_above_1024_works():
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2048:
        pytest.skip("the hard limit on open files is below 2048")
    done = _run(HIGH_FDS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
