r"""Peer loaders that `benchmarks/grid.py` measures beside grain_cells.

Each `open_*` function starts one loader over the same `.h5ad` files and
returns a `bench_util.Loader`: an iterator of minibatches, a function giving
the integer label codes of a minibatch's cells (for the entropy), and a
`close`. Every peer reads the files in place and returns `batch_size` cells
per minibatch (the last one of an epoch may be short).

* `scdataset`: scDataset 0.3.0, `BlockShuffling(block_size)` and
  `fetch_factor`, over backed AnnData. Its fetch callback reads the fetch's
  sorted rows as one SciPy CSR (`adata.X[rows]`: sparse as on disk, not
  densified) with their labels; its batch callback takes a minibatch's rows
  of both. torch's `DataLoader(batch_size=None)` runs it, with
  `num_workers` spawned, persistent workers.
* `annloader`: anndata's `AnnLoader` over the backed files, shuffled; as
  AnnLoader does by default, each minibatch's X becomes a dense torch tensor.
  In-process only (a backed AnnData does not pickle into workers).
* `grain_per_cell`: a plain `grain.DataLoader` with one cell per record: a
  small data source reading one CSR row per `__getitem__` through h5py (two
  reads: data and indices; indptr is loaded once), `IndexSampler(shuffle=
  True)` and `Batch(batch_size)` concatenating the rows into CSR; Grain's
  default read options (16 reader threads).

scDataset and AnnLoader need torch (`pip install -e ".[bench]"`, see
BUILD.md); `missing(name)` says what is absent instead of failing.

Run as a program, it measures one peer with `bench_util.measure_loader` and
prints the figures as one JSON line. `grid.py` runs it so, in a process of its
own: the peer's spawned workers then import this light module as their main
module rather than the grid's (JAX, Grain, grain_cells), and its RSS is its
own.

Usage:
  python benchmarks/peers.py --peer=scdataset --data=/tmp/synth400k.h5ad \
      --workers=2 --block_size=16 --fetch_factor=16
"""

from __future__ import annotations

import gc
import importlib.util
import threading
import warnings
from collections.abc import Sequence

import anndata
import bench_util
import h5py
import numpy as np
import pandas as pd
import scipy.sparse as sp

# Name -> modules it imports. Order is the order of the grid's peer table.
REQUIRES = {
    "scdataset": ("scdataset", "torch"),
    "annloader": ("torch",),
    "grain_per_cell": ("grain",),
}
# Worker counts each peer can run with (None: any).
WORKER_COUNTS = {"scdataset": None, "annloader": (0,), "grain_per_cell": None}
# What a peer's minibatches hold.
OUTPUT = {"scdataset": "csr", "annloader": "dense torch", "grain_per_cell": "csr"}
# Peers that sample single cells at random: their like-for-like grain_cells
# point is block 1, fetch factor 1.
RANDOM_SAMPLING = ("annloader", "grain_per_cell")


def missing(name: str) -> str | None:
    """Why peer `name` cannot run here, or None if it can."""
    if name not in REQUIRES:
        return f"unknown peer {name!r}; known: {', '.join(REQUIRES)}"
    absent = [m for m in REQUIRES[name] if importlib.util.find_spec(m) is None]
    if absent:
        return (
            f"{name} skipped: {', '.join(absent)} not installed "
            f'(pip install -e ".[bench]"; see BUILD.md)'
        )
    return None


def _shared_codes(paths: Sequence[str], label: str) -> np.ndarray:
    """Label codes of all files, concatenated, with one code per value."""
    per_file = []
    for path in paths:
        with h5py.File(path, "r") as f:
            values = anndata.io.read_elem(f["obs"][label])
        per_file.append(np.asarray(values, dtype=object))
    return pd.factorize(np.concatenate(per_file))[0].astype(np.int64)


def _n_obs(path: str) -> int:
    with h5py.File(path, "r") as f:
        x = f["X"]
        if isinstance(x, h5py.Group):
            return int(x.attrs["shape"][0])
        return int(x.shape[0])


