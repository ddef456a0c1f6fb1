"""HDF5 writers of synthetic X (CSR or dense) and the CSR chunk choice."""

from __future__ import annotations

import os

import h5py
import numpy as np

_CSR_CHUNK = 2**18  # HDF5 chunk (elements) for data/indices, uncompressed
_CSR_CHUNK_COMPRESSED = 2**16  # same, when a compression filter is set
_DENSE_CHUNK_BYTES = 2**20  # target HDF5 chunk size of a compressed dense X
_DENSE_BLOCK_BYTES = 2**26  # densify at most this much of a chunk at a time
# `chunks="atlas"`: HDF5 chunks as anndata writes them for a file this size.
ATLAS_CHUNKS = "atlas"


def csr_chunk_length(chunks, compression, n_cells: int, mean_nnz: float) -> int:
    """HDF5 chunk length of the CSR datasets for `write_tahoe_like(chunks=)`."""
    if chunks is None:
        return _CSR_CHUNK if compression is None else _CSR_CHUNK_COMPRESSED
    if chunks != ATLAS_CHUNKS:
        return int(chunks)
    # h5py's own guess (what anndata gets) for a float32 dataset of the full
    # expected length, asked of a throwaway in-memory file: HDF5 allocates
    # chunks lazily, so nothing of that size is made.
    length = max(1, round(n_cells * mean_nnz))
    with h5py.File(
        f"atlas-chunks-{os.getpid()}", "w", driver="core", backing_store=False
    ) as mem:
        probe = mem.create_dataset(
            "probe", (length,), np.float32, maxshape=(None,), chunks=True
        )
        return int(probe.chunks[0])


class CsrWriter:
    """Streams CSR rows into group ``X`` in anndata's csr_matrix encoding."""

    def __init__(
        self, f: h5py.File, n_cells: int, n_genes: int, compression, chunk: int
    ):
        group = f.create_group("X")
        group.attrs["encoding-type"] = "csr_matrix"
        group.attrs["encoding-version"] = "0.1.0"
        group.attrs["shape"] = np.array([n_cells, n_genes], dtype=np.int64)
        opts = {"maxshape": (None,), "chunks": (chunk,), "compression": compression}
        self.data = group.create_dataset("data", (0,), np.float32, **opts)
        self.indices = group.create_dataset("indices", (0,), np.int32, **opts)
        self.indptr = group.create_dataset("indptr", (1,), np.int64, **opts)
        self.indptr[0] = 0
        self.nnz = 0
        self.rows = 0

    def append(self, indptr, indices, data) -> None:
        """Appends CSR rows (`indptr` starting at 0)."""
        nnz, rows = self.nnz + data.size, self.rows + indptr.size - 1
        self.data.resize((nnz,))
        self.data[self.nnz :] = data
        self.indices.resize((nnz,))
        self.indices[self.nnz :] = indices
        self.indptr.resize((rows + 1,))
        self.indptr[self.rows + 1 :] = indptr[1:] + self.nnz
        self.nnz, self.rows = nnz, rows


class DenseWriter:
    """Writes rows densified from CSR into a 2-D float32 dataset ``X``."""

    def __init__(self, f: h5py.File, n_cells: int, n_genes: int, compression):
        chunks = None
        if compression is not None:
            rows = max(1, min(1024, n_cells, _DENSE_CHUNK_BYTES // (4 * n_genes)))
            chunks = (rows, n_genes)
        self.x = f.create_dataset(
            "X", (n_cells, n_genes), np.float32, chunks=chunks, compression=compression
        )
        self.x.attrs["encoding-type"] = "array"
        self.x.attrs["encoding-version"] = "0.2.0"
        self.n_genes = n_genes
        self.rows = 0

    def append(self, indptr, indices, data) -> None:
        """Writes CSR rows (`indptr` starting at 0) as the next dense rows."""
        n_rows = indptr.size - 1
        step = max(1, _DENSE_BLOCK_BYTES // (4 * self.n_genes))
        for r0 in range(0, n_rows, step):
            r1 = min(r0 + step, n_rows)
            lo, hi = indptr[r0], indptr[r1]
            block = np.zeros((r1 - r0, self.n_genes), dtype=np.float32)
            rows = np.repeat(np.arange(r1 - r0), np.diff(indptr[r0 : r1 + 1]))
            block[rows, indices[lo:hi]] = data[lo:hi]
            self.x[self.rows + r0 : self.rows + r1] = block
        self.rows += n_rows
