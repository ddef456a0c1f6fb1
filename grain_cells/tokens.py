"""Cells as token sequences for transformer foundation models (static shapes).

Two output formats (`grain_cells.outputs` protocol) turn each fetch's CSR
rows into fixed-length token sequences. Two kernels do it, with the same
output bit for bit (`kernels=` of each output): `"numba"`
(`grain_cells.token_jit`, the default when numba is installed: one compiled
pass per cell that encodes each minibatch's cells straight into its
arrays) and `"numpy"` (`grain_cells.token_kernels`, vectorised over the
whole fetch: 2-D sorts of per-cell keys, 128 cells of similar length at a
time, no loop over cells; also the path of `selection="random"` and
`pad_zeros=True`, where the compiled one encodes the top genes only):

**`RankValueTokens`** (Geneformer, Theodoris et al. 2023). Each expressed
gene's score is its value divided by the gene's non-zero median over the
training corpus (`grain_cells.corpus_stats`); the cell's genes are ranked by
score, highest first, and the top ones kept. Definitions:

* *expressed*: stored value > 0, gene in the vocabulary with a finite,
  positive median (other stored values are dropped; those of genes outside
  the vocabulary are counted in `n_dropped`);
* *score*: `float32(value) / float32(median)`, computed in float32 (the
  cell's normalisation to a total does not change a ranking within a cell,
  so it is left out);
* *ties*: equal scores rank by token id, lower first;
* *sequence* of `length` tokens: `<cls>` (if `cls_token=True`), the top
  `length - specials` genes' token ids, `<eos>` (if `eos_token=True`) right
  after the last gene, then `<pad>`. Geneformer V2 uses
  `length=4096`, V1 2048 without specials.

Keys: `gene_ids` int32 `[batch, length]`, `attention_mask` bool (True on
`<cls>`, genes and `<eos>`), `n_expressed` int32 `[batch]` (expressed genes,
before truncation), `n_dropped` int32 `[batch]` (stored positive values of
genes outside the vocabulary).

**`ValueBinTokens`** (scGPT, Cui et al. 2024; in `grain_cells.value_bins`).
Per cell, the expressed values are binned by their own quantiles: edges
`np.quantile(expressed, np.linspace(0, 1, n_bins - 1))` (linear
interpolation, computed exactly as
NumPy does), bin `np.digitize(value, edges)` (so 1 to `n_bins - 1`; scGPT's
`_digitize(side="one")`: its "both" variant breaks ties at edges with an
unseeded random draw). Then `length` genes (after an optional `<cls>` whose
value is 0) are chosen:

* `selection="top"`: highest value first, ties by token id;
* `selection="random"`: a uniform sample without replacement, in the order
  of the key `hash64(fetch key, row id, token id) >> 16` (ties by value,
  then token id): see `grain_cells.counter_rng`;
* `pad_zeros=True`: a cell with fewer expressed genes than slots gets
  non-expressed vocabulary genes (bin 0) after its expressed ones: the first
  distinct non-expressed genes of the stream `vocab_genes[hash64(fetch key,
  row id, 2**40 + j) % n_vocab_genes]`, j = 0, 1, ... (rejection sampling
  without replacement);
* remaining slots: `<pad>` with value `pad_value` (scGPT: -2).

Keys: `gene_ids`, `values` (bins, int32), `attention_mask`, `n_expressed`,
`n_dropped`.

**Masked-language training.** With `mlm_probability > 0`, each gene position
(not specials, not padding) is masked when
`uniform(fetch key, row id, token id, 7) < mlm_probability`: its `gene_ids`
entry (rank-value) or `values` entry (value-bin, set to `mask_value`)
replaced, and `labels` holds the original there and -100 elsewhere.

Random choices depend on the fetch key (`grain_cells.fetch.fetch_key`: the
seed and the fetch's blocks) and the cell's row id only, so a restored
iterator repeats them exactly and a cell met again in another epoch gets new
ones.

Example:
    >>> vocab = grain_cells.GeneVocabulary.from_genes(source.var_names)
    >>> stats = grain_cells.corpus_stats(source)
    >>> output = grain_cells.RankValueTokens.for_source(
    ...     source, vocab, stats, length=2048)
    >>> ops = grain_cells.fetch_operations(source, batch_size=64, output=output)
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util

import numpy as np

from grain_cells import counter_rng
from grain_cells import token_kernels as kernels
from grain_cells.outputs import Fetch
from grain_cells.vocabulary import GeneVocabulary

IGNORE = -100  # `labels` where nothing is masked
ZERO_STREAM = 1 << 40  # counter offset of the zero-gene stream
_MLM_WORD = 7


@functools.cache
def numba_available() -> bool:
    """True when numba is installed (the compiled kernels can run)."""
    return importlib.util.find_spec("numba") is not None


def special_id(vocab: GeneVocabulary, role: str, wanted: bool) -> int:
    """Id of a special token, or -1 when not wanted."""
    if not wanted:
        return -1
    return vocab.special(role)


class TokenOutput:
    """What both token outputs share: the vocabulary map, specials, MLM.

    `RankValueTokens` (here) and `ValueBinTokens` (`grain_cells.value_bins`)
    subclass it and define `tokenize(fetch)`.
    """

    _cache_name = "tokens"

    def __init__(
        self,
        column_tokens: np.ndarray,
        *,
        length: int,
        pad_id: int,
        cls_id: int,
        eos_id: int,
        mask_id: int,
        mlm_probability: float,
        kernels: str = "auto",
    ):
        column_tokens = np.asarray(column_tokens, np.int32)
        if kernels not in ("auto", "numba", "numpy"):
            raise ValueError(
                f"kernels must be 'auto', 'numba' or 'numpy', got kernels={kernels!r}"
            )
        if kernels == "numba" and not numba_available():
            raise ImportError(
                "kernels='numba' needs numba: pip install 'grain_cells[tokens]'"
            )
        if length < 1:
            raise ValueError(f"length must be positive, got length={length}")
        if not 0.0 <= mlm_probability < 1.0:
            raise ValueError(
                f"mlm_probability must lie in [0, 1), got {mlm_probability}"
            )
        if mlm_probability > 0 and mask_id < 0:
            raise ValueError(
                "mlm_probability > 0 needs a mask token; the vocabulary has none"
            )
        self.column_tokens = column_tokens
        self.length = int(length)
        self.pad_id = int(pad_id)
        self.cls_id = int(cls_id)
        self.eos_id = int(eos_id)
        self.mask_id = int(mask_id)
        self.mlm_probability = float(mlm_probability)
        self.kernels = kernels
        self._all_in_vocabulary = bool((column_tokens >= 0).all())
        self.slots = self.length - (cls_id >= 0) - (eos_id >= 0)
        if self.slots < 1:
            raise ValueError(
                f"length={length} leaves no room for genes after special tokens"
            )

    def _digest(self, *arrays) -> str:
        h = hashlib.sha256(self.column_tokens.tobytes())
        for a in arrays:
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]

    def format(
        self, fetch: Fetch, rows: np.ndarray, batch_size: int
    ) -> dict[str, np.ndarray]:
        """One minibatch: the fetch's `rows` as token arrays.

        The compiled kernels encode the rows straight into the minibatch's
        arrays; the NumPy kernels encode the whole fetch once (cached in
        `fetch.cache`) and the rows are gathered from it.
        """
        if self._per_minibatch():
            rows = np.asarray(rows, np.int64)
            out, n_genes = self._encode(fetch, rows, batch_size)
            self._mask_genes(fetch, rows, out, n_genes)
            return out
        key = (self._cache_name, id(self))
        arrays = fetch.cache.get(key)
        if arrays is None:
            arrays = fetch.cache[key] = self.tokenize(fetch)
        out = {}
        for name, a in arrays.items():
            if name.startswith("_"):
                continue
            if rows.size == batch_size:
                out[name] = a[rows]
                continue
            b = np.full((batch_size, *a.shape[1:]), self.pad_fill(name), a.dtype)
            b[: rows.size] = a[rows]
            out[name] = b
        used = np.zeros(batch_size, np.int64)
        used[: rows.size] = arrays["_used"][rows]
        out["attention_mask"] = np.arange(self.length)[None, :] < used[:, None]
        return out

    def pad_fill(self, name: str):
        """Value of padding rows in array `name`."""
        return {"gene_ids": self.pad_id, "labels": IGNORE}.get(name, 0)

    def _prepare(self, fetch: Fetch, values_for_order):
        """Order words and tokens of the fetch's stored values.

        Returns:
            `(indptr, keep, inv, tokens, dropped)`: `keep` None when every
            value is kept; `dropped` the positive values per row whose gene
            is outside the vocabulary.
        """
        csr = fetch.csr
        tokens = self.column_tokens[csr.indices]
        values = csr.data.astype(np.float32, copy=False)
        n_rows = csr.indptr.size - 1
        inv = kernels.inverted(values_for_order(values, csr.indices))
        if self._all_in_vocabulary and (not values.size or values.min() > 0):
            return csr.indptr, None, inv, tokens, np.zeros(n_rows, np.int32)
        positive = values > 0
        keep = positive & (tokens >= 0)
        out_of_vocab = np.zeros(values.size + 1, np.int32)
        np.cumsum(positive & (tokens < 0), out=out_of_vocab[1:])
        dropped = out_of_vocab[csr.indptr[1:]] - out_of_vocab[csr.indptr[:-1]]
        return csr.indptr, keep, inv, tokens, dropped

    def _per_minibatch(self) -> bool:
        """True when `format` encodes each minibatch's rows itself."""
        return self._compiled()

    def _encode(self, fetch: Fetch, rows: np.ndarray, n_out: int):
        """Compiled encoding of `rows` into `n_out` output rows.

        Returns:
            `(arrays, n_genes)`: the minibatch's arrays (`attention_mask`
            included, no masking yet) and the genes placed per row.
        """
        raise NotImplementedError

    def _mask_genes(self, fetch: Fetch, rows, out: dict, n_genes) -> None:
        """Masked-language masking of `out` (compiled path), in place."""
        if self.mlm_probability <= 0:
            return
        ids = out["gene_ids"]
        row_ids = np.zeros(ids.shape[0], np.int64)
        row_ids[: rows.size] = fetch.row_ids[rows]
        masked = self._mlm(fetch.key, row_ids, ids, self._gene_positions(n_genes))
        self._apply_mask(out, masked)

    def _apply_mask(self, out: dict, masked: np.ndarray) -> None:
        """Writes `labels` and masks `out` where `masked`."""
        ids = out["gene_ids"]
        out["labels"] = np.where(masked, ids, IGNORE).astype(np.int32)
        ids[masked] = self.mask_id

    def _compiled(self) -> bool:
        """True when `tokenize` runs the numba kernels (`grain_cells.token_jit`)."""
        return self.kernels == "numba" or (self.kernels == "auto" and numba_available())

    def _csr_for_jit(self, fetch: Fetch):
        """The fetch's CSR arrays for the kernels, made once per fetch.

        Returns:
            `(data float32, indices, indptr int64, checked)`: `checked` False
            when every stored value is positive and every column has a token.
        """
        key = ("jit_csr", id(self))
        arrays = fetch.cache.get(key)
        if arrays is None:
            csr = fetch.csr
            data = np.ascontiguousarray(csr.data, np.float32)
            positive = not data.size or data.min() > 0
            arrays = fetch.cache[key] = (
                data,
                np.ascontiguousarray(csr.indices),
                np.ascontiguousarray(csr.indptr, np.int64),
                not (self._all_in_vocabulary and positive),
            )
        return arrays

    def _gene_positions(self, n_genes: np.ndarray) -> np.ndarray:
        """Each row's gene positions: bool `[n_rows, length]`."""
        offset = 1 if self.cls_id >= 0 else 0
        positions = np.zeros((n_genes.size, self.length), bool)
        positions[:, offset : offset + self.slots] = (
            np.arange(self.slots)[None, :] < n_genes[:, None]
        )
        return positions

    def _assemble(self, genes: np.ndarray, n_genes: np.ndarray, bins=None):
        """Sequences from each row's gene tokens (and bins).

        Args:
            genes: int32 `[n_rows, slots]`, each row's genes first, then
                `<pad>`.
            n_genes: Genes per row.
            bins: Optional int32 `[n_rows, slots]` values beside the genes,
                then `pad_value`.

        Returns:
            `(gene_ids, used, values, gene_positions)`: `used` is the count
            of attended positions per row.
        """
        n_rows = n_genes.size
        offset = 1 if self.cls_id >= 0 else 0
        ids = np.empty((n_rows, self.length), np.int32)
        ids[:, offset : offset + self.slots] = genes
        ids[:, offset + self.slots :] = self.pad_id
        if offset:
            ids[:, 0] = self.cls_id
        used = offset + n_genes
        if self.eos_id >= 0:
            ids[np.arange(n_rows), used] = self.eos_id
            used = used + 1
        gene_positions = None
        if self.mlm_probability > 0:
            gene_positions = self._gene_positions(n_genes)
        values = None
        if bins is not None:  # `pad_value` past each row's genes already
            values = np.empty((n_rows, self.length), np.int32)
            values[:, offset : offset + self.slots] = bins
            values[:, offset + self.slots :] = self.pad_value
            if offset:
                values[:, 0] = 0
        return ids, used, values, gene_positions

    def _mlm(self, key: int, row_ids, ids: np.ndarray, genes: np.ndarray):
        """Masked positions: `uniform(key, row id, token, 7) < p` on genes."""
        r, c = np.nonzero(genes)
        u = counter_rng.uniform(
            np.uint64(key),
            row_ids[r].astype(np.uint64),
            ids[r, c].astype(np.uint64),
            _MLM_WORD,
        )
        hit = u < self.mlm_probability
        masked = np.zeros(ids.shape, bool)
        masked[r[hit], c[hit]] = True
        return masked


