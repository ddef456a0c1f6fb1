"""Defaults of `python -m grain_cells.train` (override any key: --config.KEY=VALUE).

The defaults train on a synthetic Tahoe-shaped file (100,000 cells x 2,000
genes, about 300 stored values per cell, 250 MB; made once and cached) and
finish in about half a minute on 2 CPU cores.
"""


def get_config() -> dict:
    """The training configuration; every key is overridable from the command line."""
    return {
        # Data. Training files (comma-separated .h5ad); "" makes a synthetic one.
        "data": "",
        # Held-out files (comma-separated). "" holds out the last eval_fraction
        # of the blocks of `data` instead (no cell is in both splits).
        "eval_data": "",
        "eval_fraction": 0.1,
        "synthetic_cells": 100_000,
        "synthetic_genes": 2_000,
        "synthetic_mean_nnz": 300.0,
        "synthetic_seed": 0,
        "synthetic_dir": "",  # "": $GRAIN_CELLS_CACHE or ~/.cache/grain_cells
        # The obs column to predict. Categorical columns are classes; numeric
        # ones are cut into `label_bins` quantile classes. In the synthetic data
        # only n_counts (total counts) is tied to the expression: cell_line,
        # drug and plate are drawn independently of it (chance-level accuracy).
        "label": "n_counts",
        "label_bins": 4,
        "num_genes": 512,  # input genes: the top ones by mean in a sample
        "gene_sample_cells": 2_000,
        "padded_width": 0,  # stored values kept per cell; 0: fit the sample
        # Loader.
        "batch_size": 64,  # global: split evenly over the JAX processes
        "block_size": 16,
        "fetch_factor": 16,
        "worker_count": 0,  # Grain worker processes per JAX process
        # Model and optimiser.
        "hidden_size": 256,
        "num_layers": 2,
        "learning_rate": 1e-3,
        "seed": 0,  # parameters, block shuffle and in-fetch shuffle
        "num_steps": 10_000,
        # Checkpoints (orbax, in <workdir>/checkpoints) and logs.
        "checkpoint_every": 2_000,
        "max_checkpoints": 2,
        "log_every": 1_000,
        # Test hooks: per-step files in <workdir> (see grain_cells/train.py).
        "dump_row_ids": False,
        "dump_params_hash": False,
        # --measure_loader_overhead: timed steps per variant.
        "overhead_steps": 2_000,
    }
