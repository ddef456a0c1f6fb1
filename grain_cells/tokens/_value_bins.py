"""`ValueBinTokens`: value binning (scGPT) as an output format.

Definitions: docs/reference/design.md#tokens-rank-value.
"""

from __future__ import annotations

import numpy as np

from grain_cells.tokens._base import TokenOutput, special_id
from grain_cells.tokens._vocabulary import GeneVocabulary


class ValueBinTokens(TokenOutput):
    """Value binning (scGPT); see the design notes.

    Build it with `ValueBinTokens.for_source(source, vocabulary)`.
    """

    _cache_name = "value_bin"
    _FINGERPRINT = (
        "n_bins",
        "selection",
        "pad_zeros",
        "pad_id",
        "cls_id",
        "pad_value",
        "mask_value",
    )

    def __init__(
        self,
        column_tokens: np.ndarray,
        *,
        length: int = 1200,
        n_bins: int = 51,
        selection: str = "top",
        pad_zeros: bool = False,
        pad_id: int = 0,
        cls_id: int = -1,
        mask_id: int = -1,
        pad_value: int = -2,
        mask_value: int = -1,
        mlm_probability: float = 0.0,
        kernels: str = "auto",
        threads: int | str = "auto",
    ):
        """Low-level constructor over the source's output columns.

        Args:
            column_tokens: Token id of each output column (-1: not in the
                vocabulary).
            length: Tokens per cell, `<cls>` included.
            n_bins: Bins `B` (bin 0 is "not expressed"; expressed values get
                1 to `B - 1`). scGPT uses 51.
            selection: `"top"` or `"random"` (see the design notes).
            pad_zeros: Fill free slots with sampled non-expressed genes.
            pad_id: Id of `<pad>`.
            cls_id: Id of `<cls>` (-1: none).
            mask_id: Unused by value masking; kept for symmetry.
            pad_value: Bin value of `<pad>` positions.
            mask_value: Bin value of masked positions.
            mlm_probability: Share of gene positions whose value is masked.
            kernels: `"numba"` (used for `selection="top"`), `"numpy"` or
                `"auto"` (numba when installed); the same arrays, bit for bit.
            threads: Threads that encode a minibatch with the compiled kernels:
                `"auto"` is one in a Grain worker, else one per core up to 4.
        """
        if n_bins < 3:
            raise ValueError(f"n_bins must be at least 3, got n_bins={n_bins}")
        if selection not in ("top", "random"):
            raise ValueError(
                f"selection must be 'top' or 'random', got selection={selection!r}"
            )
        super().__init__(
            column_tokens,
            length=length,
            pad_id=pad_id,
            cls_id=cls_id,
            eos_id=-1,
            mask_id=max(mask_id, 0) if mlm_probability > 0 else mask_id,
            mlm_probability=mlm_probability,
            kernels=kernels,
            threads=threads,
        )
        self.n_bins = int(n_bins)
        self.selection = selection
        self.pad_zeros = bool(pad_zeros)
        self.pad_value = int(pad_value)
        self.mask_value = int(mask_value)
        self.vocab_columns = np.flatnonzero(self.column_tokens >= 0)

    @classmethod
    def for_source(
        cls,
        source,
        vocabulary: GeneVocabulary,
        *,
        length: int = 1200,
        n_bins: int = 51,
        selection: str = "top",
        pad_zeros: bool = False,
        cls_token: bool = True,
        pad_value: int = -2,
        mask_value: int = -1,
        mlm_probability: float = 0.0,
        kernels: str = "auto",
        threads: int | str = "auto",
    ) -> ValueBinTokens:
        """Value-bin tokens for `source`'s genes.

        Arguments as `__init__`; `cls_token` starts each sequence with
        `<cls>`.
        """
        return ValueBinTokens(
            vocabulary.map_genes(source.var_names).tokens,
            length=length,
            n_bins=n_bins,
            selection=selection,
            pad_zeros=pad_zeros,
            pad_id=vocabulary.special("pad"),
            cls_id=special_id(vocabulary, "cls", cls_token),
            pad_value=pad_value,
            mask_value=mask_value,
            mlm_probability=mlm_probability,
            kernels=kernels,
            threads=threads,
        )
