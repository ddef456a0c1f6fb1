"""Synthetic cells: the Tahoe-shaped generation model and HDF5 writers of X.

Design notes: docs/reference/design.md#synthetic-tahoe.
"""

from __future__ import annotations

import math
import os

import h5py
import numpy as np
import pandas as pd

# Independent random streams, all derived from the user's seed.
STREAM_OBS = 0  # per-cell metadata and per-cell molecule counts
STREAM_LAYOUT = 1  # gene-rank permutation, category frequency permutations
STREAM_MOLECULES = 2  # gene draws, one sub-stream per write step (chunk)
_ZIPF_OFFSET = 5.0  # flattens the head of the gene-rank distribution
_NNZ_SIGMA = 0.5  # lognormal spread of genes detected per cell
_MIN_NNZ = 50
_MAX_MOLECULES = 2**24  # per cell; keeps n_counts exact in float32
_MAX_MOLECULES_PER_GENE = 8  # and at most this many per gene, plus 64
_CSR_CHUNK = 2**18  # HDF5 chunk (elements) for data/indices, uncompressed
_CSR_CHUNK_COMPRESSED = 2**16  # same, when a compression filter is set
_DENSE_CHUNK_BYTES = 2**20  # target HDF5 chunk size of a compressed dense X
_DENSE_BLOCK_BYTES = 2**26  # densify at most this much of a chunk at a time
# `chunks="atlas"`: HDF5 chunks as anndata writes them for a file this size.
ATLAS_CHUNKS = "atlas"


