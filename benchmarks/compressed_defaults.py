r"""Compressed .h5ad with no block or fetch given, against scDataset, in one run.

Issue 25, item 4: on a gzip file with atlas-scale chunks, the defaults of
`AnnDataSource` (no `block_size`) and `fetch_operations` (no
`fetch_factor`) should read at least 8x the cells/s of scDataset 0.3.0 at
block 16 / fetch 16, at plate entropy >= 3.4 (batch 64, CSR output with
the plate label).

Points, measured one after the other in this process, each on a cold page
cache (the file's pages dropped first) unless `--cache=warm`:

* `defaults`: `AnnDataSource(path, obs_columns=["plate"])`, a
  `BlockSampler` over it and `fetch_operations(source, batch_size=64)`:
  what a user gets without tuning (the chosen blocks and fetch factor are
  recorded);
* `loader` (not run by default): `grain_cells.loader(path, batch_size=64,
  obs_columns=["plate"])`, the one-call spelling with no block or fetch
  given, which should choose (and read) as `defaults` does (issue 35,
  item 1: it used to take block 16 / fetch 16 on compressed files);
* `loader_source`, `card`, `cell_dataset` (not run by default): the other
  spellings with no block or fetch given (issue 35, item 2: each at >= 8x
  scDataset): `grain_cells.loader(AnnDataSource(path))`, the card's plain
  `grain.DataLoader(data_source=source, sampler=BlockSampler(...),
  operations=fetch_operations(...))` and `grain_cells.cell_dataset(source)`;
  `--points=defaults,loader,loader_source,card,cell_dataset,scdataset` is
  every spelling in one run;
* `chunks1`, `chunks2`, `chunks4` (not run by default): the defaults' rule
  with 1, 2 or 4 chunks per block (`grain_cells.chunk_aligned`; block size
  1.25 x the cells of that many chunks, 64 blocks per fetch), for the
  trade-off between cells/s and fetch memory;
* `grid16`: grain_cells at block 16 / fetch 16 (what the defaults were
  before), for reference;
* `scdataset`: scDataset 0.3.0 at block 16 / fetch 16 (`peers.py`; needs
  `pip install scdataset torch`, the `bench` extra).

Each point reports cells/s over the window (real cells), cells per CPU
second (less sensitive to other processes on a shared machine), mean plate
entropy per minibatch, time to the first minibatch and peak RSS
(`bench_util.measure_loader`), and the ratios to scDataset of both speeds.
`--repeats` runs the three points that many times, interleaved.

JSON (`--json`): `{"files", "flags", "results": [{"point", "repeat",
"cells_per_s", "cells_per_cpu_s", "entropy_mean", ..., "block_size",
"fetch_factor", "blocks"}], "ratios": [...]}`.

Usage:
  python benchmarks/compressed_defaults.py               # 200k cells, ~5 min
  python benchmarks/compressed_defaults.py --n_cells=400000 --json=out.json
"""

from __future__ import annotations

import json
import math
import os
import sys

import bench_util
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

_DATA = flags.DEFINE_list("data", None, "Comma-separated .h5ad files (else synthetic).")
_N_CELLS = flags.DEFINE_integer(
    "n_cells", 200_000, "Cells of the synthetic file (plate-sorted, 14 plates)."
)
_N_GENES = flags.DEFINE_integer("n_genes", 62_710, "Genes of the synthetic file.")
_COMPRESSION = flags.DEFINE_string("compression", "gzip", "gzip or lzf.")
_CHUNKS = flags.DEFINE_string(
    "chunks",
    "131072",
    "HDF5 chunk length (values) of the synthetic file's X: the issue's "
    "atlas-scale 131,072 (~81 cells), 'atlas' (h5py's guess) or 'default'.",
)
_POINTS = flags.DEFINE_list(
    "points",
    ["defaults", "grid16", "scdataset"],
    (
        "Comma-separated points to measure, in this order: defaults (no block "
        "or fetch given), loader (grain_cells.loader(path) with no block or "
        "fetch given), loader_source / card / cell_dataset (the other "
        "spellings, no block or fetch given), chunks1/chunks2/chunks4 (the "
        "defaults' rule at 1, 2 or 4 chunks per block), grid16 (block 16 / "
        "fetch 16), scdataset (scDataset at block 16 / fetch 16; needs the "
        "bench extra)."
    ),
)
_BATCH = flags.DEFINE_integer("batch_size", 64, "Cells per minibatch.")
_LABEL = flags.DEFINE_string("obs_column", "plate", "Label whose entropy is reported.")
_CACHE = flags.DEFINE_enum("cache", "cold", ["cold", "warm"], "Page cache state.")
_WARMUP = flags.DEFINE_integer("warmup", 20, "Minibatches before the window.")
_MINIBATCHES = flags.DEFINE_integer("minibatches", 1_000, "Minibatches per window.")
_MAX_SECONDS = flags.DEFINE_float(
    "max_seconds", 30.0, "The warm-up and the window each stop after this long."
)
_REPEATS = flags.DEFINE_integer("repeats", 1, "Runs of every point, interleaved.")
_SEED = flags.DEFINE_integer("seed", 0, "Block and in-fetch shuffle seed.")
_JSON = flags.DEFINE_string("json", None, "Write the points and ratios here.")


