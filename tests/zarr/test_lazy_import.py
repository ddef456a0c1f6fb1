"""Importing grain_cells does not import zarr (design.md#zarr-format)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_grain_cells_leaves_zarr_unloaded():
    code = "import sys, grain_cells; print('zarr' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr
