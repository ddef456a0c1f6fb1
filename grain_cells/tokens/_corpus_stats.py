"""Per-gene corpus statistics (non-zero medians, totals) in one streaming pass.

Design notes: docs/reference/design.md#tokens-corpus-stats.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os

import numpy as np
import tqdm

from grain_cells import errors
from grain_cells._util import arguments
from grain_cells._util.cache_files import cache_root, write_atomic
from grain_cells.io import CSR, open_file, read_var_names
from grain_cells.outputs import Fetch

METHODS = ("auto", "exact", "histogram")
_VERSION = 2  # 2: keyed by the files' identities; the user's cache folder
_ARRAYS = ("var_names", "nonzero_median", "nonzero_count", "total")


@dataclasses.dataclass(frozen=True)
class CorpusStats:
    """Per-gene statistics of a corpus; see the design notes.

    Attributes:
        var_names: The genes, in the source's output order.
        nonzero_median: Median of each gene's non-zero normalised values
            (NaN for genes never expressed).
        nonzero_count: Cells in which each gene is non-zero.
        total: Sum of each gene's raw values.
        num_cells: Cells read.
        method: `"exact"` or `"histogram"`.
        target_sum: The normalisation's target sum (None: raw values).
        key: The data-and-options key the cache file is named by.
    """

    var_names: np.ndarray
    nonzero_median: np.ndarray
    nonzero_count: np.ndarray
    total: np.ndarray
    num_cells: int
    method: str
    target_sum: float | None
    key: str

    def save(self, path: str | os.PathLike) -> None:
        """Writes the statistics as an `.npz` file (no pickle)."""
        meta = {k: getattr(self, k) for k in ("num_cells", "method", "target_sum")}
        meta |= {"key": self.key, "version": _VERSION}
        arrays = {k: getattr(self, k) for k in _ARRAYS} | {"meta": json.dumps(meta)}
        arrays["var_names"] = np.asarray(self.var_names).astype(str)
        write_atomic(path, lambda fh: np.savez(fh, **arrays))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CorpusStats:
        """Reads statistics written by `save`."""
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            fields = int(meta["num_cells"]), meta["method"], meta["target_sum"]
            return cls(*(z[k] for k in _ARRAYS), *fields, meta["key"])

    def medians_for(self, genes) -> np.ndarray:
        """Non-zero medians of `genes` (names), NaN for genes not in the stats.

        Raises:
            errors.GeneMismatchError: A name repeats in the statistics' genes
                or in `genes` (a name could not tell its columns apart).
        """
        names = np.asarray(self.var_names).astype(str)
        for what, values in (("statistics", names), ("requested", genes)):
            values = np.asarray(values).astype(str)
            uniq, counts = np.unique(values, return_counts=True)
            if (counts > 1).any():
                dup = uniq[counts > 1][0]
                where = np.flatnonzero(values == dup).tolist()
                raise errors.GeneMismatchError(
                    f"the {what} genes repeat {dup!r} (at columns {where}): a "
                    "median by name cannot tell those columns apart. Make var "
                    "names unique (adata.var_names_make_unique()) or select "
                    "genes with AnnDataSource(..., genes=[...])."
                )
        index = {g: i for i, g in enumerate(names.tolist())}
        pos = np.array([index.get(str(g), -1) for g in genes], np.int64)
        out = np.full(pos.size, np.nan)
        out[pos >= 0] = self.nonzero_median[pos[pos >= 0]]
        return out


def data_identity(source) -> dict:
    """What identifies a source's data, independent of paths and hosts."""
    files = []
    for i, path in enumerate(source.paths):
        info = source.file_info(i)
        with open_file(path) as f:
            element = f[info.element]
            names = np.asarray(read_var_names(f, info.element)).astype(str)
            digest = hashlib.sha256(names.tobytes())
            if info.encoding == CSR:
                data = element["data"]
                ends = data[:4096], data[max(0, data.shape[0] - 4096) :]
                parts = (element["indptr"][:], *ends)
            else:
                parts = element[:1], element[-1:]
            for part in parts:
                digest.update(np.asarray(part).tobytes())
        # The version reads are checked against: a file rewritten in place has
        # another mtime/ctime, an object another ETag, whatever values changed.
        ident = source.file_identity(i)
        digest.update(repr((dataclasses.astuple(ident.stat), ident.content())).encode())
        files.append(f"{info.describe()} sha256:{digest.hexdigest()[:16]}")
    genes = hashlib.sha256(np.asarray(source.var_names).astype(str).tobytes())
    _, starts, stops = source.block_ranges(np.arange(len(source)))
    blocks = hashlib.sha256(np.concatenate([starts, stops]).astype("<i8").tobytes())
    digests = {"genes": genes.hexdigest()[:16], "blocks": blocks.hexdigest()[:16]}
    return {"files": files, **digests}


