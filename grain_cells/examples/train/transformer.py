"""A small transformer over rank-value gene tokens (Geneformer-style input).

Each cell arrives as `gene_ids` `[batch, length]` and `attention_mask`
(`grain_cells.tokens.RankValueTokens`): `<cls>`, its genes ranked by expression
relative to the corpus, `<eos>`, padding. The model embeds the tokens (the
position in the sequence is the rank, so a learned position embedding
carries the expression order), runs `num_layers` pre-norm encoder layers
with masked self-attention, and classifies from the `<cls>` position.
CPU-sized by default (`configs/transformer.py`).
"""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp


class EncoderLayer(nn.Module):
    """Pre-norm self-attention and MLP blocks with residuals."""

    width: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """`x` `[batch, length, width]`; `mask` `[batch, 1, length, length]`."""
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.width)(h)
        return x + nn.Dense(self.width)(nn.gelu(h))


class CellTransformer(nn.Module):
    """Token embedding, `num_layers` encoder layers, logits from `<cls>`.

    Attributes:
        vocab_size: Token ids are below this.
        length: Tokens per cell.
        width: Embedding width.
        heads: Attention heads.
        num_layers: Encoder layers.
        num_classes: Output classes.
    """

    vocab_size: int
    length: int
    width: int
    heads: int
    num_layers: int
    num_classes: int

    @nn.compact
    def __call__(self, gene_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """Logits `[batch, num_classes]` of token sequences `[batch, length]`."""
        x = nn.Embed(self.vocab_size, self.width)(gene_ids)
        x = x + nn.Embed(self.length, self.width)(jnp.arange(self.length))[None]
        mask = nn.make_attention_mask(attention_mask, attention_mask)
        for _ in range(self.num_layers):
            x = EncoderLayer(self.width, self.heads)(x, mask)
        return nn.Dense(self.num_classes)(nn.LayerNorm()(x[:, 0]))


def token_inputs(batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """The model's inputs from a token minibatch."""
    return batch["gene_ids"], batch["attention_mask"]
