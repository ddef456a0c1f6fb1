"""The house: imports run down the layers, modules stay small, the API stays small.

The layers, cycle and private-module contracts live in `pyproject.toml`
([tool.importlinter]) and are checked with import-linter, the maintained tool,
not a script of ours.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import grain_cells

ROOT = pathlib.Path(__file__).resolve().parent.parent
# ~400 lines per module; the source class (one class with its documented
# public surface) is allowed a little more.
MAX_LINES = {"grain_cells/source/_source.py": 475}


def test_imports_run_down_the_layers_without_cycles():
    lint = pathlib.Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(lint), "--no-cache", "--no-logo"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "BROKEN" not in done.stdout and "KEPT" in done.stdout


def test_the_house_rules_are_contracts():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    kinds = {c["type"] for c in config["tool"]["importlinter"]["contracts"]}
    # Down the layers, no cycle between siblings, and packages reach each
    # other only through their `__init__` (a `_module` is its package's own).
    assert {"layers", "acyclic_siblings", "private_modules"} <= kinds


def test_modules_stay_small():
    big = {}
    for path in (ROOT / "grain_cells").rglob("*.py"):
        name = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES.get(name, 450):
            big[name] = lines
    assert not big, f"split these modules (about 400 lines at most): {big}"


def test_public_api_is_small_and_every_name_resolves():
    assert len(grain_cells.__all__) <= 25
    for name in grain_cells.__all__:
        assert getattr(grain_cells, name) is not None
    assert grain_cells.__version__
    # Errors and tokens are sub-packages a user imports by name.
    assert issubclass(grain_cells.errors.MainGuardError, RuntimeError)
    assert grain_cells.tokens.RankValueTokens


# Messages that tell a user how to fix their file may name a format's tool.
FORMAT_NAMES_IN_MESSAGES = {
    (
        "grain_cells/io/_h5ad.py",
        '"its own .h5ad once, e.g. with anndata alone: `with h5py.File(path) "',
    ),
    (
        "grain_cells/io/_h5ad.py",
        '"paths is empty: expected one or more .h5ad files or zarr stores"',
    ),
}


def test_io_names_no_format():
    # io/ holds the AnnData schema; what a format does belongs in its package.
    found = []
    for path in sorted((ROOT / "grain_cells" / "io").glob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if (
                re.search(r"h5py|zarr", line)
                and (name, line.strip()) not in FORMAT_NAMES_IN_MESSAGES
            ):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, (
        "io/ names a format; say it format-neutrally or move it:\n" + "\n".join(found)
    )
