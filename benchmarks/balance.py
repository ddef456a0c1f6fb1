r"""Class balance on a batch-sorted file: block 16, block 1, a grouped copy.

In a real atlas cells are sorted by donor or batch and cell types are
interleaved within each donor, so a block of 16 cells holds several types
and class-balanced block weights cannot reach equal shares. This binary
measures, on one file and in one run:

1. `original-b{block}`: `balanced_block_weights` at `--block_size` on the
   file as it is (the shares it reaches stay near the file's own);
2. `original-b1`: the same at block 1 (exact balance, one cell per read);
3. `grouped-b{block}`: the same at `--block_size` on a copy written with
   `grain_cells.preshuffle(..., group_by=--label)` (each label's cells
   contiguous, shuffled within the label).

Each run iterates a `grain_cells.DataLoader` (0 workers, CSR output) with a
`WeightedBlockSampler` and counts the labels of the cells it emits: the
grouped run over a whole epoch (`--epoch_cells`), the others over a window
of `--window_cells` cells. Speed is cells/s (wall) and cells per
CPU-second of this process (`time.process_time`), both printed. Printed per
run: the largest gap between a label's share and its target, and at the end
the two checks of issue 24: every share of the grouped run within
`--max_gap` of its target, and its cells/s at least `--min_speedup` times
block 1's in the same run (the issue's words). Run it with `--cache=cold`
for a file larger than RAM: there block 1 waits on a disk read per cell,
which wall time shows and CPU time does not (block 1's CPU-s per cell is
only ~4x block 16's, its wall time 6-14x). With `--cache=warm` both read
from memory and the ratio is one of copy costs (~2.5-3.5x: two copies of a
cell's ~6 KB against block 1's per-cell overhead; see
benchmarks/RESULTS.md).

Default data: a synthetic Tahoe-shaped file (`grain_cells.synthetic`) of
`--n_cells` cells x `--n_genes` genes sorted by `--n_donors` plates (the
donors) with `--n_types` cell lines (the cell types, Zipf-like shares)
interleaved within each, made once and cached (`GRAIN_CELLS_CACHE`).

Usage:
  python benchmarks/balance.py                                # synthetic 150k
  python benchmarks/balance.py --data=atlas.h5ad --label=cell_type \
      --output_dir=/tmp/grouped --json=balance.json
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import tempfile
import time
import warnings

import bench_util
import numpy as np
from absl import app, flags

import grain_cells

_DATA = flags.DEFINE_string(
    "data",
    None,
    "An .h5ad file sorted by donor or batch with --label interleaved within "
    "each; default: a synthetic one (see --n_cells).",
)
_LABEL = flags.DEFINE_string(
    "label",
    None,
    "Categorical obs column to balance (the cell type); default: cell_line "
    "for the synthetic file, required with --data.",
)
_N_CELLS = flags.DEFINE_integer("n_cells", 150_000, "Cells of the synthetic file.")
_N_GENES = flags.DEFINE_integer("n_genes", 5_000, "Genes of the synthetic file.")
_MEAN_NNZ = flags.DEFINE_float(
    "mean_nnz", 800.0, "Mean stored values per cell of the synthetic file."
)
_N_DONORS = flags.DEFINE_integer(
    "n_donors", 8, "Donors (plates, in file order) of the synthetic file."
)
_N_TYPES = flags.DEFINE_integer(
    "n_types", 8, "Cell types (cell lines, interleaved) of the synthetic file."
)
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir",
    None,
    "Folder for the grouped copy (rewritten unless complete with the same "
    "arguments: preshuffle resumes); default: a temporary folder, removed.",
)
_BLOCK = flags.DEFINE_integer("block_size", 16, "Block size of the fast runs.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Cells per minibatch.")
_FETCH = flags.DEFINE_integer(
    "fetch_factor", 16, "Minibatches per fetch (blocks read together, then mixed)."
)
_EPOCH_CELLS = flags.DEFINE_integer(
    "epoch_cells",
    None,
    "Cells per epoch of the weighted sampler (the grouped run reads one "
    "whole epoch); default: the file's cell count.",
)
_WINDOW_CELLS = flags.DEFINE_integer(
    "window_cells",
    30_000,
    "Cells read in each run on the original file (block 1 is slow; its speed "
    "and shares are measured on this window).",
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of preshuffle, sampler and fetch.")
_CACHE = flags.DEFINE_enum(
    "cache",
    "warm",
    ["warm", "cold"],
    "Page-cache state of the file read before each run: warm reads it once, "
    "cold evicts it (posix_fadvise DONTNEED, this binary's files only). Cold "
    "runs measure the disk: compare their wall-clock cells/s (same run, same "
    "disk) as well as cells per CPU-second, which leaves out the wait.",
)
_MAX_GAP = flags.DEFINE_float(
    "max_gap", 0.02, "Check: largest accepted |share - target| of the grouped run."
)
_MIN_SPEEDUP = flags.DEFINE_float(
    "min_speedup",
    5.0,
    "Check: least accepted ratio of cells per CPU-second, grouped run over block 1.",
)
_JSON = flags.DEFINE_string(
    "json", None, "Also write the file, its shape, the flags and every figure here."
)


_FLAGS = (
    _DATA,
    _LABEL,
    _N_CELLS,
    _N_GENES,
    _MEAN_NNZ,
    _N_DONORS,
    _N_TYPES,
    _OUTPUT_DIR,
    _BLOCK,
    _BATCH,
    _FETCH,
    _EPOCH_CELLS,
    _WINDOW_CELLS,
    _SEED,
    _MAX_GAP,
    _MIN_SPEEDUP,
    _JSON,
)


def _stamp(path: pathlib.Path):
    """A file's inode and modification time, or None when it is absent."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns)


