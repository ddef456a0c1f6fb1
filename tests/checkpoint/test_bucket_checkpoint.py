"""A checkpoint saved against a bucket restores in a new process.

The run reads `s3://` objects (moto on localhost) and saves its data
iterator with orbax; a separate Python process, with credentials from the
environment only and an empty metadata cache (as on another machine),
builds the same loader, restores the checkpoint and continues. Its
minibatches equal the rest of the first run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import OBS, close_iterator, take, write_files

import grain_cells

ocp = pytest.importorskip("orbax.checkpoint")
pytest.importorskip("obstore", reason="obstore is not installed")

STOP = 3


def build_loader(urls, storage_options=None) -> grain_cells.DataLoader:
    """The loader both processes build (imported by the restoring script)."""
    source = grain_cells.AnnDataSource(
        urls, block_size=5, obs_columns=OBS, storage_options=storage_options
    )
    return grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=4),
        operations=grain_cells.fetch_operations(
            source, batch_size=4, fetch_factor=5, seed=4
        ),
        worker_count=0,
    )


_RESTORE = """
import sys
import grain
import numpy as np
import orbax.checkpoint as ocp
from test_bucket_checkpoint import build_loader

ckpt, out, *urls = sys.argv[1:]
iterator = iter(build_loader(urls))  # credentials from AWS_* variables
with ocp.CheckpointManager(ckpt) as manager:
    manager.restore(
        {stop},
        args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(iterator)),
    )
batches = list(iterator)
named = {{f"{{i}}/{{k}}": v for i, b in enumerate(batches) for k, v in b.items()}}
np.savez(out, **named)
"""


@pytest.mark.slow
def test_restore_in_a_new_process(s3, tmp_path):
    import grain

    (tmp_path / "in").mkdir()
    paths = write_files(tmp_path / "in")
    urls = [s3.upload(p, f"ckpt/{i}.h5ad") for i, p in enumerate(paths)]
    iterator = iter(build_loader(urls, s3.options))
    try:
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
            before = take(iterator, STOP)
            manager.save(
                STOP,
                args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator)),
            )
            manager.wait_until_finished()
        rest = take(iterator)
    finally:
        close_iterator(iterator)
    assert len(before) == STOP and rest

    script = tmp_path / "restore.py"
    script.write_text(textwrap.dedent(_RESTORE.format(stop=STOP)))
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(here)  # conftest, s3_server
    env = {
        **os.environ,
        **s3.env(),
        "GRAIN_CELLS_CACHE": str(tmp_path / "fresh-cache"),
        "PYTHONPATH": os.pathsep.join(
            [here, tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")]
        ),
    }
    out = tmp_path / "rest.npz"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), str(out), *urls],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out) as saved:
        got = {}
        for name in saved.files:
            i, key = name.split("/", 1)
            got.setdefault(int(i), {})[key] = saved[name]
    assert len(got) == len(rest)
    for i, want in enumerate(rest):
        assert got[i].keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[i][key], want[key], err_msg=key)