def _open_grain_cells(paths, block_size, fetch_factor, chunks_per_block=0) -> dict:
    import grain_cells
    from grain_cells.pipeline import _config as pipeline_config
    from grain_cells.source import _chunk_grid as chunk_grid

    if chunks_per_block:  # the defaults' rule at another n, for the table
        grid = grain_cells.AnnDataSource(paths, block_size=16)
        per_chunk = grain_cells.blocks.mean_cells_per_chunk(grid)
        block_size = 16 * math.ceil(1.25 * chunks_per_block * per_chunk / 16)
        fetch_factor = chunk_grid.default_fetch_factor(_BATCH.value, block_size)
    source = grain_cells.AnnDataSource(
        paths, block_size=block_size, obs_columns=[_LABEL.value]
    )
    if chunks_per_block:
        source = grain_cells.chunk_aligned(source, chunks_per_block)
    ops = grain_cells.fetch_operations(
        source, batch_size=_BATCH.value, fetch_factor=fetch_factor, seed=_SEED.value
    )
    chosen = {
        "block_size": source.block_size,
        "fetch_factor": fetch_factor
        or pipeline_config.default_fetch_factor(source, _BATCH.value),
        "blocks": len(source),
        "mean_block_cells": round(source.num_cells / len(source), 1),
    }
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=_SEED.value, num_epochs=None),
        operations=ops,
        worker_count=0,
    )
    iterator = iter(loader)
    key = f"obs/{_LABEL.value}"
    return chosen, bench_util.Loader(
        iterator, lambda b: b[key][b["mask"]], iterator.close
    )


def _open_one_call(paths) -> dict:
    """`grain_cells.loader(paths, ...)` with no block or fetch given."""
    import grain_cells

    loader = grain_cells.loader(
        paths,
        batch_size=_BATCH.value,
        obs_columns=[_LABEL.value],
        seed=_SEED.value,
        num_epochs=None,
    )
    source = loader.dataset.source
    chosen = {
        "block_size": source.block_size,
        "fetch_factor": loader.dataset.split.config.fetch_factor,
        "blocks": len(source),
        "mean_block_cells": round(source.num_cells / len(source), 1),
    }
    iterator = iter(loader)
    key = f"obs/{_LABEL.value}"
    return chosen, bench_util.Loader(
        iterator, lambda b: b[key][b["mask"]], iterator.close
    )


