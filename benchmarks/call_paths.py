r"""How often a read's calls climb back to a higher layer (issue 36, item 2).

Traces, with `sys.setprofile` (and `threading.setprofile` for the read
threads), every Python call made inside one function of grain_cells on tiny
anndata-written files, and counts the calls that cross from one grain_cells
module to another. Each grain_cells module is mapped to its layer of the
import-linter "layers" contract in `pyproject.toml` (top first); a *climb*
is a call from a module of a lower layer into a module of a higher one (a
callback, or a lower layer calling back up). A call that reaches grain_cells
through another library (h5py, zarr, numpy) counts from the nearest
grain_cells frame below it.

Paths traced, on one `.h5ad` and one `.zarr` store (CSR, 200 cells):

* `fetch`: `grain_cells.io._range_reads.fetch_ranges`, the per-fetch read,
  reached through `AnnDataSource.fetch_ranges` (two ranges). `fetch_cold` is
  the first fetch of a new source (it opens the file); `fetch` the second.
* `inspect`: `grain_cells.io._file_set.FileSet.inspect`, reached by
  `AnnDataSource(path)` (opens and checks the file, reads its metadata).

Printed per (format, path): calls between modules, modules entered
(`rooms`), layers entered, climbs (calls) and distinct climbing edges
(caller function -> callee function), which are listed.

Usage (the tree measured is the one `grain_cells` imports from)::

  PYTHONPATH=. python benchmarks/call_paths.py
  git archive 73966e7 grain_cells | tar -x -C /tmp/base
  PYTHONPATH=/tmp/base python benchmarks/call_paths.py
"""

from __future__ import annotations

import collections
import functools
import importlib
import json
import pathlib
import sys
import tempfile
import threading
import tomllib

import anndata
import numpy as np
import scipy.sparse as sp
from absl import app, flags

_JSON = flags.DEFINE_string("json", None, "Also write the counts here (JSON).")
_EDGES = flags.DEFINE_bool("edges", True, "List the distinct climbing edges.")

ROOT = pathlib.Path(__file__).resolve().parent.parent


def layers_of(pyproject: pathlib.Path) -> list[tuple[str, ...]]:
    """The layers contract's layers, top first, each a tuple of packages."""
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] == "layers":
            return [
                tuple(p.strip() for p in layer.split("|"))
                for layer in contract["layers"]
            ]
    raise ValueError(f"{pyproject}: no layers contract")


class Tracer:
    """Counts calls between grain_cells modules while `code` runs."""

    def __init__(self, code, layers):
        self.code, self.layers = code, layers
        self.active = 0
        self.crossings = 0
        self.rooms: set[str] = set()
        self.climbs = 0
        self.edges: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def layer(self, module: str) -> int | None:
        """The layer index of `module` (0 is the top), or None."""
        for i, packages in enumerate(self.layers):
            for p in packages:
                if module == p or module.startswith(p + "."):
                    return i
        return None

    def __call__(self, frame, event, arg):
        """A profile event: counts a call from one module into another."""
        if event == "call" and frame.f_code is self.code:
            self.active += 1
        elif event == "return" and frame.f_code is self.code:
            self.active -= 1
        if event != "call" or not self.active:
            return
        callee = frame.f_globals.get("__name__", "")
        if not callee.startswith("grain_cells"):
            return
        caller_frame = frame.f_back
        while caller_frame is not None:
            name = caller_frame.f_globals.get("__name__", "")
            if name.startswith("grain_cells"):
                break
            caller_frame = caller_frame.f_back
        with self._lock:
            self.rooms.add(callee)
            if caller_frame is None:
                return
            caller = caller_frame.f_globals["__name__"]
            if caller == callee:
                return
            self.crossings += 1
            up, down = self.layer(callee), self.layer(caller)
            if up is not None and down is not None and up < down:
                self.climbs += 1
                self.edges[
                    f"{caller}:{caller_frame.f_code.co_qualname} -> "
                    f"{callee}:{frame.f_code.co_qualname}"
                ] += 1

    def run(self, fn, *args):
        """Calls `fn(*args)` with this tracer counting."""
        _current[0] = self
        try:
            return fn(*args)
        finally:
            _current[0] = None

    def report(self) -> dict:
        """The counts, and the climbing edges with their call counts."""
        layers = {self.layer(m) for m in self.rooms} - {None}
        return {
            "crossings": self.crossings,
            "rooms": len(self.rooms),
            "layers": len(layers),
            "climbs": self.climbs,
            "climbing_edges": len(self.edges),
            "edges": dict(sorted(self.edges.items())),
        }


_current: list[Tracer | None] = [None]


def _profile(frame, event, arg):
    """Installed once, in every thread: hands events to the current tracer."""
    tracer = _current[0]
    if tracer is not None:
        tracer(frame, event, arg)


def write_files(folder: pathlib.Path) -> dict[str, str]:
    """One small CSR AnnData written by anndata as `.h5ad` and `.zarr`."""
    rng = np.random.default_rng(0)
    x = sp.random(
        200, 30, density=0.2, format="csr", dtype=np.float32, random_state=rng
    )
    adata = anndata.AnnData(x)
    adata.obs["cell_type"] = rng.choice(["B", "T"], 200)
    h5ad, zarr = folder / "a.h5ad", folder / "a.zarr"
    adata.write_h5ad(h5ad)
    adata.write_zarr(zarr)
    return {"h5ad": str(h5ad), "zarr": str(zarr)}


def main(argv):
    del argv
    import grain_cells

    range_reads = importlib.import_module("grain_cells.io._range_reads")
    file_set = importlib.import_module("grain_cells.io._file_set")
    layers = layers_of(ROOT / "pyproject.toml")
    threading.setprofile(_profile)  # read threads start later: they trace too
    sys.setprofile(_profile)
    results = {"tree": str(pathlib.Path(grain_cells.__file__).parent)}
    print("tree:", results["tree"])
    with tempfile.TemporaryDirectory() as tmp:
        for fmt, path in write_files(pathlib.Path(tmp)).items():
            inspect = Tracer(file_set.FileSet.inspect.__func__.__code__, layers)
            source = inspect.run(
                functools.partial(
                    grain_cells.AnnDataSource, block_size=16, obs_columns=["cell_type"]
                ),
                [path],
            )
            starts, stops = np.array([10, 100]), np.array([26, 132])
            traced = {"inspect": inspect}
            for name in ("fetch_cold", "fetch"):
                traced[name] = Tracer(range_reads.fetch_ranges.__code__, layers)
                traced[name].run(source.fetch_ranges, starts, stops)
            source.close()
            for name, tracer in traced.items():
                r = results[f"{fmt}/{name}"] = tracer.report()
                print(
                    f"{fmt:5s} {name:10s} crossings={r['crossings']:4d} "
                    f"rooms={r['rooms']:3d} layers={r['layers']:2d} "
                    f"climbs={r['climbs']:4d} climbing_edges={r['climbing_edges']:3d}"
                )
                if _EDGES.value:
                    for edge, n in r["edges"].items():
                        print(f"      {n:4d} x {edge}")
    sys.setprofile(None)
    threading.setprofile(None)
    if _JSON.value:
        pathlib.Path(_JSON.value).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    app.run(main)