class BackedRows:
    """Backed `.h5ad` files as one indexable collection, for scDataset.

    Opens the files lazily in each process (so it pickles into spawned torch
    workers). `fetch(rows)` takes sorted global row ids and returns the rows'
    CSR X and their label codes.
    """

    def __init__(self, paths: Sequence[str], label: str):
        self.paths = list(paths)
        self.label = label
        self.offsets = np.cumsum([0] + [_n_obs(p) for p in self.paths])
        self.codes = _shared_codes(self.paths, label)
        self._adatas = None

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_adatas"] = None
        return state

    def fetch(self, rows: np.ndarray) -> tuple[sp.csr_matrix, np.ndarray]:
        """The CSR rows of X and the label codes of sorted global `rows`."""
        if self._adatas is None:
            self._adatas = [anndata.read_h5ad(p, backed="r") for p in self.paths]
        rows = np.asarray(rows)
        files = np.searchsorted(self.offsets, rows, side="right") - 1
        parts = []
        for i in np.unique(files):
            local = rows[files == i] - self.offsets[i]
            parts.append(self._adatas[i].X[local])
        x = parts[0] if len(parts) == 1 else sp.vstack(parts, format="csr")
        return x, self.codes[rows]


def _fetch_rows(collection: BackedRows, rows: np.ndarray):
    return collection.fetch(rows)


def _split_rows(fetched, positions: np.ndarray) -> dict:
    x, labels = fetched
    return {"X": x[positions], "label": labels[positions]}


def open_scdataset(
    paths: Sequence[str],
    *,
    label: str,
    batch_size: int,
    block_size: int,
    fetch_factor: int,
    workers: int,
    seed: int,
) -> bench_util.Loader:
    """Starts scDataset with `BlockShuffling(block_size)` and `fetch_factor`."""
    import torch.utils.data
    from scdataset import BlockShuffling, scDataset

    dataset = scDataset(
        BackedRows(paths, label),
        BlockShuffling(block_size=block_size),
        batch_size=batch_size,
        fetch_factor=fetch_factor,
        fetch_callback=_fetch_rows,
        batch_callback=_split_rows,
        seed=seed,
    )
    kwargs = {}
    if workers:
        # Spawned, not forked: the benchmark process runs JAX and h5py threads.
        # Prefetch one fetch per worker, as scDataset's docs advise.
        kwargs = {
            "multiprocessing_context": "spawn",
            "persistent_workers": True,
            "prefetch_factor": fetch_factor + 1,
        }
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=workers, **kwargs
    )
    iterator = iter(_epochs(loader))
    return bench_util.Loader(iterator, lambda b: np.asarray(b["label"]), iterator.close)


def open_annloader(
    paths: Sequence[str],
    *,
    label: str,
    batch_size: int,
    block_size: int,
    fetch_factor: int,
    workers: int,
    seed: int,
) -> bench_util.Loader:
    """Starts anndata's AnnLoader, shuffled; `block_size` and `fetch_factor` unused."""
    del block_size, fetch_factor
    if workers:
        raise ValueError("annloader runs in-process only (workers=0)")
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # AnnLoader is deprecated in anndata 0.12
        from anndata.experimental import AnnLoader

        adatas = [anndata.read_h5ad(p, backed="r") for p in paths]
        torch.manual_seed(seed)
        loader = AnnLoader(adatas, batch_size=batch_size, shuffle=True)

    def minibatches():
        # A minibatch is a lazy view: X is read only when asked for, so ask,
        # as a training step would.
        for view in _epochs(loader, quiet=True):
            values = view.obs[label]
            if isinstance(values.dtype, pd.CategoricalDtype):
                codes = values.cat.codes.to_numpy()
            else:
                codes = pd.factorize(values.to_numpy())[0]
            yield {"X": view.X, "label": codes}

    iterator = minibatches()
    return bench_util.Loader(iterator, lambda b: b["label"], iterator.close)


def _epochs(loader, quiet: bool = False):
    """Iterates a torch loader epoch after epoch."""
    while True:
        with warnings.catch_warnings():
            if quiet:
                warnings.simplefilter("ignore")
            yield from loader


