"""Shared fixtures: small `.h5ad` files whose every stored value names its cell.

Three files of 97, 130 and 61 cells (so no block size divides them) over 12
genes. The value stored at (global row i, gene j) is `i * 100 + j + 1`
(float32, exact), a row holds 0 to 8 stored values and every tenth row none.
obs has `plate` (categorical, sorted in runs of 40 cells that cross file
boundaries, so per-file categories differ), `cell_type` (categorical, random,
its categories listed in a different order in the middle file) and `idx` (int,
the global row). Expected values always come from `anndata.read_h5ad`, not
from the generator.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import types

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

# Session fixtures defined once here: imported into each test module instead,
# each module would get its own instance (one moto server per module).
from s3_server import s3, s3_auth  # noqa: F401

import grain_cells

FILE_SIZES = (97, 130, 61)
N_CELLS = sum(FILE_SIZES)
N_GENES = 12
GENES = [f"g{j}" for j in range(N_GENES)]
OBS = ("plate", "cell_type", "idx")
CELL_TYPES = ["B", "T", "NK", "Mono", "DC"]


def write_files(directory, *, dense=False, seed=0) -> list[str]:
    """Writes the files described in the module docstring; returns their paths."""
    rng = np.random.default_rng(seed)
    paths, offset = [], 0
    for f, n in enumerate(FILE_SIZES):
        rows = np.arange(offset, offset + n)
        nnz = rng.integers(0, 9, n)
        nnz[rows % 10 == 3] = 0
        i = np.repeat(np.arange(n), nnz)
        j = np.concatenate(
            [np.sort(rng.choice(N_GENES, k, replace=False)) for k in nnz]
        )
        values = ((i + offset) * 100 + j + 1).astype(np.float32)
        x = sp.csr_matrix((values, (i, j)), shape=(n, N_GENES))
        x.sort_indices()
        labels = CELL_TYPES[::-1] if f == 1 else CELL_TYPES
        obs = pd.DataFrame(
            {
                "plate": pd.Categorical([f"plate{r // 40}" for r in rows]),
                "cell_type": pd.Categorical(rng.choice(labels, n), categories=labels),
                "idx": rows.astype(np.int64),
            },
            index=[f"cell{r}" for r in rows],
        )
        adata = anndata.AnnData(
            X=x.toarray() if dense else x, obs=obs, var=pd.DataFrame(index=GENES)
        )
        path = str(directory / f"part{f}.h5ad")
        adata.write_h5ad(path)
        paths.append(path)
        offset += n
    return paths


@pytest.fixture(autouse=True)
def collect_abandoned_prefetch():
    """Collects a test's abandoned Grain iterators here, in the main thread.

    A `grain.DataLoader` iterator that raised (a worker's error, a full
    `/dev/shm`) stays alive in a reference cycle through the traceback; its
    prefetch threads keep running. If the cyclic collector later runs on one
    of those threads, Grain's `__del__` joins the current thread and prints
    "Exception ignored ... cannot join current thread", which pytest turns
    into a failure of whatever test runs then (CI's first leg, once). A
    collection right after the test, while such threads are alive, closes
    them from the main thread instead. Cheap: only when a prefetch thread
    outlives its test.
    """
    yield
    if any(t.name.startswith("grain-thread") for t in threading.enumerate()):
        gc.collect()


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """`GRAIN_CELLS_CACHE` in a session folder, subprocesses included.

    The corpus statistics that token tests compute (and any synthetic file a
    test makes without a folder) used to land in the user's
    `~/.cache/grain_cells`, one file per test file written, for good. No
    test relies on the shared cache's large synthetic files; a test that
    wants a folder of its own still sets the variable itself.
    """
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("grain_cells_cache")
        patch.setenv("GRAIN_CELLS_CACHE", str(path))
        yield path


@pytest.fixture(scope="session", autouse=True)
def jax_compilation_cache(tmp_path_factory):
    """One persistent JAX compilation cache for the session, subprocesses included.

    The training example compiles the same steps in each of the twenty-odd
    trainer runs of `test_train.py` and `test_train_transformer.py` (a run:
    5.6 CPU-seconds with its compiles, 3.4 loading them); from the second run
    on they load from this folder. Compiles of any length are kept (JAX's
    default keeps only those over a second, none of ours). The executables
    are the same, so the kill-and-resume runs stay bit for bit equal.
    """
    path = str(tmp_path_factory.mktemp("jax_cache"))
    settings = {
        "jax_compilation_cache_dir": path,
        "jax_persistent_cache_min_compile_time_secs": 0,
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in settings.items():  # child processes read these
            patch.setenv(name.upper(), str(value))
        jax = sys.modules.get("jax")  # imported already: its config read them
        if jax is not None:
            for name, value in settings.items():
                jax.config.update(name, value)
        yield path


@pytest.fixture(scope="session")
def csr_paths(tmp_path_factory) -> list[str]:
    return write_files(tmp_path_factory.mktemp("csr"))


@pytest.fixture(scope="session")
def dense_paths(tmp_path_factory) -> list[str]:
    return write_files(tmp_path_factory.mktemp("dense"), dense=True)


@functools.cache
def _read(path: str) -> tuple[np.ndarray, pd.DataFrame, pd.Index]:
    """A file as anndata reads it: dense X, obs and var names."""
    adata = anndata.read_h5ad(path)
    x = adata.X.toarray() if sp.issparse(adata.X) else np.asarray(adata.X)
    return x, adata.obs, adata.var_names


class Truth:
    """What the files of a source hold, read back with anndata."""

    def __init__(self, source: grain_cells.AnnDataSource, paths):
        self.files = [_read(str(p)) for p in paths]
        self.offsets = source.cell_offsets
        assert self.offsets[-1] == sum(x.shape[0] for x, _, _ in self.files)

    def locate(self, row_ids):
        """(file, local row) of each global row id."""
        row_ids = np.asarray(row_ids, np.int64)
        files = np.searchsorted(self.offsets, row_ids, side="right") - 1
        return files, row_ids - self.offsets[files]

    def x(self, row_ids, genes=None) -> np.ndarray:
        """Dense expression of the rows, over `genes` (names) or all genes."""
        files, local = self.locate(row_ids)
        width = N_GENES if genes is None else len(genes)
        out = np.zeros((files.size, width), np.float32)
        for f, (x, _, var_names) in enumerate(self.files):
            sel = files == f
            cols = slice(None) if genes is None else var_names.get_indexer(genes)
            out[sel] = x[local[sel]][:, cols]
        return out

    def obs(self, row_ids, column) -> np.ndarray:
        """The obs values (labels for categorical columns) of the rows."""
        files, local = self.locate(row_ids)
        out = np.empty(files.size, object)
        for f, (_, obs, _) in enumerate(self.files):
            sel = files == f
            out[sel] = obs[column].to_numpy()[local[sel]]
        return out


def build(
    paths,
    *,
    block_size=5,
    batch_size=4,
    fetch_factor=5,
    seed=0,
    shuffle=True,
    num_epochs=1,
    shard=None,
    worker_count=0,
    output=None,
    remainder="pad",
    genes=None,
):
    """A source, its sampler and a `grain_cells.DataLoader` over them."""
    source = grain_cells.AnnDataSource(
        paths, block_size=block_size, obs_columns=OBS, genes=genes
    )
    sampler = grain_cells.BlockSampler(
        len(source),
        shuffle=shuffle,
        seed=seed,
        num_epochs=num_epochs,
        shard_options=shard,
    )
    operations = grain_cells.fetch_operations(
        source,
        batch_size=batch_size,
        fetch_factor=fetch_factor,
        output=output,
        shuffle=shuffle,
        seed=seed,
        remainder=remainder,
    )
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=operations,
        worker_count=worker_count,
    )
    return source, sampler, loader


def hdf5_opens(monkeypatch) -> list[str]:
    """The paths of the whole (HDF5) opens this process makes from now on."""
    from grain_cells.io import _open_file

    opens: list[str] = []
    unchanged = _open_file.open_unchanged
    monkeypatch.setattr(
        _open_file,
        "open_unchanged",
        lambda *a, **k: opens.append(a[0].path) or unchanged(*a, **k),
    )
    return opens


def close_iterator(iterator) -> None:
    """Stops an iterator's worker processes now rather than at garbage collection."""
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


def detach(batch: dict) -> dict:
    """Plain NumPy copies (worker outputs live in shared memory)."""
    return {k: np.array(v) for k, v in batch.items()}


def take(iterator, n=None) -> list[dict]:
    """The next `n` minibatches (all when None), detached."""
    out = []
    for batch in iterator:
        out.append(detach(batch))
        if n is not None and len(out) == n:
            break
    return out


def run(loader, n=None) -> list[dict]:
    """The first `n` minibatches (all when None) of a fresh iterator."""
    iterator = iter(loader)
    try:
        return take(iterator, n)
    finally:
        close_iterator(iterator)


@pytest.fixture(scope="session")
def helpers():
    """The helpers above, for test modules (conftest is not meant to be imported)."""
    return types.SimpleNamespace(
        build=build,
        run=run,
        take=take,
        detach=detach,
        close_iterator=close_iterator,
        Truth=Truth,
        N_CELLS=N_CELLS,
        N_GENES=N_GENES,
    )


@pytest.fixture(scope="session")
def forked_runs():
    """Runs benchmark binaries as `python <binary>` does, each forked from one
    process that imported the heavy libraries once (`forked_runs.py`)."""
    from forked_runs import ForkedRuns

    runs = ForkedRuns()
    yield runs
    runs.close()


# Test files that run the benchmark binaries end to end (tiny sizes). The CI's
# second leg (Python 3.12, anndata 0.13) sets GRAIN_CELLS_BENCHMARK_SMOKE=0:
# the binaries are smoke-tested on the first leg, so that each leg's suite
# stays under 10 minutes on 2 cores. Their flag-help and plot checks run on
# both legs.
_BENCHMARK_SMOKE_FILES = (
    "tests/test_benchmarks.py",
    "tests/test_benchmark_balance.py",
    "tests/test_benchmark_scale.py",
    "tests/test_benchmark_splits_scale.py",
    "tests/test_benchmark_startup.py",
    "tests/test_benchmark_worker_memory.py",
    "tests/test_benchmark_zarr.py",
    "tests/test_gpu_host.py",
    "tests/test_trainer_cpu_benchmark.py",
    "tests/zarr/test_zarr_decode_benchmark.py",
)
_BOTH_LEGS = ("test_every_flag_is_explained", "test_entropy_scale", "test_long_titles")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("GRAIN_CELLS_BENCHMARK_SMOKE", "1") != "0":
        return
    skip = pytest.mark.skip(
        reason="benchmark binaries run on the CI's first leg "
        "(GRAIN_CELLS_BENCHMARK_SMOKE=0)"
    )
    for item in items:
        path = item.nodeid.split("::")[0]
        if path in _BENCHMARK_SMOKE_FILES and not any(
            name in item.nodeid for name in _BOTH_LEGS
        ):
            item.add_marker(skip)
