r"""Splits, class-balance weights and a split loader's len() at atlas scale.

Issue 33 item 4. Writes a *thin* atlas-shaped `.h5ad` (about 4 stored values
per cell over 2,000 genes, written with h5py in anndata's layout: per-cell
and per-block costs carry over from thin files, per-value costs do not)
with 4 categorical obs columns: `plate` (14, sorted), `donor`
(`--donors`, sorted in runs within the plates), `cell_type` (50,
interleaved at random within each donor, as in a real atlas) and `assay`
(3, interleaved). Then measures, each in this one process, one after the
other:

1. `open`: `AnnDataSource(path, obs_columns=[...])`.
2. `balanced_block_weights`: `balanced_block_weights(source, "cell_type")`
   and a `WeightedBlockSampler` over the weights (an interleaved label:
   about 14 (block, class) entries per block of 16); then the same over
   `plate` (`balanced (plate)`: a sorted label, pure blocks).
3. `split_by_obs`: `split_by_obs(source, "donor", {"val": every 20th
   donor}, rest="train")`.
4. `len`: `len(grain_cells.DataLoader(...))` over the train split (a
   shuffled `BlockSampler`, batch 64, fetch factor 16).

Printed per step: CPU-seconds of this process (`time.process_time`), the
growth of its peak RSS over the RSS before the step (VmHWM, reset before
each step), and bytes pickled per worker (`len(pickle.dumps(...))` of the
sampler, which holds the source, or of the view). Obs columns a step reads
are cached by the source and count in that step's growth.

Usage:
  python benchmarks/splits_scale.py --n_cells=10_000_000 --workdir=/tmp/ss
  python benchmarks/splits_scale.py --n_cells=100_000_000 --workdir=/tmp/ss \
      --json=splits_scale.json
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import pickle
import tempfile
import time
import warnings

import bench_util
import h5py
import numpy as np
from absl import app, flags

import grain_cells

_N_CELLS = flags.DEFINE_integer("n_cells", 10_000_000, "Cells in the thin file.")
_DONORS = flags.DEFINE_integer("donors", 1_000, "Donors, sorted in runs.")
_BLOCK = flags.DEFINE_integer("block_size", 16, "Cells per block.")
_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "Folder for the thin file (reused when present); default: a tmp dir.",
)
_JSON = flags.DEFINE_string("json", None, "Write the results here as JSON.")
_TOGETHER = flags.DEFINE_boolean(
    "together",
    False,
    "Right after `open`, also measure balanced weights over `plate` and the "
    "donor split in one step (`weights + split`): the trainer's growth for "
    "both, with its anonymous and file-backed (mapped obs cache) parts after.",
)
_INTERLEAVED = flags.DEFINE_boolean(
    "interleaved",
    True,
    "Also balance the interleaved cell_type column (slow at scale: up to 200 "
    "passes over about one entry per cell).",
)

N_GENES = 2_000
VALUES_PER_CELL = 4
CELL_TYPES = 50
PLATES = 14
_WRITE_CELLS = 1 << 22


def _strings(group, name: str, values) -> None:
    data = group.create_dataset(
        name, data=np.array(values, dtype=object), dtype=h5py.string_dtype()
    )
    data.attrs["encoding-type"] = "string-array"
    data.attrs["encoding-version"] = "0.2.0"


def _categorical(obs, name: str, categories: list[str], n: int, codes_of):
    group = obs.create_group(name)
    group.attrs["encoding-type"] = "categorical"
    group.attrs["encoding-version"] = "0.2.0"
    group.attrs["ordered"] = False
    _strings(group, "categories", categories)
    dtype = np.int8 if len(categories) < 128 else np.int16
    codes = group.create_dataset(
        "codes", shape=(n,), dtype=dtype, chunks=(min(n, 1 << 20),)
    )
    for a in range(0, n, _WRITE_CELLS):
        b = min(n, a + _WRITE_CELLS)
        codes[a:b] = codes_of(a, b).astype(dtype)


def write_thin_atlas(path: str, n_cells: int, donors: int, seed: int = 0) -> str:
    """Writes the thin file described in the module docstring; returns `path`."""
    rng = np.random.default_rng(seed)
    n = int(n_cells)
    with h5py.File(path, "w") as f:
        f.attrs["encoding-type"] = "anndata"
        f.attrs["encoding-version"] = "0.1.0"
        x = f.create_group("X")
        x.attrs["encoding-type"] = "csr_matrix"
        x.attrs["encoding-version"] = "0.1.0"
        x.attrs["shape"] = (n, N_GENES)
        nnz = n * VALUES_PER_CELL
        chunk = min(nnz, 1 << 18)
        data = x.create_dataset("data", (nnz,), np.float32, chunks=(chunk,))
        indices = x.create_dataset("indices", (nnz,), np.int32, chunks=(chunk,))
        indptr = x.create_dataset(
            "indptr", (n + 1,), np.int64, chunks=(min(n + 1, 1 << 18),)
        )
        for a in range(0, n, _WRITE_CELLS):
            b = min(n, a + _WRITE_CELLS)
            m = (b - a) * VALUES_PER_CELL
            lo, hi = a * VALUES_PER_CELL, b * VALUES_PER_CELL
            data[lo:hi] = np.ones(m, np.float32)
            genes = np.sort(
                rng.integers(0, N_GENES, (b - a, VALUES_PER_CELL), dtype=np.int32), 1
            )
            indices[lo:hi] = genes.reshape(-1)
            indptr[a : b + 1] = np.arange(a, b + 1, dtype=np.int64) * VALUES_PER_CELL
        obs = f.create_group("obs")
        obs.attrs["encoding-type"] = "dataframe"
        obs.attrs["encoding-version"] = "0.2.0"
        obs.attrs["_index"] = "_index"
        columns = ["plate", "donor", "cell_type", "assay"]
        obs.attrs["column-order"] = np.array(columns, dtype=object)
        index = obs.create_dataset(
            "_index", shape=(n,), dtype=h5py.string_dtype(), chunks=(min(n, 1 << 16),)
        )
        index.attrs["encoding-type"] = "string-array"
        index.attrs["encoding-version"] = "0.2.0"
        _categorical(
            obs,
            "plate",
            [f"plate_{i:02d}" for i in range(PLATES)],
            n,
            lambda a, b: np.arange(a, b) * PLATES // n,
        )
        # Donors of unequal sizes: runs that end anywhere, not on blocks.
        cuts = np.unique(rng.integers(1, n, max(0, donors - 1)))
        _categorical(
            obs,
            "donor",
            [f"D{i:05d}" for i in range(cuts.size + 1)],
            n,
            lambda a, b: np.searchsorted(cuts, np.arange(a, b), "right"),
        )
        _categorical(
            obs,
            "cell_type",
            [f"type_{i:02d}" for i in range(CELL_TYPES)],
            n,
            lambda a, b: rng.integers(0, CELL_TYPES, b - a),
        )
        _categorical(
            obs,
            "assay",
            ["10x 3'", "10x 5'", "Smart-seq"],
            n,
            lambda a, b: rng.integers(0, 3, b - a),
        )
        var = f.create_group("var")
        var.attrs["encoding-type"] = "dataframe"
        var.attrs["encoding-version"] = "0.2.0"
        var.attrs["_index"] = "_index"
        var.attrs.create("column-order", [], dtype=h5py.string_dtype())
        _strings(var, "_index", [f"G{i:05d}" for i in range(N_GENES)])
        for name in ("obsm", "varm", "obsp", "varp", "layers", "uns"):
            group = f.create_group(name)
            group.attrs["encoding-type"] = "dict"
            group.attrs["encoding-version"] = "0.1.0"
    return path


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rss_parts_mb() -> tuple[float, float]:
    """(RssAnon, RssFile) of this process in MiB."""
    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                parts[line.split(":")[0]] = int(line.split()[1]) / 1024
    return parts.get("RssAnon", float("nan")), parts.get("RssFile", float("nan"))


def measure(fn):
    """(result, CPU-s, peak RSS growth in MiB) of `fn()`."""
    gc.collect()
    bench_util.reset_peak_rss()
    before = _rss_mb()
    t0 = time.process_time()
    out = fn()
    cpu = time.process_time() - t0
    grown = (bench_util.vm_hwm_mb() or float("nan")) - before
    return out, cpu, grown


def run(
    path: str, block_size: int = 16, interleaved: bool = True, together: bool = False
) -> dict:
    """Measures the four steps on the thin file at `path`."""
    rows = {}

    def record(name, cpu, grown, pickled=None, **extra):
        rows[name] = {
            "cpu_s": round(cpu, 3),
            "rss_growth_mib": round(grown, 1),
            "pickled_bytes": pickled,
            **extra,
        }
        text = "-" if pickled is None else f"{pickled / 2**20:.2f} MiB"
        print(
            f"{name:24s} {cpu:8.2f} CPU-s {grown:9.1f} MiB RSS growth  "
            f"pickled per worker: {text}",
            flush=True,
        )

    columns = ["plate", "donor", "cell_type", "assay"]
    source, cpu, grown = measure(
        lambda: grain_cells.AnnDataSource(
            path, block_size=block_size, obs_columns=columns
        )
    )
    record("open", cpu, grown, len(pickle.dumps(source)), blocks=len(source))

    if together:  # before any other step maps a column

        def both():
            weights = grain_cells.balanced_block_weights(source, "plate")
            sampler = grain_cells.WeightedBlockSampler(source, weights, seed=0)
            held = source.categories["donor"][::20].tolist()
            return sampler, grain_cells.split_by_obs(
                source, "donor", {"val": held}, rest="train"
            )

        anon, mapped = _rss_parts_mb()
        (sampler, splits), cpu, grown = measure(both)
        anon2, mapped2 = _rss_parts_mb()
        record(
            "weights + split",
            cpu,
            grown,
            max(len(pickle.dumps(sampler)), len(pickle.dumps(splits["train"]))),
            anon_growth_mib=round(anon2 - anon, 1),
            file_growth_mib=round(mapped2 - mapped, 1),
        )
        print(
            f"{'':24s} after: anonymous +{anon2 - anon:.1f} MiB, file-backed "
            f"+{mapped2 - mapped:.1f} MiB",
            flush=True,
        )
        del sampler, splits

    def weigh():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # interleaved: the targets are missed
            weights = grain_cells.balanced_block_weights(source, "cell_type")
        return grain_cells.WeightedBlockSampler(source, weights, seed=0)

    if interleaved:
        sampler, cpu, grown = measure(weigh)
        record("balanced_block_weights", cpu, grown, len(pickle.dumps(sampler)))
        del sampler

    def weigh_sorted():
        weights = grain_cells.balanced_block_weights(source, "plate")
        return grain_cells.WeightedBlockSampler(source, weights, seed=0)

    sampler, cpu, grown = measure(weigh_sorted)
    record("balanced (plate)", cpu, grown, len(pickle.dumps(sampler)))
    del sampler

    donors = source.categories["donor"]
    held = donors[::20].tolist()  # every 20th donor: 5%, spread over the file
    splits, cpu, grown = measure(
        lambda: grain_cells.split_by_obs(source, "donor", {"val": held}, rest="train")
    )
    train = splits["train"]
    record(
        "split_by_obs",
        cpu,
        grown,
        len(pickle.dumps(train)),
        blocks={k: len(v) for k, v in splits.items()},
    )

    def length():
        loader = grain_cells.DataLoader(
            data_source=train,
            sampler=grain_cells.BlockSampler(train, seed=0),
            operations=grain_cells.fetch_operations(
                train, batch_size=64, fetch_factor=16
            ),
        )
        return loader, len(loader)

    (loader, minibatches), cpu, grown = measure(length)
    record(
        "len(split loader)",
        cpu,
        grown,
        len(pickle.dumps(loader.dataset)),
        minibatches=minibatches,
    )
    return rows


def main(argv):
    del argv
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="splits_scale_")
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, f"thin_{_N_CELLS.value}_{_DONORS.value}.h5ad")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        write_thin_atlas(path + ".part", _N_CELLS.value, _DONORS.value)
        os.replace(path + ".part", path)
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = run(path, _BLOCK.value, _INTERLEAVED.value, _TOGETHER.value)
    if _JSON.value:
        pathlib.Path(_JSON.value).write_text(
            json.dumps(
                {
                    "n_cells": _N_CELLS.value,
                    "donors": _DONORS.value,
                    "block_size": _BLOCK.value,
                    "steps": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    app.run(main)
