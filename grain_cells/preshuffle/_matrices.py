"""The row-aligned matrices a preshuffled part holds: X, layers, raw/X, obsm.

Each reads through a `FileSet` (genes aligned, reads identity-checked, as for X).
"""

from __future__ import annotations

import math

import numpy as np

from grain_cells.io import FileSet, OpenFiles, RowBuffer, fetch_ranges, open_file

CHUNK_BYTES = 4 << 20  # default chunk of data/indices, uncompressed
CHUNK_BYTES_COMPRESSED = 256 << 10  # same, compressed
MAX_CHUNK_BYTES = (1 << 31) - 1  # HDF5 caps a chunk below 4 GiB; stay well under
_ALIGNED_PASS_VALUES = 1 << 24  # stored values per read when counting aligned rows
_INDPTR_STEP = 1 << 22  # indptr entries per read when counting rows


class Matrix:
    """One row-aligned element of the inputs (`name` in the part), as gathered.

    `lengths`: stored values per output row (CSR, set by `count_rows`).
    """

    def __init__(self, name: str, files: FileSet, check_indices: bool = True):
        self.name = name
        self.files = files
        self.check_indices = check_indices
        self.sparse = files.sparse
        self.dtype = np.dtype(files.dtype)
        self.n_vars = files.num_genes
        self.index_dtype = np.dtype(np.int32 if self.n_vars < 2**31 else np.int64)
        self.nnz = sum(i.nnz for i in files.infos) if self.sparse else None
        self.n_cells = int(files.n_obs.sum())
        self.cell_offsets = np.concatenate([[0], np.cumsum(files.n_obs)])
        maps = [self.column_map(i) for i in range(len(files.paths))]
        self.reorders_genes = any(
            m is not None and (np.diff(m[m >= 0]) < 0).any() for m in maps
        )
        self.lengths: np.ndarray | None = None
        self.buffer = RowBuffer()
        self._handles: OpenFiles | None = None

    def column_map(self, i: int) -> np.ndarray | None:
        """Output column of each column file `i` stores (-1: not output), or None."""
        column_map = self.files.genes.maps[i]
        return None if column_map is None else column_map.out

    @property
    def value_bytes(self) -> int:
        """Bytes of one stored value of a CSR matrix (data plus index)."""
        return self.dtype.itemsize + self.index_dtype.itemsize

    def fetch_ranges(self, starts, stops):
        """Reads sorted global row ranges of one file into this matrix's buffer."""
        if self._handles is None:
            self._handles = OpenFiles(self.files, 0)
        return fetch_ranges(
            self._handles,
            self.cell_offsets,
            starts,
            stops,
            self.buffer,
            check_indices=self.check_indices,
        )

    def close(self) -> None:
        """Closes the inputs' handles (they reopen on the next read)."""
        if self._handles is not None:
            self._handles.close()
            self._handles = None

    def chunk(self, compression, chunk_cells) -> int:
        """Elements per HDF5 chunk of `data`/`indices` (CSR), or rows (dense)."""
        unit = max(self.dtype.itemsize * (1 if self.sparse else self.n_vars), 1)
        if chunk_cells is None:
            n = (CHUNK_BYTES if compression is None else CHUNK_BYTES_COMPRESSED) // unit
        elif self.sparse:
            n = math.ceil(chunk_cells * max(self.nnz / max(self.n_cells, 1), 1.0))
        else:
            n = chunk_cells
        most = MAX_CHUNK_BYTES // 8 if self.sparse else MAX_CHUNK_BYTES // unit
        return int(min(max(n, 1), max(most, 1)))

    def count_rows(self) -> None:
        """Sets `lengths` (int32) from each `indptr`, or aligned rows if genes drop."""
        if not self.sparse or self.lengths is not None:
            return
        out = np.empty(self.n_cells, np.int32)
        offsets = self.cell_offsets
        for i, info in enumerate(self.files.infos):
            column_map = self.column_map(i)
            start, n = int(offsets[i]), int(offsets[i + 1] - offsets[i])
            if column_map is not None and (column_map < 0).any():
                per_cell = max(self.nnz // max(self.n_cells, 1), 1)
                cells = max(1, _ALIGNED_PASS_VALUES // per_cell)
                for a in range(0, n, cells):
                    b = min(a + cells, n)
                    got = self.fetch_ranges([start + a], [start + b])
                    out[start + a : start + b] = np.diff(got.csr.indptr)
                continue
            identity = self.files.identities[i]
            with open_file(identity.path, self.files.storage_options) as f:
                ptr = f[info.element]["indptr"]
                for a in range(0, n, _INDPTR_STEP):
                    b = min(a + _INDPTR_STEP, n)
                    piece = ptr[a : b + 1].astype(np.int64)
                    out[start + a : start + b] = np.diff(piece)
        self.lengths = out