class CellRows:
    """One CSR row of X per record, read through h5py (a grain data source).

    Thread-safe: Grain's reader threads share one h5py file per process
    (h5py serialises the calls). Pickles without its open files.
    """

    def __init__(self, paths: Sequence[str], label: str):
        self.paths = list(paths)
        self.offsets = np.cumsum([0] + [_n_obs(p) for p in self.paths])
        self.codes = _shared_codes(self.paths, label)
        self._lock = threading.Lock()
        self._files = None

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __repr__(self) -> str:
        return f"CellRows({self.paths!r})"

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_files"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _open(self):
        with self._lock:
            if self._files is None:
                files = []
                for path in self.paths:
                    f = h5py.File(path, "r")
                    x = f["X"]
                    files.append((f, x["indptr"][:], x["data"], x["indices"]))
                self._files = files
        return self._files

    def __getitem__(self, row: int) -> dict:
        files = self._files or self._open()
        i = int(np.searchsorted(self.offsets, row, side="right")) - 1
        _, indptr, data, indices = files[i]
        local = row - int(self.offsets[i])
        a, b = int(indptr[local]), int(indptr[local + 1])
        return {
            "data": data[a:b],
            "indices": indices[a:b],
            "label": self.codes[row],
        }


def _stack_rows(rows: Sequence[dict]) -> dict:
    """Grain `batch_fn`: cells of variable length into one CSR minibatch."""
    lengths = [len(r["data"]) for r in rows]
    return {
        "data": np.concatenate([r["data"] for r in rows]),
        "indices": np.concatenate([r["indices"] for r in rows]),
        "indptr": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "label": np.array([r["label"] for r in rows], dtype=np.int64),
    }


def open_grain_per_cell(
    paths: Sequence[str],
    *,
    label: str,
    batch_size: int,
    block_size: int,
    fetch_factor: int,
    workers: int,
    seed: int,
) -> bench_util.Loader:
    """Starts grain.DataLoader over `CellRows` (block, fetch factor unused)."""
    del block_size, fetch_factor
    import grain

    source = CellRows(paths, label)
    loader = grain.DataLoader(
        data_source=source,
        sampler=grain.samplers.IndexSampler(
            len(source), shuffle=True, num_epochs=None, seed=seed
        ),
        operations=[grain.transforms.Batch(batch_size, batch_fn=_stack_rows)],
        worker_count=workers,
    )
    held = [iter(loader)]

    def close():
        # grain 0.2.18's iterator has no close(): its workers stop when it is
        # collected.
        held.clear()
        gc.collect()

    return bench_util.Loader(_Forward(held), lambda b: b["label"], close)


class _Forward:
    """Iterates `held[0]` without holding a reference of its own."""

    def __init__(self, held: list):
        self._held = held

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._held[0])


OPEN = {
    "scdataset": open_scdataset,
    "annloader": open_annloader,
    "grain_per_cell": open_grain_per_cell,
}


def _define_flags() -> None:
    """The command line (only when run as a program: grid.py imports this)."""
    from absl import flags

    flags.DEFINE_enum("peer", None, list(OPEN), "The peer to measure.")
    flags.DEFINE_list("data", None, "Comma-separated .h5ad files.")
    flags.DEFINE_string("label", "plate", "obs column whose entropy to report.")
    flags.DEFINE_integer("batch_size", 64, "Cells per minibatch.")
    flags.DEFINE_integer("block_size", 16, "scDataset's block size.")
    flags.DEFINE_integer("fetch_factor", 16, "scDataset's fetch factor.")
    flags.DEFINE_integer(
        "workers", 0, "Worker processes of the peer's loader (0: it reads in this one)."
    )
    flags.DEFINE_integer("seed", 0, "Seed of the loader's shuffle.")
    flags.DEFINE_integer("warmup", 100, "Minibatches before the window.")
    flags.DEFINE_integer("minibatches", 1_000, "Minibatches in the window.")
    flags.DEFINE_float("max_window_s", 10.0, "Cut warm-up and window short.")
    flags.DEFINE_float("min_window_s", 0.0, "Least length of the window.")
    flags.mark_flags_as_required(["peer", "data"])


def main(argv) -> None:
    """Measures one peer; prints its figures as one JSON line."""
    del argv
    import json

    from absl import flags

    f = flags.FLAGS
    reason = missing(f.peer)
    if reason:
        raise SystemExit(reason)
    for module in REQUIRES[f.peer]:  # imports are not part of the first batch
        importlib.import_module(module)
    result = bench_util.measure_loader(
        lambda: OPEN[f.peer](
            f.data,
            label=f.label,
            batch_size=f.batch_size,
            block_size=f.block_size,
            fetch_factor=f.fetch_factor,
            workers=f.workers,
            seed=f.seed,
        ),
        workers=f.workers,
        warmup=f.warmup,
        minibatches=f.minibatches,
        max_seconds=f.max_window_s,
        min_seconds=f.min_window_s,
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main)
