"""One file's handles in one process: its descriptor, its reader, its obs values.

`grain_cells.io._file_set.open_member` makes them; `OpenFiles` keeps at most
`max_open_files` of them per process (`grain_cells.io._file_lru`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from grain_cells import formats
from grain_cells.io import _h5ad, _layouts
from grain_cells.io._matrix import CsrReader, DenseReader
from grain_cells.io._obsm import FieldReader
from grain_cells.storage import ByteReader


@dataclasses.dataclass
class OpenFile:
    """A file's handles in one process.

    Attributes:
        h5: The open file's root (`Format.open`); None once the reader
            reads only through `fd` (`grain_cells.io._layouts`): the
            format's handle is closed right after the first open.
        fd: The file's `ByteReader` (`Format.open_bytes`); None for formats
            that read through their own store (zarr).
        reader: The matrix's row reader (a property; made on first use
            for a file reopened from its byte layouts).
        obs: The obs columns read with every cell, in shared codes.
        format: The file's format (checks at each read).
        flat: Its CSR arrays as byte spans (`_direct_csr.flat_of`), None
            if not so, False until a fetch first asks.
    """

    h5: object | None
    fd: ByteReader | None
    _reader: CsrReader | DenseReader | FieldReader | None
    obs: dict[str, np.ndarray]
    format: formats.Format
    flat: object = False
    # Reopened from byte layouts: the reader is built on first use (a
    # fetch over positional CSR files needs only `flat`).
    layouts: dict | None = None
    info: _h5ad.MatrixInfo | None = None

    @property
    def reader(self) -> CsrReader | DenseReader | FieldReader:
        """The matrix's row reader."""
        if self._reader is None:
            self._reader = _layouts.reader_of(self.info, self.layouts, self.fd)
        return self._reader

    def close(self) -> None:
        """Closes the descriptor and the file."""
        if self.fd is not None:
            self.fd.close()
            self.fd = None
        if self.h5 is not None:
            self.h5.close()
            self.h5 = None


__all__ = ["OpenFile"]