def file_shape(path: str, label: str) -> dict:
    """Cells, genes, stored values and the label's natural shares of a file."""
    source = grain_cells.AnnDataSource(path, obs_columns=[label])
    codes = source.obs_values(label)
    categories = source.categories[label]
    counts = np.bincount(codes[codes >= 0], minlength=len(categories))
    shape = {
        "path": str(path),
        "bytes": os.path.getsize(path),
        "cells": source.num_cells,
        "genes": source.num_genes,
        "stored_values": int(source.file_info(0).nnz or 0),
        "label": label,
        "natural_shares": {
            str(c): round(float(n / counts.sum()), 4)
            for c, n in zip(categories, counts, strict=True)
        },
    }
    source.close()
    return shape


def run(name: str, path: str, label: str, block: int, cells: int | None) -> dict:
    """Balanced sampling at `block` on `path`: shares reached, cells/CPU-s.

    Reads `cells` cells, or one whole epoch when `cells` is None.
    """
    if _CACHE.value == "cold":
        bench_util.evict_page_cache([path])
    else:
        bench_util.warm_page_cache([path])
    source = grain_cells.AnnDataSource(path, block_size=block, obs_columns=[label])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        weights = grain_cells.balanced_block_weights(source, label)
    expected = grain_cells.expected_shares(source, weights, label)
    epoch_cells = _EPOCH_CELLS.value or source.num_cells
    sampler = grain_cells.WeightedBlockSampler(
        source, weights, epoch_cells=epoch_cells, seed=_SEED.value, num_epochs=1
    )
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=grain_cells.fetch_operations(
            source, batch_size=_BATCH.value, fetch_factor=_FETCH.value, seed=_SEED.value
        ),
    )
    categories = source.categories[label]
    counts = collections.Counter()
    n = 0
    c0, t0 = time.process_time(), time.perf_counter()
    for batch in loader:
        codes = batch[f"obs/{label}"][batch["mask"]]
        hist = np.bincount(codes[codes >= 0], minlength=len(categories))
        for i in np.flatnonzero(hist):
            counts[str(categories[i])] += int(hist[i])
        n += codes.size
        if cells is not None and n >= cells:
            break
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    source.close()
    target = 1.0 / len(expected)
    shares = {k: counts.get(str(k), 0) / n for k in expected}
    point = {
        "run": name,
        "file": str(path),
        "block_size": block,
        "cells": n,
        "whole_epoch": cells is None,
        "epoch_cells": epoch_cells,
        "target_share": round(target, 4),
        "shares": {str(k): round(v, 4) for k, v in shares.items()},
        "expected_shares": {str(k): round(v, 4) for k, v in expected.items()},
        "max_gap": round(max(abs(v - target) for v in shares.values()), 4),
        "cpu_s": round(cpu, 2),
        "wall_s": round(wall, 2),
        "cells_per_cpu_s": round(n / max(cpu, 1e-9)),
        "cells_per_s": round(n / max(wall, 1e-9)),
        "cache": _CACHE.value,
        "warning": [str(w.message) for w in caught][:1],
    }
    worst = max(shares, key=lambda k: abs(shares[k] - target))
    print(
        f"{name:>16s}: {n:>8,d} cells, {point['cells_per_cpu_s']:>9,d} cells/CPU-s, "
        f"{point['cells_per_s']:>9,d} cells/s wall ({_CACHE.value}), "
        f"largest gap {point['max_gap']:.3f} ({worst}: {shares[worst]:.1%} vs "
        f"{target:.1%}){'  [weights warned]' if caught else ''}",
        flush=True,
    )
    return point


