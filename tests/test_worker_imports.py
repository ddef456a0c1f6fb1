"""A worker process imports only what reading and formatting need.

Each spawned worker pays for its imports before its first fetch (with 2
workers on 2 cores, both at once). Grain itself brings JAX and orbax; the
worker must not add anndata, pandas, scipy or numba for a CSR loader. An
output that records the worker's `sys.modules` tells what it imported.
On c95fdd4 the workers imported scipy (`grain_cells.io` and `outputs` at
their top).
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

import grain_cells

# The workers import this module to unpickle `_ModulesOutput`: it imports
# nothing the assertion is about (conftest imports anndata, pandas, scipy).

# Imported by no worker of a CSR loader (numba: only by the token kernels).
NOT_IN_WORKERS = ("anndata", "pandas", "scipy", "scipy.sparse", "numba")


@dataclasses.dataclass(frozen=True)
class _ModulesOutput(grain_cells.CsrOutput):
    """CSR, plus which of `NOT_IN_WORKERS` the formatting process imported."""

    def format(self, fetch, rows, batch_size, empty=np.empty):
        out = super().format(fetch, rows, batch_size, empty)
        seen = empty((len(NOT_IN_WORKERS),), np.int64)
        seen[:] = [name in sys.modules for name in NOT_IN_WORKERS]
        return {**out, "imported": seen}


@pytest.mark.slow
def test_csr_workers_import_none_and_read_every_cell(csr_paths, helpers):
    """Two workers import none of `NOT_IN_WORKERS`, and read every cell once,
    expression and obs (read in the workers) as anndata reads them.

    One worker start for both checks: tests/pipeline/test_loader.py started
    two more workers to look for pandas' extension modules in their memory
    maps, which their `sys.modules` here covers."""
    import scipy.sparse as sp  # here: the workers import this module

    source, _, loader = helpers.build(
        csr_paths,
        worker_count=2,
        output=_ModulesOutput(),
        block_size=5,
        batch_size=4,
        fetch_factor=5,
        seed=3,
    )
    truth = helpers.Truth(source, csr_paths)
    plates = np.asarray(source.categories["plate"])
    seen, imported = [], np.zeros(len(NOT_IN_WORKERS), bool)
    iterator = iter(loader)
    try:
        for batch in iterator:
            real = np.asarray(batch["mask"])
            rows = np.asarray(batch["row_ids"])[real]
            x = sp.csr_matrix(
                (batch["data"], batch["indices"], batch["indptr"]),
                shape=(real.size, helpers.N_GENES),
            )[np.flatnonzero(real)]
            np.testing.assert_array_equal(x.toarray(), truth.x(rows))
            np.testing.assert_array_equal(batch["obs/idx"][real], rows)
            np.testing.assert_array_equal(
                plates[np.asarray(batch["obs/plate"])[real]], truth.obs(rows, "plate")
            )
            imported |= np.asarray(batch["imported"], bool)
            seen.append(rows)
    finally:
        helpers.close_iterator(iterator)
    assert not imported.any(), [
        name for name, yes in zip(NOT_IN_WORKERS, imported, strict=True) if yes
    ]
    np.testing.assert_array_equal(
        np.sort(np.concatenate(seen)), np.arange(helpers.N_CELLS)
    )


_FRESH = """
import sys
import grain_cells
from absl import flags
flags.FLAGS.mark_as_parsed()
source = grain_cells.AnnDataSource(sys.argv[1:], block_size=5, obs_columns=["plate"])
loader = grain_cells.DataLoader(
    data_source=source,
    sampler=grain_cells.BlockSampler(source, seed=0),
    operations=grain_cells.fetch_operations(source, batch_size=4, fetch_factor=5),
    worker_count=0,
)
iterator = iter(loader)
next(iterator)
iterator.close()
print("IMPORTED", *[m for m in ("anndata", "pandas") if m in sys.modules])
print("VAR", *source.var_names)
"""


@pytest.mark.slow
def test_first_minibatch_in_a_fresh_process_imports_no_anndata(csr_paths, tmp_path):
    """A var index as anndata writes it (a string-array, or under pandas 3 a
    nullable-string-array) is read with h5py: the trainer's first minibatch
    does not wait for anndata and pandas (~0.7 s of imports). Fails on
    c95fdd4."""
    import subprocess

    import anndata
    import h5py

    with h5py.File(csr_paths[0]) as f:
        var = f["var"]
        encoding = var[var.attrs["_index"]].attrs.get("encoding-type")
    assert encoding in ("string-array", "nullable-string-array")
    script = tmp_path / "first.py"
    script.write_text(_FRESH)
    done = subprocess.run(
        [sys.executable, str(script), *csr_paths],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert "IMPORTED" not in lines, lines.get("IMPORTED")
    assert lines["VAR"].split() == list(anndata.read_h5ad(csr_paths[0]).var_names)
