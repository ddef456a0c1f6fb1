"""`densify` (JAX): imported on first use, so Grain workers never import JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grain_cells._util import arguments


def densify(values: jax.Array, indices: jax.Array, num_genes: int) -> jax.Array:
    """Turns a padded-sparse batch into a dense `[batch, num_genes]` array.

    Works inside `jax.jit` (`num_genes` static); indices at or past
    `num_genes` are dropped.

    Args:
        values: `[batch, width]` stored values (`PaddedSparseOutput`'s).
        indices: `[batch, width]` int32 gene indices.
        num_genes: Width of the dense output.

    Returns:
        `[batch, num_genes]` array of `values.dtype`.

    Raises:
        ValueError: `num_genes` is not a positive int, or the shapes differ.

    Example:
        >>> @jax.jit
        ... def step(batch):
        ...     x = densify(batch["values"], batch["indices"], 2000)
        ...     return jnp.log1p(x).sum()
    """
    num_genes = arguments.check_int("num_genes", num_genes, minimum=1)
    if values.shape != indices.shape or values.ndim != 2:
        raise ValueError(
            "values and indices must be [batch, width] arrays of one shape, got "
            f"values.shape={tuple(values.shape)}, indices.shape="
            f"{tuple(indices.shape)}"
        )
    batch = values.shape[0]
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], indices.shape)
    dense = jnp.zeros((batch, num_genes), values.dtype)
    return dense.at[rows, indices].add(values, mode="drop")