def _open_spelling(paths, spelling: str) -> dict:
    """Another spelling over `AnnDataSource(paths)` with no block or fetch."""
    import grain

    import grain_cells

    source = grain_cells.AnnDataSource(paths, obs_columns=[_LABEL.value])
    seed, batch = _SEED.value, _BATCH.value
    if spelling == "loader_source":
        loader = grain_cells.loader(
            source, batch_size=batch, seed=seed, num_epochs=None
        )
        fetch_factor = loader.dataset.split.config.fetch_factor
    elif spelling == "cell_dataset":
        loader = grain_cells.cell_dataset(
            source, batch_size=batch, seed=seed, num_epochs=None
        )
        fetch_factor = loader.split.config.fetch_factor
    else:  # the card's plain grain.DataLoader
        ops = grain_cells.fetch_operations(source, batch_size=batch, seed=seed)
        loader = grain.DataLoader(
            data_source=source,
            sampler=grain_cells.BlockSampler(source, seed=seed, num_epochs=None),
            operations=ops,
            worker_count=0,
        )
        fetch_factor = ops[-1].config.fetch_factor
    chosen = {
        "block_size": source.block_size,
        "fetch_factor": fetch_factor,
        "blocks": len(source),
        "mean_block_cells": round(source.num_cells / len(source), 1),
    }
    iterator = iter(loader)
    key = f"obs/{_LABEL.value}"
    close = getattr(iterator, "close", None) or (lambda: None)
    return chosen, bench_util.Loader(iterator, lambda b: b[key][b["mask"]], close)


def _measure(point: str, paths) -> dict:
    chosen = {}

    def start():
        nonlocal chosen
        if point == "defaults":
            chosen, loader = _open_grain_cells(paths, None, None)
            return loader
        if point == "loader":
            chosen, loader = _open_one_call(paths)
            return loader
        if point in ("loader_source", "card", "cell_dataset"):
            chosen, loader = _open_spelling(paths, point)
            return loader
        if point.startswith("chunks"):
            chosen, loader = _open_grain_cells(paths, None, None, int(point[6:]))
            chosen["chunks_per_block"] = int(point[6:])
            return loader
        if point == "grid16":
            chosen, loader = _open_grain_cells(paths, 16, 16)
            return loader
        if point == "scdataset":
            import peers

            chosen = {"block_size": 16, "fetch_factor": 16}
            return peers.open_scdataset(
                paths,
                label=_LABEL.value,
                batch_size=_BATCH.value,
                block_size=16,
                fetch_factor=16,
                workers=0,
                seed=_SEED.value,
            )
        raise app.UsageError(f"unknown point {point!r}")

    if _CACHE.value == "cold":
        bench_util.evict_page_cache(paths)
    else:
        bench_util.warm_page_cache(paths)
    result = bench_util.measure_loader(
        start,
        workers=0,
        warmup=_WARMUP.value,
        minibatches=_MINIBATCHES.value,
        max_seconds=_MAX_SECONDS.value,
    )
    return {"point": point, **chosen, **result}


def _ratios(results: list[dict]) -> list[dict]:
    out = []
    for repeat in sorted({r["repeat"] for r in results}):
        by = {r["point"]: r for r in results if r["repeat"] == repeat}
        peer = by.get("scdataset")
        if peer is None:
            continue
        for point, r in by.items():
            if point == "scdataset":
                continue
            out.append(
                {
                    "repeat": repeat,
                    "point": point,
                    "x_scdataset_cells_per_s": round(
                        r["cells_per_s"] / peer["cells_per_s"], 2
                    ),
                    "x_scdataset_cells_per_cpu_s": round(
                        r["cells_per_cpu_s"] / peer["cells_per_cpu_s"], 2
                    ),
                    "entropy_mean": r["entropy_mean"],
                }
            )
    return out


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    flags.FLAGS.mark_as_parsed()
    paths = bench_util.resolve_data(
        _DATA.value, _N_CELLS.value, _N_GENES.value, _COMPRESSION.value, _CHUNKS.value
    )
    results = []
    for repeat in range(_REPEATS.value):
        for point in _POINTS.value:
            r = {"repeat": repeat, "load_avg": round(os.getloadavg()[0], 2)}
            r |= _measure(point, paths)
            results.append(r)
            print(json.dumps(r), flush=True)
    ratios = _ratios(results)
    for r in ratios:
        print(json.dumps(r), flush=True)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(
                {
                    "files": paths,
                    "flags": {
                        name: flags.FLAGS[name].value
                        for name in (
                            "n_cells",
                            "n_genes",
                            "compression",
                            "chunks",
                            "points",
                            "batch_size",
                            "cache",
                            "warmup",
                            "minibatches",
                            "max_seconds",
                            "repeats",
                            "seed",
                        )
                    },
                    "results": results,
                    "ratios": ratios,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    app.run(main)