def corpus_stats(
    source,
    *,
    target_sum: float | None = 1e4,
    method: str = "auto",
    bins_per_octave: int = 32,
    min_octave: int = -12,
    max_octave: int = 20,
    exact_bytes: int = 2 << 30,
    chunk_cells: int = 2048,
    cache: bool = True,
    progress: bool = True,
) -> CorpusStats:
    """Per-gene statistics of `source`'s cells in one streaming pass (cached).

    Args:
        source: An `AnnDataSource` (or a view: its selected cells only).
        target_sum: Normalise each cell to this total before taking medians
            (Geneformer: 10,000); None for raw values.
        method: `"auto"`, `"exact"` or `"histogram"` (see the design notes).
        bins_per_octave: Histogram resolution.
        min_octave: Histogram's lowest edge is `2**min_octave`.
        max_octave: Histogram's highest edge is `2**max_octave`.
        exact_bytes: `"auto"` is exact below this many bytes of kept values.
        chunk_cells: Cells per batched read.
        cache: Reuse and write the cache file.
        progress: Show a tqdm progress bar.

    Returns:
        The statistics.

    Raises:
        ValueError: An argument is out of range.
    """
    arguments.check_choice("method", method, METHODS)
    arguments.check_int("chunk_cells", chunk_cells, minimum=1)
    if bins_per_octave < 1 or max_octave <= min_octave:
        raise ValueError(
            f"need bins_per_octave >= 1 and max_octave > min_octave, got "
            f"bins_per_octave={bins_per_octave}, min_octave={min_octave}, "
            f"max_octave={max_octave}"
        )
    if target_sum is not None and not target_sum > 0:
        raise ValueError(
            f"target_sum must be positive or None, got target_sum={target_sum!r}"
        )
    if method == "auto":  # 12 bytes per kept value
        infos = [source.file_info(i) for i in range(len(source.paths))]
        nnz = sum(f.n_obs * f.n_vars if f.nnz is None else f.nnz for f in infos)
        nnz = nnz * source.num_selected_cells / max(1, source.num_cells)
        method = "exact" if int(nnz) * 12 < exact_bytes else "histogram"
    grid = (bins_per_octave, min_octave, max_octave)
    options = {"target_sum": target_sum, "method": method, "version": _VERSION}
    options["grid"] = list(grid) if method == "histogram" else None
    identity = {"data": data_identity(source), "options": options}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    path = os.path.join(cache_root(), f"grain_cells-corpus-stats-{key}.npz")
    if cache and os.path.exists(path):
        stats = CorpusStats.load(path)
        if stats.key == key:
            return stats
    stats = _compute(source, target_sum, method, grid, chunk_cells, progress, key)
    if cache:
        with contextlib.suppress(OSError):  # a read-only cache folder: still a result
            os.makedirs(os.path.dirname(path), exist_ok=True)
            stats.save(path)
    return stats


def _compute(source, target_sum, method, grid, chunk_cells, progress, key):
    n_genes = source.num_genes
    count, total = np.zeros(n_genes, np.int64), np.zeros(n_genes, np.float64)
    bpo, lo, hi = grid
    n_bins = (hi - lo) * bpo
    hist = np.zeros(n_genes * n_bins, np.uint32) if method == "histogram" else None
    kept_genes, kept_values = [], []
    _, starts, stops = source.block_ranges(np.arange(len(source)))
    per_chunk = max(1, chunk_cells // source.block_size)
    num_cells, total_cells = 0, int((stops - starts).sum())
    desc = "corpus statistics"
    bar = tqdm.tqdm(total=total_cells, unit="cells", desc=desc, disable=not progress)
    with bar:
        for a in range(0, starts.size, per_chunk):
            ends = starts[a : a + per_chunk], stops[a : a + per_chunk]
            rows = source.fetch_ranges(*ends)
            csr = Fetch(rows.dense, rows.row_ids, n_genes, _csr=rows.csr).csr
            data, genes = csr.data.astype(np.float64), csr.indices.astype(np.int64)
            lengths = np.diff(csr.indptr)
            values = data
            if target_sum is not None:  # x / cell total * target_sum
                row_of = np.repeat(np.arange(lengths.size), lengths)
                totals = np.bincount(row_of, weights=data, minlength=lengths.size)
                values = data / totals[row_of] * target_sum
            keep = data != 0
            data, genes, values = data[keep], genes[keep], values[keep]
            count += np.bincount(genes, minlength=n_genes)
            total += np.bincount(genes, weights=data, minlength=n_genes)
            if hist is None:
                kept_genes.append(genes.astype(np.int32))
                kept_values.append(values)
            else:
                with np.errstate(divide="ignore"):
                    b = np.floor(np.log2(np.abs(values)) * bpo).astype(np.int64)
                b = np.clip(b - lo * bpo, 0, n_bins - 1)
                at, counts = np.unique(genes * n_bins + b, return_counts=True)
                hist[at] += counts.astype(hist.dtype)  # memory walked in order
            num_cells += lengths.size
            bar.update(lengths.size)
    medians = np.full(n_genes, np.nan)
    if hist is None:  # each gene's middle values, sorted by gene then value
        genes = np.concatenate([np.zeros(0, np.int32), *kept_genes])
        values = np.concatenate([np.zeros(0), *kept_values])
        values = values[np.lexsort((values, genes))]
        has = count > 0
        first = (np.cumsum(count) - count)[has]
        middle = values[first + (count[has] - 1) // 2] + values[first + count[has] // 2]
        medians[has] = middle / 2
    else:  # the mean of the centres of the middle values' bins
        hist = hist.reshape(n_genes, n_bins)
        for a in range(0, n_genes, 4096):  # bounded memory for the cumsum
            cum = np.cumsum(hist[a : a + 4096], axis=1, dtype=np.int64)
            c = count[a : a + 4096]
            centres = []
            for rank in ((c - 1) // 2, c // 2):
                b = (cum <= rank[:, None]).sum(axis=1)  # first bin with cumsum > rank
                centres.append(2.0 ** ((b + lo * bpo + 0.5) / bpo))
            centre = (centres[0] + centres[1]) / 2
            medians[a : a + 4096] = np.where(c > 0, centre, np.nan)
    names = np.asarray(source.var_names).astype(str)
    return CorpusStats(names, medians, count, total, num_cells, method, target_sum, key)
