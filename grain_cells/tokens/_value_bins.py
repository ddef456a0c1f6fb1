"""`ValueBinTokens`: value binning (scGPT) as an output format.

Definitions: docs/reference/design.md#tokens-rank-value.
"""

from __future__ import annotations

import numpy as np

from grain_cells._util import counter_rng
from grain_cells.outputs import Fetch
from grain_cells.tokens import _kernels, _threads
from grain_cells.tokens._base import IGNORE, ZERO_STREAM, TokenOutput, special_id
from grain_cells.tokens._vocabulary import GeneVocabulary


class ValueBinTokens(TokenOutput):
    """Value binning (scGPT); see the design notes.

    Build it with `ValueBinTokens.for_source(source, vocabulary)`.
    """

    _cache_name = "value_bin"

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

    def __repr__(self) -> str:
        return (
            f"ValueBinTokens(length={self.length}, n_bins={self.n_bins}, "
            f"selection={self.selection!r}, pad_zeros={self.pad_zeros}, "
            f"pad={self.pad_id}, cls={self.cls_id}, pad_value={self.pad_value}, "
            f"mask_value={self.mask_value}, mlm={self.mlm_probability}, "
            f"columns=sha256:{self._digest()})"
        )

    def fingerprint(self) -> dict:
        """What a checkpoint records: the parameters that decide the tokens.

        A digest of the genes' token ids; not `kernels` or `threads`.
        """
        return {
            "class": type(self).__name__,
            "length": self.length,
            "n_bins": self.n_bins,
            "selection": self.selection,
            "pad_zeros": self.pad_zeros,
            "pad_id": self.pad_id,
            "cls_id": self.cls_id,
            "pad_value": self.pad_value,
            "mask_value": self.mask_value,
            "mlm_probability": self.mlm_probability,
            "columns": f"sha256:{self._digest()}",
        }

    def pad_fill(self, name: str):
        """Value of padding rows in array `name`."""
        if name == "values":
            return self.pad_value
        return super().pad_fill(name)

    def tokenize(self, fetch: Fetch) -> dict[str, np.ndarray]:
        """Token arrays of every row of the fetch."""
        if self.selection == "top" and self._compiled():
            return self._tokenize_compiled(fetch)
        keep, dropped, chunks = self._prepare(fetch, lambda v, _: v)
        n_rows = dropped.size
        genes = np.full((n_rows, self.slots), self.pad_id, np.int32)
        bins = np.full((n_rows, self.slots), self.pad_value, np.int32)
        n_expr = np.zeros(n_rows, np.int64)
        for chunk, rows, n_kept in chunks:
            n_expr[chunk] = n_kept
            row_bins = _kernels.bins_of_sorted(
                rows, n_kept, self.n_bins, self.pad_value
            )
            width = rows.shape[1]
            w = min(width, self.slots)
            if self.selection == "random":
                row_genes = _kernels.key_tokens(rows, width)
                h = counter_rng.hash64(
                    np.uint64(fetch.key),
                    fetch.row_ids[chunk].astype(np.uint64)[:, None],
                    row_genes.astype(np.uint64),
                ) >> np.uint64(16)
                h[np.arange(width)[None, :] >= n_kept[:, None]] = ~np.uint64(0)
                order = np.argsort(h, axis=1, kind="stable")
                row_genes = np.take_along_axis(row_genes, order, axis=1)
                row_bins = np.take_along_axis(row_bins, order, axis=1)
                genes[chunk, :w] = row_genes[:, :w]
            else:
                genes[chunk, :w] = _kernels.key_tokens(rows, w)
            bins[chunk, :w] = row_bins[:, :w]
        n_genes = np.minimum(n_expr, self.slots)
        if self.pad_zeros and self.vocab_columns.size:
            n_genes = self._add_zero_genes(fetch, keep, genes, bins, n_genes, n_expr)
        ids, used, values, positions = self._assemble(genes, n_genes, bins)
        out = {
            "gene_ids": ids,
            "values": values,
            "n_expressed": n_expr.astype(np.int32),
            "n_dropped": dropped,
            "_used": used,
        }
        return self._mask_all(fetch, out, positions)

    def _per_minibatch(self) -> bool:
        """Compiled, top genes and no zero genes: encode per minibatch."""
        return self.selection == "top" and not self.pad_zeros and self._compiled()

    def _add_genes(self, fetch: Fetch, out: dict, n_genes: np.ndarray):
        """Sampled non-expressed genes after the encoded ones, with `pad_zeros`."""
        if not (self.pad_zeros and self.vocab_columns.size):
            return n_genes
        offset = 1 if self.cls_id >= 0 else 0
        data, indices, _, _ = self._csr_for_jit(fetch)
        keep = (data > 0) & (self.column_tokens[indices] >= 0)
        return self._add_zero_genes(
            fetch,
            keep,
            out["gene_ids"][:, offset : offset + self.slots],
            out["values"][:, offset : offset + self.slots],
            n_genes.astype(np.int64),
            out["n_expressed"].astype(np.int64),
        )

    def _encode(self, fetch: Fetch, rows: np.ndarray, n_out: int):
        """Compiled encoding (`_jit.value_bin_rows`)."""
        from grain_cells.tokens import _jit

        data, indices, indptr, checked = self._csr_for_jit(fetch)
        ids = np.empty((n_out, self.length), np.int32)
        values = np.empty((n_out, self.length), np.int32)
        mask = np.empty((n_out, self.length), bool)
        q = np.linspace(0, 1, self.n_bins - 1)

        def call(part, a, b):
            return _jit.value_bin_rows(
                data,
                indices,
                indptr,
                part,
                self.column_tokens,
                checked,
                q,
                ids[a:b],
                values[a:b],
                mask[a:b],
                self.cls_id,
                self.slots,
                self.pad_id,
                self.pad_value,
            )

        n_expr, dropped, n_genes = _threads.encode_rows(call, rows, n_out, self.threads)
        out = {
            "gene_ids": ids,
            "values": values,
            "n_expressed": n_expr,
            "n_dropped": dropped,
            "attention_mask": mask,
        }
        return out, n_genes

    def _apply_mask(self, out: dict, masked: np.ndarray) -> None:
        """Writes `labels` (the bins) and masks the values where `masked`."""
        values = out["values"]
        out["labels"] = np.where(masked, values, IGNORE).astype(np.int32)
        values[masked] = self.mask_value

    def _add_zero_genes(self, fetch, keep, genes, bins, n_genes, n_expr):
        """Writes sampled non-expressed genes after each row's expressed ones."""
        csr = fetch.csr
        vocab_tokens = self.column_tokens[self.vocab_columns].astype(np.int64)
        lengths = np.diff(csr.indptr)
        rows = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
        tokens = self.column_tokens[csr.indices].astype(np.int64)
        if keep is None:  # every stored value kept (`_prepare`'s fast path)
            keep = np.ones(tokens.size, bool)
        expressed = np.sort(rows[keep] * (1 << 32) + tokens[keep])
        need = np.minimum(self.slots - n_genes, vocab_tokens.size - n_expr)
        need = np.maximum(need, 0)
        zr, zt = _kernels.zero_genes(
            fetch.key, fetch.row_ids, need, vocab_tokens, expressed, ZERO_STREAM
        )
        starts = np.searchsorted(zr, np.arange(need.size))
        rank = np.arange(zr.size) - starts[zr]
        genes[zr, n_genes[zr] + rank] = zt
        bins[zr, n_genes[zr] + rank] = 0
        return n_genes + need
