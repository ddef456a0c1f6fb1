"""Defaults of `benchmarks/grid.py` (each key is also a flag of the same name).

The default run (a 4 x 4 grid x 0 and 2 workers x cold and warm page cache,
CSR; three peers; the pictures: 74 points) takes 8 minutes on the project's
2-core machine, plus about 25 s once to make the synthetic file.
scDataset's full grid is `--blocks=1,2,4,8,16,32,64 --fetches=1,2,4,8,16,32,64`.
"""


def get_config() -> dict:
    """Tahoe-shaped synthetic file, batch 64, plate label, scDataset's grid."""
    return {
        # The data: --data files, else a synthetic Tahoe-shaped file of this size.
        "n_cells": 400_000,
        "n_genes": 62_710,
        # Synthetic file's X: none, gzip or lzf; compressed chunks: "atlas"
        # (anndata's for a file this size), "default" (2**16) or a length.
        "compression": "none",
        "chunks": "atlas",
        # 1: grain_cells' blocks follow X's chunk grid (grain_cells.chunk_aligned),
        # at most `block` cells each; peers are unaffected.
        "chunk_aligned": 0,
        "obs_column": "plate",  # the label whose per-minibatch entropy is reported
        "batch_size": 64,
        # The sweep: block size x fetch factor x worker count x output x cache.
        "blocks": "1,4,16,64",
        "fetches": "1,4,16,64",
        "worker_counts": "0,2",
        "outputs": "csr",  # csr, padded, dense
        "cache": "cold,warm",  # cold (evicted first), warm (read first), or both
        "padded_width": 4_096,
        "dense_genes": 2_000,  # gene subset for dense output (0: all genes)
        "fetch_shuffle": 1,
        "seed": 0,
        # Each point: first minibatch, warm-up, then the measured window: at
        # least `minibatches` and min_window_s seconds; each phase is cut short
        # after max_window_s seconds (slow peers).
        "warmup": 100,  # minibatches (at least one fetch per worker)
        "minibatches": 1_000,
        "min_window_s": 2.0,
        "max_window_s": 10.0,
        # The reference point where peers run and ratios are taken.
        "block_size": 16,
        "fetch_factor": 16,
        "peers": "scdataset,annloader,grain_per_cell",  # "" for none
        "peer_worker_counts": "0,2",  # annloader runs with 0 only
        "output_dir": "benchmarks/out/grid",
        "plots": 1,
    }
