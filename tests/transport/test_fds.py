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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    import json, os, resource, sys

    import numpy as np

    import grain_cells


    def main():
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))  # workers inherit it
        paths = json.loads(sys.argv[1])
        source = grain_cells.AnnDataSource(paths, block_size=5, obs_columns=["idx"])
        loader = grain_cells.DataLoader(
            data_source=source,
            sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=None),
            operations=grain_cells.fetch_operations(
                source, batch_size=4, fetch_factor=16),
            worker_count=2,
        )
        most = 0
        with iter(loader) as iterator:
            for i in range(400):
                b = next(iterator)
                ids = b["row_ids"][b["mask"]]
                assert np.array_equal(b["obs/idx"][: ids.size], ids), i
                most = max(most, len(os.listdir("/proc/self/fd")))
        print(json.dumps(most))


    if __name__ == "__main__":
        main()
"""


@pytest.mark.slow
def test_two_workers_run_under_a_limit_of_64_descriptors(csr_paths, tmp_path):
    """Enough slots are mapped (up to 56 lent per worker, 2 workers) that one
    descriptor per mapping ran out of 64; none per mapping fits easily."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LOW_LIMIT))
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(csr_paths)],
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
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
