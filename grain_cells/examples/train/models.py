"""The model: an MLP over log1p-normalised expression of padded-sparse cells."""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

import grain_cells


class MLP(nn.Module):
    """`num_layers` ReLU layers of `hidden_size`, then class logits."""

    hidden_size: int
    num_layers: int
    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits `[batch, num_classes]` of features `[batch, genes]`."""
        for _ in range(self.num_layers):
            x = nn.relu(nn.Dense(self.hidden_size)(x))
        return nn.Dense(self.num_classes)(x)


def features(batch: Mapping[str, jax.Array], num_genes: int) -> jax.Array:
    """log1p(x / total * 1e4) of a padded-sparse minibatch, densified (in jit).

    The total is over the input genes; an empty (padding) row stays zero.
    """
    x = grain_cells.densify(batch["values"], batch["indices"], num_genes)
    total = x.sum(axis=-1, keepdims=True)
    return jnp.log1p(x * jnp.where(total > 0, 1e4 / total, 0.0))
