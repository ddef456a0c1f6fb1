"""`RankValueTokens` (Geneformer) and `ValueBinTokens` (scGPT): their parameters.

Definitions: docs/reference/design.md#tokens-rank-value.
"""

from __future__ import annotations

import numpy as np

from grain_cells._util import arguments
from grain_cells.tokens._base import TokenOutput, column_token_array
from grain_cells.tokens._vocabulary import GeneVocabulary


class RankValueTokens(TokenOutput):
    """Rank-value encoding (Geneformer); see the design notes.

    Build it with `RankValueTokens.for_source(source, vocabulary, stats)`.
    """

    _FINGERPRINT = ("pad_id", "cls_id", "eos_id", "mask_id")

    def __init__(
        self,
        column_tokens: np.ndarray,
        column_medians: np.ndarray,
        *,
        length: int = 2048,
        pad_id: int = 0,
        cls_id: int = -1,
        eos_id: int = -1,
        mask_id: int = -1,
        mlm_probability: float = 0.0,
        kernels: str = "auto",
        threads: int | str = "auto",
    ):
        """Low-level constructor over the source's output columns.

        Args:
            column_tokens: Token id of each output column (-1: not in the
                vocabulary).
            column_medians: Non-zero median of each output column; columns
                with a non-finite or non-positive median are left out.
            length: Tokens per cell, special tokens included.
            pad_id: Id of `<pad>`.
            cls_id: Id of `<cls>` (-1: none).
            eos_id: Id of `<eos>` (-1: none).
            mask_id: Id of `<mask>` (-1: none).
            mlm_probability: Share of gene positions masked.
            kernels: `"numba"`, `"numpy"` or `"auto"` (numba when installed);
                the same arrays, bit for bit.
            threads: Threads that encode a minibatch with the compiled kernels:
                `"auto"` is one in a Grain worker, else one per core up to 4.
        """
        medians = np.asarray(column_medians, np.float32)
        column_tokens = column_token_array(column_tokens).copy()
        if medians.shape != column_tokens.shape:
            raise ValueError(
                f"column_medians has {medians.size} entries for "
                f"{column_tokens.size} columns"
            )
        usable = np.isfinite(medians) & (medians > 0)
        self._no_median = (column_tokens >= 0) & ~usable
        self.num_without_median = int(self._no_median.sum())
        column_tokens[~usable] = -1
        specials = (pad_id, cls_id, eos_id, mask_id)
        super().__init__(
            column_tokens, specials, length, mlm_probability, kernels, threads
        )
        self.column_medians = np.where(usable, medians, np.float32(1))

    @classmethod
    def for_source(
        cls,
        source,
        vocabulary: GeneVocabulary,
        stats,
        *,
        length: int = 2048,
        cls_token: bool = True,
        eos_token: bool = True,
        mlm_probability: float = 0.0,
        kernels: str = "auto",
        threads: int | str = "auto",
    ) -> RankValueTokens:
        """Rank-value tokens for `source`'s genes (its `var_names`).

        `vocabulary` gives the genes' and specials' ids, `stats` (a
        `grain_cells.tokens.CorpusStats`) the genes' medians by name;
        `cls_token`/`eos_token` start/end each sequence with `<cls>`/`<eos>`.
        Other arguments as `__init__`.
        """
        genes = source.var_names
        mask_id = vocabulary.special("mask") if vocabulary.has_special("mask") else -1
        return RankValueTokens(
            vocabulary.map_genes(genes).tokens,
            stats.medians_for(genes),
            length=length,
            pad_id=vocabulary.special("pad"),
            cls_id=vocabulary.special("cls") if cls_token else -1,
            eos_id=vocabulary.special("eos") if eos_token else -1,
            mask_id=mask_id,
            mlm_probability=mlm_probability,
            kernels=kernels,
            threads=threads,
        )


class ValueBinTokens(TokenOutput):
    """Value binning (scGPT); see the design notes.

    Build it with `ValueBinTokens.for_source(source, vocabulary)`.
    """

    _FINGERPRINT = ("n_bins", "selection", "pad_zeros", "pad_id", "cls_id")
    _FINGERPRINT += ("pad_value", "mask_value")

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
            mask_id: Unused by value masking.
            pad_value: Bin value of `<pad>` positions.
            mask_value: Bin value of masked positions.
            mlm_probability: Share of gene positions whose value is masked.
            kernels: As `RankValueTokens` (numba is used for `selection="top"`).
            threads: As `RankValueTokens`.
        """
        if n_bins < 3:
            raise ValueError(f"n_bins must be at least 3, got n_bins={n_bins}")
        arguments.check_choice("selection", selection, ("top", "random"))
        mask_id = max(mask_id, 0) if mlm_probability > 0 else mask_id
        specials = (pad_id, cls_id, -1, mask_id)
        super().__init__(
            column_tokens, specials, length, mlm_probability, kernels, threads
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
            cls_id=vocabulary.special("cls") if cls_token else -1,
            pad_value=pad_value,
            mask_value=mask_value,
            mlm_probability=mlm_probability,
            kernels=kernels,
            threads=threads,
        )
