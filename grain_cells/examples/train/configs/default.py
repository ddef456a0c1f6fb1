"""Defaults of `python -m grain_cells.examples.train`.

Override any key on the command line with `--config.KEY=VALUE`, or pass
another file defining `get_config()` with `--config=path/to/config.py`.
The defaults train on a synthetic Tahoe-shaped file (100,000 cells x 2,000
genes, about 300 stored values per cell, 250 MB; made once and cached) and
finish in about half a minute on 2 CPU cores.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    """The training configuration; every key is overridable from the command line."""
    config = ml_collections.ConfigDict()
    # Data. Training files (comma-separated .h5ad); "" makes a synthetic one.
    config.data = ""
    # Held-out files (comma-separated). "" holds out `eval_fraction` of the
    # blocks of `data` instead (no cell is in both splits), chosen by
    # `eval_split`: "last" (the last blocks: in a plate-sorted file, an unseen
    # plate) or "random" (blocks drawn by `grain_cells.split_by_fraction`).
    config.eval_data = ""
    config.eval_fraction = 0.1
    config.eval_split = "last"
    config.synthetic_cells = 100_000
    config.synthetic_genes = 2_000
    config.synthetic_mean_nnz = 300.0
    config.synthetic_seed = 0
    config.synthetic_dir = ""  # "": $GRAIN_CELLS_CACHE or ~/.cache/grain_cells
    # The obs column to predict. Categorical columns are classes; numeric ones
    # are cut into `label_bins` quantile classes. In the synthetic data only
    # n_counts (total counts) is tied to the expression: cell_line, drug and
    # plate are drawn independently of it (chance-level accuracy).
    config.label = "n_counts"
    config.label_bins = 4
    config.num_genes = 512  # input genes: the top ones by mean in a sample
    config.gene_sample_cells = 2_000
    config.padded_width = 0  # stored values kept per cell; 0: fitted to the data
    # Loader.
    config.batch_size = 64  # global: split evenly over the JAX processes
    config.block_size = 16
    config.fetch_factor = 16
    config.worker_count = 0  # Grain worker processes per JAX process
    # Model and optimiser. model: "mlp" over padded-sparse expression, or
    # "transformer" over rank-value tokens (see configs/transformer.py).
    config.model = "mlp"
    config.token_length = 64  # transformer: tokens per cell
    config.num_heads = 4  # transformer: attention heads
    config.hidden_size = 256
    config.num_layers = 2
    config.learning_rate = 1e-3
    config.seed = 0  # parameters, block shuffle and in-fetch shuffle
    config.num_steps = 10_000
    # Checkpoints (orbax, in <workdir>/checkpoints) and logs.
    config.checkpoint_every = 2_000
    config.max_checkpoints = 2
    config.log_every = 1_000
    # Test hooks: per-step files in <workdir> (see the package docstring).
    config.dump_row_ids = False
    config.dump_params_hash = False
    # --measure_loader_overhead: timed steps per variant, after this many
    # untimed ones (compiles, workers start).
    config.overhead_steps = 2_000
    config.overhead_warmup = 30
    return config
