r"""Minibatch diversity of block sampling with batched fetching.

For each (block size, fetch factor), walks the stream of `BlockSampler` and
the fetch transform's own in-fetch shuffle (`SplitFetch.cell_order`, the code
path the loader runs, without the I/O) and reports the mean and standard
deviation over minibatches of the Shannon entropy (log2) of an obs label
inside each minibatch. Printed beside scDataset's published Table 2
(Tahoe-100M, 14 plates concatenated unshuffled, batch 64); the values depend
only on the sampling algorithm, so any plate-sorted file with 14 roughly equal
plates should reproduce them.

Usage:
  python benchmarks/diversity.py                       # synthetic 400k cells
  python benchmarks/diversity.py --data=a.h5ad --label=plate --blocks=1,4,16
"""

from __future__ import annotations

import json

import bench_util
import numpy as np
from absl import app, flags

import grain_cells

_DATA = flags.DEFINE_list(
    "data", None, "Comma-separated .h5ad files; default: a synthetic Tahoe-shaped file."
)
_N_CELLS = flags.DEFINE_integer("n_cells", 400_000, "Cells of the synthetic file.")
_LABEL = flags.DEFINE_string("label", "plate", "obs column whose entropy to report.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Cells per minibatch.")
_BLOCKS = flags.DEFINE_list(
    "blocks",
    ["4", "8", "16", "32"],
    "Block sizes to measure (contiguous cells per read).",
)
_FETCHES = flags.DEFINE_list(
    "fetches",
    ["4", "8", "16", "32"],
    "Fetch factors to measure (minibatches per fetch).",
)
_MINIBATCHES = flags.DEFINE_integer(
    "minibatches", 4_000, "Minibatches per point (from epoch 0)."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of sampler and fetch shuffle.")
_COMPRESSION = flags.DEFINE_string(
    "compression", "none", "Synthetic file's X: none, gzip or lzf."
)
_CHUNKS = flags.DEFINE_string(
    "chunks", "atlas", "Compressed chunks: atlas, default or an element count."
)
_CHUNK_ALIGNED = flags.DEFINE_integer(
    "chunk_aligned",
    0,
    "N > 0: blocks follow X's chunk grid (grain_cells.chunk_aligned), N chunks "
    "per block, at most --blocks cells each.",
)
_JSON = flags.DEFINE_string("json", None, "Also write the figures here.")

# scDataset (ICML 2025) Table 2: plate entropy on Tahoe-100M, batch 64.
PAPER = {
    (4, 16): 3.59,
    (8, 8): 3.48,
    (16, 4): 3.00,
    (16, 16): 3.48,
    (32, 4): 2.47,
    (32, 32): 3.48,
}
PAPER_RANDOM = 3.63


def minibatch_entropies(
    paths,
    label: str,
    block: int,
    fetch: int,
    batch: int,
    n_minibatches: int,
    seed: int,
    chunk_aligned: int = 0,
) -> np.ndarray:
    """Entropy (log2) of `label` in each of the first minibatches of a stream."""
    source = grain_cells.AnnDataSource(paths, block_size=block, obs_columns=[label])
    if chunk_aligned:
        source = grain_cells.chunk_aligned(source, chunk_aligned)
    labels = source.obs_values(label).astype(np.int64)
    n_classes = int(labels.max()) + 1
    sampler = grain_cells.BlockSampler(len(source), seed=seed, num_epochs=None)
    split = grain_cells.fetch_operations(
        source, batch_size=batch, fetch_factor=fetch, seed=seed
    )[1].split
    per_fetch = split.config.blocks_per_fetch
    out = []
    position = 0
    while sum(len(e) for e in out) < n_minibatches:
        keys = [sampler[p].record_key for p in range(position, position + per_fetch)]
        position += per_fetch
        files, starts, stops = source.block_ranges(keys)
        blocks = np.stack([np.asarray(keys), files, starts, stops], axis=1)
        row_ids = np.unique(
            np.concatenate(
                [np.arange(a, b) for a, b in zip(starts, stops, strict=True)]
            )
        )
        order = split.cell_order(blocks, row_ids)
        n = order.size - order.size % batch
        cells = labels[row_ids[order[:n]]].reshape(-1, batch)
        rows = np.repeat(np.arange(cells.shape[0]), batch)
        counts = np.bincount(
            rows * n_classes + cells.reshape(-1), minlength=cells.shape[0] * n_classes
        )
        p = counts.reshape(-1, n_classes) / batch
        with np.errstate(divide="ignore", invalid="ignore"):
            out.append(-np.nansum(np.where(p > 0, p * np.log2(p), 0.0), axis=1))
    return np.concatenate(out)[:n_minibatches]


def main(argv):
    del argv
    paths = bench_util.resolve_data(
        _DATA.value, _N_CELLS.value, 62_710, _COMPRESSION.value, _CHUNKS.value
    )
    results = []
    args = (_LABEL.value, _BATCH.value)
    rand = minibatch_entropies(
        paths, *args[:1], 1, 1, _BATCH.value, _MINIBATCHES.value, _SEED.value
    )
    print(
        f"{_LABEL.value} entropy (log2) per minibatch of {_BATCH.value}; "
        f"random sampling (block 1, fetch 1): {rand.mean():.2f} "
        f"(paper: {PAPER_RANDOM})"
    )
    print(
        f"{'block':>5s} {'fetch':>5s} {'mean':>6s} {'std':>5s} {'paper':>6s} "
        f"{'diff':>6s}"
    )
    for b in (int(x) for x in _BLOCKS.value):
        for f in (int(x) for x in _FETCHES.value):
            e = minibatch_entropies(
                paths,
                _LABEL.value,
                b,
                f,
                _BATCH.value,
                _MINIBATCHES.value,
                _SEED.value,
                _CHUNK_ALIGNED.value,
            )
            paper = PAPER.get((b, f))
            diff = "" if paper is None else f"{e.mean() - paper:+.2f}"
            print(
                f"{b:5d} {f:5d} {e.mean():6.2f} {e.std():5.2f} "
                f"{'' if paper is None else paper:>6} {diff:>6s}",
                flush=True,
            )
            results.append(
                {
                    "block": b,
                    "fetch": f,
                    "mean": float(e.mean()),
                    "std": float(e.std()),
                    "paper": paper,
                }
            )
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(
                {
                    "data": "given (--data)" if _DATA.value else "synthetic",
                    "files": [bench_util.describe_file(p) for p in paths],
                    "label": _LABEL.value,
                    "chunk_aligned": _CHUNK_ALIGNED.value,
                    "random": float(rand.mean()),
                    "results": results,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    app.run(main)