def molecules_per_cell(
    rng: np.random.Generator, n_cells: int, n_genes: int, mean_nnz: float
) -> np.ndarray:
    """Per-cell molecule counts whose expected distinct genes are lognormal.

    A target `t` maps to the `m` with `sum_k 1 - (1 - p_k)^m = t` (interpolated).
    """
    edges = np.log1p(np.arange(n_genes + 1, dtype=np.float64) / _ZIPF_OFFSET)
    p = np.diff(edges) / edges[-1]  # of each gene rank, as drawn by `generate_chunk`
    log_miss = np.log1p(-np.minimum(p, 1.0 - 1e-16))
    most = min(_MAX_MOLECULES, _MAX_MOLECULES_PER_GENE * n_genes + 64)
    grid = np.unique(np.rint(np.geomspace(1, most, 600)))
    expected = np.empty(grid.size)
    step = max(1, 2**22 // n_genes)
    for i in range(0, grid.size, step):
        block = grid[i : i + step, None] * log_miss[None, :]
        expected[i : i + step] = -np.expm1(block).sum(axis=1)
    expected = np.maximum.accumulate(expected)  # guard against rounding
    sigma = _NNZ_SIGMA
    target = rng.lognormal(math.log(mean_nnz) - sigma**2 / 2, sigma, n_cells)
    np.clip(target, min(_MIN_NNZ, mean_nnz / 2), n_genes, out=target)
    np.minimum(target, expected[-1], out=target)
    molecules = np.rint(np.interp(target, expected, grid))
    return np.maximum(molecules, 1).astype(np.int64)


def generate_chunk(
    rng: np.random.Generator, molecules: np.ndarray, gene_of_rank: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The CSR rows `(indptr from 0, indices, data)` of one chunk of cells."""
    n_rows = molecules.size
    n_genes = gene_of_rank.size
    total = int(molecules.sum())
    key_dtype = np.uint32 if n_rows * n_genes <= 2**32 else np.uint64
    keys = np.repeat(np.arange(n_rows, dtype=key_dtype) * key_dtype(n_genes), molecules)
    # Gene ranks `x0 * e^(u L) - x0` (`L = ln(1 + n_genes / x0)`, u uniform).
    u = rng.random(total, dtype=np.float32)
    u *= np.float32(math.log1p(n_genes / _ZIPF_OFFSET))
    np.exp(u, out=u)
    u -= np.float32(1.0)
    u *= np.float32(_ZIPF_OFFSET)
    ranks = u.astype(np.int32)  # truncation == floor, u >= 0
    del u
    np.minimum(ranks, n_genes - 1, out=ranks)
    keys += gene_of_rank[ranks].astype(key_dtype, copy=False)
    del ranks
    keys.sort()  # rows occupy disjoint key ranges: sorts by (row, gene)
    first = np.empty(total, dtype=bool)
    first[:1] = True
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    del first
    data = np.empty(starts.size, dtype=np.float32)
    np.subtract(starts[1:], starts[:-1], out=data[:-1], casting="unsafe")
    data[-1:] = total - starts[-1:]
    unique = keys[starts]
    del keys
    indices = (unique % key_dtype(n_genes)).astype(np.int32)
    del unique
    indptr = np.zeros(n_rows + 1, dtype=np.int64)
    indptr[1:] = np.searchsorted(starts, np.cumsum(molecules), side="left")
    return indptr, indices, data


def make_obs(
    rng: np.random.Generator, n_cells: int, n_plates: int, line_perm, drug_perm
) -> pd.DataFrame:
    """Obs of `n_cells` plate-sorted cells: plate, cell_line and drug labels.

    Cell lines and drugs are Zipf-like over their permuted codes (`*_perm`).
    """
    bounds = np.arange(n_plates + 1, dtype=np.int64) * n_cells // n_plates
    columns = {"plate": (np.repeat(np.arange(n_plates), np.diff(bounds)), n_plates)}
    for name, perm, power in (("cell_line", line_perm, 0.7), ("drug", drug_perm, 0.6)):
        w = 1.0 / np.arange(1, perm.size + 1) ** power
        columns[name] = (perm[rng.choice(perm.size, n_cells, p=w / w.sum())], perm.size)
    frame = {}
    for (name, (codes, n)), (prefix, width) in zip(
        columns.items(), (("plate_", 2), ("CVCL_", 4), ("drug_", 3)), strict=True
    ):
        width = max(width, len(str(n)))
        names = [f"{prefix}{i:0{width}d}" for i in range(1, n + 1)]
        frame[name] = pd.Categorical.from_codes(codes, categories=names)
    index = np.char.mod("cell_%09d", np.arange(n_cells)).astype(object)
    return pd.DataFrame(frame, index=pd.Index(index, dtype=object))


def make_var(n_genes: int) -> pd.DataFrame:
    """Var indexed by ENSG-style ids, with a gene_symbol column."""
    ids = np.arange(1, n_genes + 1)
    index = pd.Index(np.char.mod("ENSG%011d", ids).astype(object), dtype=object)
    return pd.DataFrame(
        {"gene_symbol": np.char.mod("GENE%d", ids).astype(object)}, index=index
    )


def csr_chunk_length(chunks, compression, n_cells: int, mean_nnz: float) -> int:
    """HDF5 chunk length of X's CSR datasets for `chunks` (None, "atlas" or an int)."""
    if chunks is None:
        return _CSR_CHUNK if compression is None else _CSR_CHUNK_COMPRESSED
    if chunks != ATLAS_CHUNKS:
        return int(chunks)
    # h5py's own guess (what anndata gets) for a float32 dataset of the full
    # expected length, in a throwaway in-memory file (chunks are lazy).
    length = max(1, round(n_cells * mean_nnz))
    name = f"atlas-chunks-{os.getpid()}"
    with h5py.File(name, "w", driver="core", backing_store=False) as mem:
        probe = mem.create_dataset(
            "probe", (length,), np.float32, maxshape=(None,), chunks=True
        )
        return int(probe.chunks[0])


class XWriter:
    """Appends blocks of CSR rows to ``X``: anndata's csr_matrix, or dense float32.

    `chunk`: the CSR datasets' chunk length; None writes X dense.
    """

    def __init__(self, f: h5py.File, n_cells: int, n_genes: int, compression, chunk):
        self.n_genes, self.nnz, self.rows = n_genes, 0, 0
        if chunk is None:
            rows = max(1, min(1024, n_cells, _DENSE_CHUNK_BYTES // (4 * n_genes)))
            chunks = None if compression is None else (rows, n_genes)
            self.x = f.create_dataset(
                "X",
                (n_cells, n_genes),
                np.float32,
                chunks=chunks,
                compression=compression,
            )
            self.x.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
            return
        self.x = None
        group = f.create_group("X")
        group.attrs["encoding-type"] = "csr_matrix"
        group.attrs["encoding-version"] = "0.1.0"
        group.attrs["shape"] = np.array([n_cells, n_genes], dtype=np.int64)
        opts = {"maxshape": (None,), "chunks": (chunk,), "compression": compression}
        self.data = group.create_dataset("data", (0,), np.float32, **opts)
        self.indices = group.create_dataset("indices", (0,), np.int32, **opts)
        self.indptr = group.create_dataset("indptr", (1,), np.int64, **opts)
        self.indptr[0] = 0

    def append(self, indptr, indices, data) -> None:
        """Appends CSR rows (`indptr` starting at 0)."""
        n_rows = indptr.size - 1
        if self.x is not None:  # densified a block of rows at a time
            step = max(1, _DENSE_BLOCK_BYTES // (4 * self.n_genes))
            for r0 in range(0, n_rows, step):
                r1 = min(r0 + step, n_rows)
                lo, hi = indptr[r0], indptr[r1]
                block = np.zeros((r1 - r0, self.n_genes), dtype=np.float32)
                rows = np.repeat(np.arange(r1 - r0), np.diff(indptr[r0 : r1 + 1]))
                block[rows, indices[lo:hi]] = data[lo:hi]
                self.x[self.rows + r0 : self.rows + r1] = block
            self.rows += n_rows
            return
        nnz, rows = self.nnz + data.size, self.rows + n_rows
        for dataset, values in ((self.data, data), (self.indices, indices)):
            dataset.resize((nnz,))
            dataset[self.nnz :] = values
        self.indptr.resize((rows + 1,))
        self.indptr[self.rows + 1 :] = indptr[1:] + self.nnz
        self.nnz, self.rows = nnz, rows