class RankValueTokens(TokenOutput):
    """Rank-value encoding (Geneformer); see the module docstring.

    Build it with `RankValueTokens.for_source(source, vocabulary, stats)`.
    """

    _cache_name = "rank_value"

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
            kernels: `"numba"` (compiled, `grain_cells.token_jit`),
                `"numpy"` (`grain_cells.token_kernels`) or `"auto"` (numba
                when installed). Both give the same arrays, bit for bit.
        """
        medians = np.asarray(column_medians, np.float32)
        column_tokens = np.asarray(column_tokens, np.int32).copy()
        if medians.shape != column_tokens.shape:
            raise ValueError(
                f"column_medians has {medians.size} entries for "
                f"{column_tokens.size} columns"
            )
        usable = np.isfinite(medians) & (medians > 0)
        self.num_without_median = int(((column_tokens >= 0) & ~usable).sum())
        column_tokens[~usable] = -1
        super().__init__(
            column_tokens,
            length=length,
            pad_id=pad_id,
            cls_id=cls_id,
            eos_id=eos_id,
            mask_id=mask_id,
            mlm_probability=mlm_probability,
            kernels=kernels,
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
    ) -> RankValueTokens:
        """Rank-value tokens for `source`'s genes.

        Args:
            source: The `AnnDataSource` (its `var_names` are looked up).
            vocabulary: Token ids of genes and specials.
            stats: `grain_cells.CorpusStats` with the genes' medians (matched
                by name).
            length: Tokens per cell, special tokens included.
            cls_token: Start with `<cls>`.
            eos_token: End with `<eos>`.
            mlm_probability: Share of gene positions replaced by `<mask>`.
            kernels: `"auto"`, `"numba"` or `"numpy"` (see `__init__`).
        """
        genes = source.var_names
        return RankValueTokens(
            vocabulary.map_genes(genes).tokens,
            stats.medians_for(genes),
            length=length,
            pad_id=vocabulary.special("pad"),
            cls_id=special_id(vocabulary, "cls", cls_token),
            eos_id=special_id(vocabulary, "eos", eos_token),
            mask_id=vocabulary.special("mask")
            if vocabulary.has_special("mask")
            else -1,
            mlm_probability=mlm_probability,
            kernels=kernels,
        )

    def __repr__(self) -> str:
        return (
            f"RankValueTokens(length={self.length}, pad={self.pad_id}, "
            f"cls={self.cls_id}, eos={self.eos_id}, mask={self.mask_id}, "
            f"mlm={self.mlm_probability}, "
            f"columns=sha256:{self._digest(self.column_medians)})"
        )

    def tokenize(self, fetch: Fetch) -> dict[str, np.ndarray]:
        """Token arrays of every row of the fetch."""
        if self._compiled():
            return self._tokenize_compiled(fetch)
        medians = self.column_medians
        indptr, keep, inv, tokens, dropped = self._prepare(
            fetch, lambda values, columns: values / medians[columns]
        )
        n_rows = indptr.size - 1
        genes = np.full((n_rows, self.slots), self.pad_id, np.int32)
        n_expr = np.zeros(n_rows, np.int64)
        lengths = np.diff(indptr)
        for chunk, values in kernels.length_chunks(indptr):
            rows, n_expr[chunk] = kernels.sorted_rows(
                lengths[chunk],
                None if keep is None else keep[values],
                inv[values],
                tokens[values],
                self.pad_id,
            )
            w = min(rows.shape[1], self.slots)
            genes[chunk, :w] = kernels.key_tokens(rows, w)
        n_genes = np.minimum(n_expr, self.slots)
        ids, used, _, positions = self._assemble(genes, n_genes)
        out = {
            "gene_ids": ids,
            "n_expressed": n_expr.astype(np.int32),
            "n_dropped": dropped,
            "_used": used,
        }
        if self.mlm_probability > 0:
            masked = self._mlm(fetch.key, fetch.row_ids, ids, positions)
            self._apply_mask(out, masked)
        return out

    def _tokenize_compiled(self, fetch: Fetch) -> dict[str, np.ndarray]:
        """`tokenize` on the compiled kernels (all rows of the fetch)."""
        rows = np.arange(fetch.row_ids.size, dtype=np.int64)
        out, n_genes = self._encode(fetch, rows, rows.size)
        del out["attention_mask"]
        out["_used"] = (
            n_genes.astype(np.int64) + (self.cls_id >= 0) + (self.eos_id >= 0)
        )
        self._mask_genes(fetch, rows, out, n_genes)
        return out

    def _encode(self, fetch: Fetch, rows: np.ndarray, n_out: int):
        """Compiled encoding (`grain_cells.token_jit.rank_value_rows`)."""
        from grain_cells import token_jit  # imports numba: only when used

        data, indices, indptr, checked = self._csr_for_jit(fetch)
        ids = np.empty((n_out, self.length), np.int32)
        mask = np.empty((n_out, self.length), bool)
        n_expr, dropped, n_genes = token_jit.rank_value_rows(
            data,
            indices,
            indptr,
            rows,
            self.column_tokens,
            self.column_medians,
            checked,
            ids,
            mask,
            self.cls_id,
            self.slots,
            self.pad_id,
            self.eos_id,
        )
        out = {
            "gene_ids": ids,
            "n_expressed": n_expr,
            "n_dropped": dropped,
            "attention_mask": mask,
        }
        return out, n_genes
