"""A small transformer fed by rank-value token minibatches (CPU-sized).

    python -m grain_cells.examples.train --workdir=/tmp/tx
    --config=grain_cells/examples/train/configs/transformer.py  (one line)

Everything else as `default.py`: the same synthetic data, label and loader;
the minibatches are `grain_cells.tokens.RankValueTokens` over the input genes (the
corpus medians from `grain_cells.tokens._corpus_stats` over the training cells,
cached), `token_length` tokens per cell.
"""

import ml_collections

from grain_cells.examples.train.configs import default


def get_config() -> ml_collections.ConfigDict:
    """`default.py`'s configuration with the transformer model."""
    config = default.get_config()
    config.model = "transformer"
    config.token_length = 64  # <cls>, 62 genes, <eos>
    config.hidden_size = 64  # embedding width
    config.num_heads = 4
    config.num_layers = 2
    config.num_steps = 200
    config.checkpoint_every = 100
    config.log_every = 50
    return config
