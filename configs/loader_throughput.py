"""Defaults of `benchmarks/loader_throughput.py` (each key is also a flag)."""


def get_config() -> dict:
    """The issue's reference point: Tahoe-shaped file, batch 64, block 16."""
    return {
        "n_cells": 400_000,  # synthetic file when --data is not given
        "n_genes": 62_710,
        # Synthetic file's X: none, gzip or lzf; compressed chunks: "atlas"
        # (anndata's for a file this size), "default" (2**16) or a length.
        "compression": "none",
        "chunks": "atlas",
        # 1: blocks follow X's chunk grid (grain_cells.chunk_aligned), at most
        # block_size cells each.
        "chunk_aligned": 0,
        "batch_size": 64,
        "block_size": 16,
        "fetch_factor": 16,
        "fetch_shuffle": 1,  # shuffle cells inside a fetch (0 for pre-shuffled files)
        "worker_counts": "0,2",
        "outputs": "csr,dense",  # csr, padded, dense
        "dense_genes": 2_000,  # gene subset for dense output (0: all genes)
        "padded_width": 4_096,
        "obs_column": "plate",
        "cache": "cold,warm",
        "warmup": 200,  # minibatches before the window (includes worker start)
        "minibatches": 3_000,  # the measured window
        "seed": 0,
    }
