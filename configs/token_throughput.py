"""Defaults of `benchmarks/token_throughput.py` (each key is also a flag)."""


def get_config() -> dict:
    """Issue 14's reference point: Tahoe-shaped file, block 16, fetch 16, batch 64."""
    return {
        "n_cells": 400_000,  # synthetic file when --data is not given
        "n_genes": 62_710,
        "batch_size": 64,
        "block_size": 16,
        "fetch_factor": 16,
        "outputs": "csr,rank_value,value_bin",  # csr, rank_value, value_bin
        "worker_counts": "0,2",
        "cache": "warm",  # cold, warm
        "length": 2048,  # tokens per cell, special tokens included
        "n_bins": 51,  # value-bin tokens (scGPT's default)
        "selection": "top",  # value-bin gene choice: top or random
        "kernels": "auto",  # token kernels: auto (numba if installed), numba, numpy
        "threads": "auto",  # kernel threads per minibatch: auto, N, or a list (1,auto)
        "stats_stride": 8,  # corpus statistics over 1 of every N runs of 1,024 cells
        "obs_column": "plate",
        "warmup": 50,  # minibatches before the window (includes worker start)
        "minibatches": 600,  # the measured window
        "max_seconds": 60,  # per point: warm-up and window each stop after this
        "seed": 0,
    }
