"""A full `/dev/shm` is a named error in the trainer, never a SIGBUS (issue 27, item 4).

With a 256 KB `/dev/shm` and 2 workers a worker used to die of SIGBUS when
it wrote into a slot the file system could not back, and the trainer read
"Worker process was terminated unexpectedly with exit code -7". Segments are
now reserved when made (`os.posix_fallocate`), so the worker raises
`SharedMemoryFullError`, which Grain re-raises in the trainer. Without root
the workers' shared memory is limited by `grain_cells.testing.
SharedMemoryLimit`; as root (where a mount namespace can be made), a script
also runs over a real 256 KiB tmpfs at `/dev/shm`.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import subprocess
import sys
import textwrap

import grain
import numpy as np
import pytest
from conftest import N_CELLS

import grain_cells
from grain_cells import errors
from grain_cells.testing import SharedMemoryLimit
from grain_cells.transport import _shm as segments
from grain_cells.transport import _shm as shm_names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _name() -> str:
    return shm_names.new_prefix() + "_test"


def test_segments_are_reserved_not_sparse():
    name, size = _name(), 3 << 20
    mm = segments.create(name, size)
    try:
        st = os.stat(shm_names.path_of(name))
        assert st.st_size == size
        assert st.st_blocks * 512 >= size  # every page allocated at creation
    finally:
        del mm
        shm_names.unlink(name)


def test_no_room_is_a_named_error_and_leaves_no_name(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    name = _name()
    with pytest.raises(errors.SharedMemoryFullError) as caught:
        segments.create(name, 5 << 20)
    e = caught.value
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC
    assert e.requested == 5 << 20 and e.size > 0 and e.free is not None
    message = str(e)
    for words in (
        "/dev/shm",
        "5 MiB",
        "--shm-size",
        "worker_count",
        "worker_buffer_size",
    ):
        assert words in message, message
    assert not os.path.exists(shm_names.path_of(name))
    again = pickle.loads(pickle.dumps(e))  # crosses from a worker intact
    assert type(again) is type(e) and str(again) == message
    assert (again.errno, again.requested, again.size) == (e.errno, e.requested, e.size)


def test_file_systems_without_fallocate_keep_sparse_segments(monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    name = _name()
    mm = segments.create(name, 1 << 16)
    try:
        mm[:4] = b"abcd"
        assert bytes(mm[:4]) == b"abcd"
    finally:
        del mm
        shm_names.unlink(name)


def _loader(source, worker_count: int, limit: int | None):
    ops = grain_cells.fetch_operations(
        source, batch_size=16, fetch_factor=4, output=grain_cells.DenseOutput()
    )
    return grain.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=1),
        operations=([SharedMemoryLimit(limit)] if limit else []) + ops,
        worker_count=worker_count,
        read_options=grain_cells.pipeline.READ_OPTIONS,
    )


@pytest.mark.slow
def test_full_shared_memory_in_workers_raises_in_the_trainer(csr_paths):
    source = grain_cells.AnnDataSource(csr_paths, block_size=4)
    with pytest.raises(errors.SharedMemoryFullError, match="--shm-size"):
        for _ in _loader(source, worker_count=2, limit=256 << 10):
            pass


@pytest.mark.slow
def test_the_limit_leaves_enough_memory_alone(csr_paths):
    """The same loader with room enough reads every cell once."""
    source = grain_cells.AnnDataSource(csr_paths, block_size=4)
    rows = [
        b["row_ids"][b["mask"]] for b in _loader(source, worker_count=2, limit=1 << 30)
    ]
    assert sorted(np.concatenate(rows).tolist()) == list(range(N_CELLS))


SCRIPT = """
import anndata, grain, numpy as np, scipy.sparse as sp
import grain_cells

def main():
    x = sp.random(4000, 300, density=0.05, format="csr", dtype=np.float32,
                  random_state=0)
    anndata.AnnData(x).write_h5ad("big.h5ad")
    source = grain_cells.AnnDataSource(["big.h5ad"], block_size=16)
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=1),
        operations=grain_cells.fetch_operations(
            source, batch_size=64, fetch_factor=4, output=grain_cells.DenseOutput()),
        worker_count=2,
    )
    for batch in loader:
        pass
    print("DONE")

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_real_256k_tmpfs_as_root(tmp_path):
    """The issue's setting: /dev/shm a 256 KiB tmpfs (own mount namespace)."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("needs root and unshare(1) to mount a small tmpfs at /dev/shm")
    mount = [unshare, "--mount", "--propagation", "private", "sh", "-c"]
    probe = subprocess.run(
        [*mount, "mount -t tmpfs -o size=256k tmpfs /dev/shm"], capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.decode()[-200:]}")
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [
            *mount,
            'mount -t tmpfs -o size=256k tmpfs /dev/shm && exec "$0" script.py',
            sys.executable,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode != 0 and "DONE" not in done.stdout
    assert "SharedMemoryFullError" in done.stderr, done.stderr[-3000:]
    assert "256 KiB in all" in done.stderr
    assert "exit code -7" not in done.stderr
