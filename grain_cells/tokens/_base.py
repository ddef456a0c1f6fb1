"""The token outputs' one encoder: vocabulary map, special tokens, kernels, masking.

`RankValueTokens` sets `column_medians` (values are ranked divided by them);
`ValueBinTokens` sets `n_bins` (each gene also gets a bin in `values`).
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

IGNORE = -100  # `labels` where nothing is masked
ZERO_STREAM = 1 << 40  # counter offset of the zero-gene stream
_MLM_WORD = 7


@functools.cache
def numba_available() -> bool:
    return importlib.util.find_spec("numba") is not None


class TokenOutput(Output):
    """The encoder of both outputs; class attributes: defaults of one's parameters."""

    _FINGERPRINT: tuple[str, ...] = ()  # recorded between length and mlm_probability
    column_medians: np.ndarray | None = None
    n_bins: int | None = None
    selection = "top"
    pad_zeros = False
    pad_value = 0

    def __init__(
        self, column_tokens, specials, length, mlm_probability, kernels, threads
    ):
        """`specials`: the ids `(pad, cls, eos, mask)`, -1 for none."""
        _, cls_id, eos_id, mask_id = specials
        column_tokens = column_token_array(column_tokens)
        arguments.check_choice("kernels", kernels, ("auto", "numba", "numpy"))
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
        self.pad_id, self.cls_id, self.eos_id, self.mask_id = map(int, specials)
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

    def fingerprint(self) -> dict:
        """What a checkpoint records: the parameters that decide the tokens.

        A digest of the genes' token ids (and medians); not `kernels` or `threads`.
        """
        names = ("length", *self._FINGERPRINT, "mlm_probability")
        fields = {name: getattr(self, name) for name in names}
        return {"class": type(self).__name__, **fields, "columns": self._digest()}

    def __repr__(self) -> str:
        fp = self.fingerprint()
        name, columns = fp.pop("class"), fp.pop("columns")
        short = {k: k.removesuffix("_id") for k in fp} | {"mlm_probability": "mlm"}
        items = ", ".join(f"{short[k]}={v!r}" for k, v in fp.items())
        return f"{name}({items}, columns={columns})"

    def _digest(self) -> str:
        h = hashlib.sha256(self.column_tokens.tobytes())
        if self.column_medians is not None:
            h.update(np.ascontiguousarray(self.column_medians).tobytes())
        return f"sha256:{h.hexdigest()[:16]}"

    def format(
        self, fetch: Fetch, rows: np.ndarray, batch_size: int, empty=np.empty
    ) -> dict[str, np.ndarray]:
        """One minibatch: the fetch's `rows` as token arrays (`empty` unused).

        Compiled kernels encode the rows (with several threads, the whole fetch
        once); NumPy ones the whole fetch once (cached).
        """
        if self._compiled_top() and not self.pad_zeros:
            rows = np.asarray(rows, np.int64)
            out, n_genes = self._compiled_minibatch(fetch, rows, batch_size)
            self._mask_genes(fetch, rows, out, n_genes)
            return out
        key = ("tokens", id(self))
        arrays = fetch.cache.get(key)
        if arrays is None:
            arrays = fetch.cache[key] = self.tokenize(fetch)
        out = {}  # padding rows: these values, 0 in the other arrays
        fills = {"gene_ids": self.pad_id, "labels": IGNORE, "values": self.pad_value}
        for name, a in arrays.items():  # taken straight into the minibatch: one copy
            b = out[name] = np.empty((batch_size, *a.shape[1:]), a.dtype)
            np.take(a, rows, axis=0, out=b[: rows.size], mode="clip")
            b[rows.size :] = fills.get(name, 0)
        out["attention_mask"] = np.arange(self.length) < out.pop("_used")[:, None]
        return out

    def _compiled_minibatch(self, fetch: Fetch, rows: np.ndarray, batch_size: int):
        """`(arrays, n_genes)` of `rows`: a slice of the fetch encoded once in order."""
        order, key = fetch.order, ("whole_fetch", id(self))
        if order is None or rows.size != batch_size or self.threads < 2:
            return self._encode(fetch, rows, batch_size)
        if key not in fetch.cache:
            position = np.full(fetch.row_ids.size, -1, np.int64)
            position[order] = np.arange(order.size)
            fetch.cache[key] = (*self._encode(fetch, order, order.size), position)
        out, n_genes, position = fetch.cache[key]
        a, b = int(position[rows[0]]), int(position[rows[0]]) + rows.size
        if a < 0 or not np.array_equal(order[a:b], rows):
            return self._encode(fetch, rows, batch_size)
        copied = ("gene_ids", "values") if self.mlm_probability > 0 else ()
        out = {k: v[a:b].copy() if k in copied else v[a:b] for k, v in out.items()}
        return out, n_genes[a:b]

    def tokenize(self, fetch: Fetch) -> dict[str, np.ndarray]:
        """Token arrays of every row of the fetch."""
        rows = np.arange(fetch.row_ids.size, dtype=np.int64)
        if self._compiled_top():
            out, n_genes = self._encode(fetch, rows, rows.size)
            del out["attention_mask"]
        else:
            out, n_genes = self._encode_numpy(fetch)
        n_genes = n_genes.astype(np.int64)
        if self.pad_zeros and self.vocab_columns.size:
            n_genes = self._add_zero_genes(fetch, out, n_genes)
        out["_used"] = n_genes + (self.cls_id >= 0) + (self.eos_id >= 0)
        self._mask_genes(fetch, rows, out, n_genes)
        return out

    def _encode(self, fetch: Fetch, rows: np.ndarray, n_out: int):
        """Compiled encoding of `rows` into `n_out` rows: `(arrays, n_genes)`."""
        from grain_cells.tokens import _jit

        key = ("jit_csr", id(self))
        if key not in fetch.cache:  # `checked` False: every value is kept
            csr = fetch.csr
            data = np.ascontiguousarray(csr.data, np.float32)
            positive = not data.size or data.min() > 0
            indptr = np.ascontiguousarray(csr.indptr, np.int64)
            arrays = (data, np.ascontiguousarray(csr.indices), indptr)
            fetch.cache[key] = arrays, not (self._all_in_vocabulary and positive)
        csr, checked = fetch.cache[key]
        binned = self.n_bins is not None
        shape = (n_out, self.length)
        ids, mask = np.empty(shape, np.int32), np.empty(shape, bool)
        values = np.empty(shape if binned else (n_out, 0), np.int32)
        if binned:
            medians, q = np.ones(1, np.float32), np.linspace(0, 1, self.n_bins - 1)
        else:
            medians, q = self.column_medians, np.empty(0)
        ends = (self.cls_id, self.slots, self.pad_id, self.eos_id, self.pad_value)

        def call(part, a, b):
            args = (medians, checked, q, ids[a:b], values[a:b], mask[a:b], ends)
            return _jit.encode_rows(csr, part, self.column_tokens, *args)

        n_expr, dropped, n_genes = _threads.encode_rows(call, rows, n_out, self.threads)
        out = {"gene_ids": ids, "values": values} if binned else {"gene_ids": ids}
        out |= {"attention_mask": mask, "n_expressed": n_expr}
        return out | self._dropped(fetch, rows, n_out, dropped), n_genes

    def _encode_numpy(self, fetch: Fetch):
        """NumPy encoding of every row, unmasked, no zero genes: `(arrays, n_genes)`."""
        csr = fetch.csr
        tokens = self.column_tokens[csr.indices]
        values = csr.data.astype(np.float32, copy=False)
        lengths = np.diff(csr.indptr)
        scaled = values if self.n_bins else values / self.column_medians[csr.indices]
        inv = _kernels.inverted(scaled)
        keep, dropped = None, np.zeros(lengths.size, np.int32)
        if not (self._all_in_vocabulary and (not values.size or values.min() > 0)):
            positive = values > 0
            keep = positive & (tokens >= 0)
            out_of_vocab = np.zeros(values.size + 1, np.int32)
            np.cumsum(positive & (tokens < 0), out=out_of_vocab[1:])
            dropped = out_of_vocab[csr.indptr[1:]] - out_of_vocab[csr.indptr[:-1]]
        n_rows, offset, key = lengths.size, int(self.cls_id >= 0), np.uint64(fetch.key)
        ids = np.full((n_rows, self.length), self.pad_id, np.int32)
        bins = np.full_like(ids, self.pad_value) if self.n_bins is not None else None
        n_expr = np.zeros(n_rows, np.int64)
        for chunk, at in _kernels.length_chunks(csr.indptr):
            kept = None if keep is None else keep[at]
            rows, n_kept = _kernels.sorted_rows(
                lengths[chunk], kept, inv[at], tokens[at], self.pad_id
            )  # past `n_kept`: `pad_id`, and `pad_value` bins
            n_expr[chunk] = n_kept
            width = rows.shape[1]
            row_genes = _kernels.key_tokens(rows, width)
            if bins is not None:
                row_bins = _kernels.bins_of_sorted(
                    rows, n_kept, self.n_bins, self.pad_value
                )
            if self.selection == "random":
                row_ids = fetch.row_ids[chunk].astype(np.uint64)[:, None]
                h = counter_rng.hash64(key, row_ids, row_genes.astype(np.uint64))
                h >>= np.uint64(16)
                h[np.arange(width)[None, :] >= n_kept[:, None]] = ~np.uint64(0)
                order = np.argsort(h, axis=1, kind="stable")
                row_genes = np.take_along_axis(row_genes, order, axis=1)
                row_bins = np.take_along_axis(row_bins, order, axis=1)
            w = min(width, self.slots)
            ids[chunk, offset : offset + w] = row_genes[:, :w]
            if bins is not None:
                bins[chunk, offset : offset + w] = row_bins[:, :w]
        n_genes = np.minimum(n_expr, self.slots)
        if offset:
            ids[:, 0] = self.cls_id
        if self.eos_id >= 0:
            ids[np.arange(n_rows), offset + n_genes] = self.eos_id
        out = {"gene_ids": ids}
        if bins is not None:
            bins[:, :offset] = 0
            out["values"] = bins
        out["n_expressed"] = n_expr.astype(np.int32)
        return out | self._dropped(fetch, np.arange(n_rows), n_rows, dropped), n_genes

    def _dropped(self, fetch: Fetch, rows, n_out: int, not_tokenised) -> dict:
        """`n_dropped` of `rows`; rank-value: `n_no_median` (no median) apart."""
        dropped = np.asarray(not_tokenised, np.int32)
        if self.column_medians is None:
            return {"n_dropped": dropped}
        no_median = np.zeros(n_out, np.int32)
        if self.num_without_median:
            key = ("no_median", id(self))
            if key not in fetch.cache:
                csr = fetch.csr
                hit = self._no_median[csr.indices] & (csr.data > 0)
                total = np.concatenate([[0], np.cumsum(hit, dtype=np.int64)])
                fetch.cache[key] = total[csr.indptr[1:]] - total[csr.indptr[:-1]]
            no_median[: len(rows)] = fetch.cache[key][rows]
        return {"n_dropped": dropped - no_median, "n_no_median": no_median}

    def _add_zero_genes(self, fetch: Fetch, out: dict, n_genes) -> np.ndarray:
        """Writes sampled non-expressed genes after each row's expressed ones."""
        csr = fetch.csr
        tokens = self.column_tokens[csr.indices].astype(np.int64)
        keep = (csr.data.astype(np.float32, copy=False) > 0) & (tokens >= 0)
        lengths = np.diff(csr.indptr)
        rows = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
        expressed = np.sort(rows[keep] * (1 << 32) + tokens[keep])
        vocab_tokens = self.column_tokens[self.vocab_columns].astype(np.int64)
        n_expr = out["n_expressed"].astype(np.int64)
        need = np.maximum(
            np.minimum(self.slots - n_genes, vocab_tokens.size - n_expr), 0
        )
        zr, zt = _kernels.zero_genes(
            fetch.key, fetch.row_ids, need, vocab_tokens, expressed, ZERO_STREAM
        )
        starts = np.searchsorted(zr, np.arange(need.size))
        at = (self.cls_id >= 0) + n_genes[zr] + np.arange(zr.size) - starts[zr]
        out["gene_ids"][zr, at] = zt
        out["values"][zr, at] = 0
        return n_genes + need

    def _mask_genes(self, fetch: Fetch, rows, out: dict, n_genes) -> None:
        """Masks `out`'s genes where `uniform(key, row id, token, 7) < p`.

        Writes `labels` (the ids; value-bin: the bins) and `<mask>` (`mask_value`).
        """
        if self.mlm_probability <= 0:
            return
        ids, key = out["gene_ids"], np.uint64(fetch.key)
        row_ids = np.zeros(ids.shape[0], np.uint64)
        row_ids[: rows.size] = fetch.row_ids[rows]
        genes = np.zeros((n_genes.size, self.length), bool)
        offset = 1 if self.cls_id >= 0 else 0
        genes[:, offset : offset + self.slots] = (
            np.arange(self.slots) < n_genes[:, None]
        )
        r, c = np.nonzero(genes)
        u = counter_rng.uniform(key, row_ids[r], ids[r, c].astype(np.uint64), _MLM_WORD)
        hit = u < self.mlm_probability
        masked = np.zeros(ids.shape, bool)
        masked[r[hit], c[hit]] = True
        if self.n_bins is None:
            target, fill = ids, self.mask_id
        else:
            target, fill = out["values"], self.mask_value
        out["labels"] = np.where(masked, target, IGNORE).astype(np.int32)
        target[masked] = fill

    def _compiled(self) -> bool:
        return self.kernels == "numba" or (self.kernels == "auto" and numba_available())

    def _compiled_top(self) -> bool:
        return self.selection == "top" and self._compiled()


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
