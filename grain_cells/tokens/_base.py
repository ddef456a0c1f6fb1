"""What the token outputs share: vocabulary map, special tokens, masking.

Design notes: docs/reference/design.md#tokens-base.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util

import numpy as np

from grain_cells._util import arguments, counter_rng
from grain_cells.outputs import Fetch, Output
from grain_cells.tokens import _kernels, _threads
from grain_cells.tokens._vocabulary import GeneVocabulary

IGNORE = -100  # `labels` where nothing is masked
ZERO_STREAM = 1 << 40  # counter offset of the zero-gene stream
_MLM_WORD = 7


@functools.cache
def numba_available() -> bool:
    return importlib.util.find_spec("numba") is not None


def special_id(vocab: GeneVocabulary, role: str, wanted: bool) -> int:
    """Id of a special token, or -1 when not wanted."""
    if not wanted:
        return -1
    return vocab.special(role)


class TokenOutput(Output):
    """The base of `RankValueTokens` and `ValueBinTokens`, which define `tokenize`."""

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
        threads: int | str = "auto",
    ):
        column_tokens = column_token_array(column_tokens)
        if kernels not in ("auto", "numba", "numpy"):
            raise ValueError(
                f"kernels must be 'auto', 'numba' or 'numpy', got kernels={kernels!r}"
            )
        if kernels == "numba" and not numba_available():
            raise ImportError(
                "kernels='numba' needs numba: pip install 'grain_cells[tokens]'"
            )
        length = arguments.check_int("length", length, minimum=1)
        if not 0.0 <= mlm_probability < 1.0:
            raise ValueError(
                "mlm_probability must lie in [0, 1), got "
                f"mlm_probability={mlm_probability!r}"
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
        _threads.resolve_threads(threads)  # refuses a bad value now
        self._threads = threads  # "auto" resolves in the process that encodes
        self._all_in_vocabulary = bool((column_tokens >= 0).all())
        self.slots = self.length - (cls_id >= 0) - (eos_id >= 0)
        if self.slots < 1:
            raise ValueError(
                f"length={length} leaves no room for genes after special tokens"
            )

    @property
    def threads(self) -> int:
        """Threads per minibatch in this process (`"auto"`: one in a worker)."""
        return _threads.resolve_threads(self._threads)

    def _digest(self, *arrays) -> str:
        h = hashlib.sha256(self.column_tokens.tobytes())
        for a in arrays:
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]

    def format(
        self, fetch: Fetch, rows: np.ndarray, batch_size: int, empty=np.empty
    ) -> dict[str, np.ndarray]:
        """One minibatch: the fetch's `rows` as token arrays (`empty` unused).

        Compiled kernels encode the rows; NumPy ones the whole fetch once (cached).
        """
        if self._per_minibatch():
            rows = np.asarray(rows, np.int64)
            whole = self._from_whole_fetch(fetch, rows, batch_size)
            if whole is not None:
                out, n_genes = whole
            else:
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

    def _from_whole_fetch(self, fetch: Fetch, rows: np.ndarray, batch_size: int):
        """A full minibatch sliced from the whole fetch encoded once, or None."""
        order = fetch.order
        if order is None or rows.size != batch_size or self.threads < 2:
            return None
        key = ("whole_fetch", id(self))
        whole = fetch.cache.get(key)
        if whole is None:
            out, n_genes = self._encode(fetch, order, order.size)
            position = np.full(fetch.row_ids.size, -1, np.int64)
            position[order] = np.arange(order.size)
            whole = fetch.cache[key] = (out, n_genes, position)
        out, n_genes, position = whole
        a = int(position[rows[0]])
        b = a + rows.size
        if a < 0 or b > order.size or not np.array_equal(order[a:b], rows):
            return None
        copied = ("gene_ids", "values") if self.mlm_probability > 0 else ()
        return {
            name: array[a:b].copy() if name in copied else array[a:b]
            for name, array in out.items()
        }, n_genes[a:b]

    def pad_fill(self, name: str):
        """Value of padding rows in array `name`."""
        return {"gene_ids": self.pad_id, "labels": IGNORE}.get(name, 0)

    def _prepare(self, fetch: Fetch, values_for_order):
        """`(keep, dropped, chunks)`: the fetch's values sorted per row, in chunks.

        `keep` None when every value is kept; `dropped` per row the positive values
        without a token; `chunks` yields `(rows, sorted keys, n_kept)`.
        """
        csr = fetch.csr
        tokens = self.column_tokens[csr.indices]
        values = csr.data.astype(np.float32, copy=False)
        lengths = np.diff(csr.indptr)
        inv = _kernels.inverted(values_for_order(values, csr.indices))
        keep, dropped = None, np.zeros(lengths.size, np.int32)
        if not (self._all_in_vocabulary and (not values.size or values.min() > 0)):
            positive = values > 0
            keep = positive & (tokens >= 0)
            out_of_vocab = np.zeros(values.size + 1, np.int32)
            np.cumsum(positive & (tokens < 0), out=out_of_vocab[1:])
            dropped = out_of_vocab[csr.indptr[1:]] - out_of_vocab[csr.indptr[:-1]]

        def chunks():
            for rows, at in _kernels.length_chunks(csr.indptr):
                kept = None if keep is None else keep[at]
                keys, n_kept = _kernels.sorted_rows(
                    lengths[rows], kept, inv[at], tokens[at], self.pad_id
                )
                yield rows, keys, n_kept

        return keep, dropped, chunks()

    def _per_minibatch(self) -> bool:
        """True when `format` encodes each minibatch's rows itself."""
        return self._compiled()

    def _encode(self, fetch: Fetch, rows: np.ndarray, n_out: int):
        """Compiled encoding of `rows` into `n_out` rows: `(arrays, n_genes)`."""
        raise NotImplementedError

    def _tokenize_compiled(self, fetch: Fetch) -> dict[str, np.ndarray]:
        """`tokenize` on the compiled kernels, all rows of the fetch."""
        rows = np.arange(fetch.row_ids.size, dtype=np.int64)
        out, n_genes = self._encode(fetch, rows, rows.size)
        del out["attention_mask"]
        n_genes = self._add_genes(fetch, out, n_genes)
        specials = (self.cls_id >= 0) + (self.eos_id >= 0)
        out["_used"] = n_genes.astype(np.int64) + specials
        self._mask_genes(fetch, rows, out, n_genes)
        return out

    def _add_genes(self, fetch: Fetch, out: dict, n_genes: np.ndarray):
        """Genes placed after the encoded ones (value-bin's zero genes)."""
        return n_genes

    def _mask_genes(self, fetch: Fetch, rows, out: dict, n_genes) -> None:
        """Masked-language masking of `out` (compiled path), in place."""
        if self.mlm_probability <= 0:
            return
        ids = out["gene_ids"]
        row_ids = np.zeros(ids.shape[0], np.int64)
        row_ids[: rows.size] = fetch.row_ids[rows]
        masked = self._mlm(fetch.key, row_ids, ids, self._gene_positions(n_genes))
        self._apply_mask(out, masked)

    def _mask_all(self, fetch: Fetch, out: dict, positions) -> dict:
        """Masks every row of the fetch (NumPy path) when `mlm_probability > 0`."""
        if self.mlm_probability > 0:
            ids = out["gene_ids"]
            self._apply_mask(out, self._mlm(fetch.key, fetch.row_ids, ids, positions))
        return out

    def _apply_mask(self, out: dict, masked: np.ndarray) -> None:
        """Writes `labels` and masks `out` where `masked`."""
        ids = out["gene_ids"]
        out["labels"] = np.where(masked, ids, IGNORE).astype(np.int32)
        ids[masked] = self.mask_id

    def _compiled(self) -> bool:
        return self.kernels == "numba" or (self.kernels == "auto" and numba_available())

    def _csr_for_jit(self, fetch: Fetch):
        """Cached `(data, indices, indptr, checked)`; `checked` False: all kept."""
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
        """`(gene_ids, used, values, gene_positions)` from each row's gene tokens.

        `used`: attended positions per row; `values` None without `bins`.
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


def column_token_array(column_tokens) -> np.ndarray:
    """`column_tokens` as int32 (-1: no token); `ArgumentTypeError` if not integers."""
    array = np.asarray(column_tokens)
    integral = array.dtype.kind in "iu" or (
        array.dtype.kind == "f" and bool(np.all(np.mod(array, 1) == 0))
    )
    if array.ndim != 1 or not (integral or array.size == 0):
        raise arguments.ArgumentTypeError(
            "column_tokens must be a 1-D array of integer token ids, one per "
            "column of the source (see GeneVocabulary.column_tokens), got "
            f"column_tokens={column_tokens!r:.80}"
        )
    return array.astype(np.int32)