def main(argv):
    del argv
    if _DATA.value:
        if not _LABEL.value:
            raise app.UsageError("--label is required with --data")
        path, label = _DATA.value, _LABEL.value
    else:
        from grain_cells.synthetic import _tahoe as synthetic

        label = _LABEL.value or "cell_line"
        path = str(
            synthetic.cached_tahoe_like(
                _N_CELLS.value,
                n_genes=_N_GENES.value,
                mean_nnz=_MEAN_NNZ.value,
                n_plates=_N_DONORS.value,
                n_cell_lines=_N_TYPES.value,
            )
        )
    shape = file_shape(path, label)
    print(
        f"{path}: {shape['cells']:,d} cells x {shape['genes']:,d} genes, "
        f"{shape['stored_values']:,d} stored values; {label} natural shares "
        + ", ".join(f"{k} {v:.1%}" for k, v in shape["natural_shares"].items())
    )
    with tempfile.TemporaryDirectory(prefix="balance-") as tmp:
        out_dir = _OUTPUT_DIR.value or tmp
        before = _stamp(pathlib.Path(out_dir) / "part-00000.h5ad")
        c0, t0 = time.process_time(), time.perf_counter()
        (grouped,) = grain_cells.preshuffle(
            path,
            out_dir,
            group_by=label,
            seed=_SEED.value,
            keep=(),
            obs_columns=[label],
            progress=False,
        )
        written = {
            "preshuffle_cpu_s": round(time.process_time() - c0, 2),
            "preshuffle_wall_s": round(time.perf_counter() - t0, 2),
            "grouped_file": str(grouped),
            "grouped_bytes": os.path.getsize(grouped),
            # An earlier run's complete copy (same arguments) is reused, so
            # the times above then cover only the check.
            "reused": before is not None and before == _stamp(pathlib.Path(grouped)),
        }
        print(
            f"grouped copy{' (reused)' if written['reused'] else ''}: "
            f"{written['preshuffle_cpu_s']} CPU-s "
            f"({written['preshuffle_wall_s']} s wall, a loaded machine's) -> {grouped}"
        )
        block = _BLOCK.value
        results = [
            run(f"original-b{block}", path, label, block, _WINDOW_CELLS.value),
            run("original-b1", path, label, 1, _WINDOW_CELLS.value),
            run(f"grouped-b{block}", str(grouped), label, block, None),
        ]
        if not _OUTPUT_DIR.value:
            written["grouped_file"] += " (temporary, removed)"
    speedup = results[2]["cells_per_cpu_s"] / max(results[1]["cells_per_cpu_s"], 1)
    wall_speedup = results[2]["cells_per_s"] / max(results[1]["cells_per_s"], 1)
    checks = {
        "grouped_within_max_gap": results[2]["max_gap"] <= _MAX_GAP.value,
        "speedup_over_block_1": round(speedup, 1),
        "wall_speedup_over_block_1": round(wall_speedup, 1),
        "cache": _CACHE.value,
        # The figure: cells/s, block 16 grouped over block 1, same run.
        "grouped_at_least_min_speedup": wall_speedup >= _MIN_SPEEDUP.value,
        "grouped_at_least_min_speedup_cpu": speedup >= _MIN_SPEEDUP.value,
    }
    print(
        f"grouped block {block} vs block 1: {wall_speedup:.1f}x the cells/s "
        f"({speedup:.1f}x the cells per CPU-second, same run, {_CACHE.value} cache); "
        f"largest share gap {results[2]['max_gap']:.3f} over a whole epoch "
        f"(checks: gap <= {_MAX_GAP.value}: {checks['grouped_within_max_gap']}, "
        f"cells/s >= {_MIN_SPEEDUP.value}x: {checks['grouped_at_least_min_speedup']}, "
        f"per CPU-s: {checks['grouped_at_least_min_speedup_cpu']})"
    )
    if _JSON.value:
        flag_values = {
            name: flags.FLAGS[name].value for name in (f.name for f in _FLAGS)
        }
        pathlib.Path(_JSON.value).write_text(
            json.dumps(
                {
                    "file": shape,
                    "flags": flag_values,
                    "preshuffle": written,
                    "results": results,
                    "checks": checks,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    app.run(main)
