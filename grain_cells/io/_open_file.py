"""One file's handles in one process: its descriptor, its reader, its obs values.

`open_member` makes them (checked against the file's identity); `OpenFiles`
keeps at most `max_open_files` of them per process (`grain_cells.io._file_lru`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from grain_cells import errors, formats
from grain_cells.io import (
    _direct_csr,
    _file_lru,
    _h5ad,
    _layouts,
    _meta_cache,
    _obs_cache,
)
from grain_cells.io._matrix import CsrReader, DenseReader
from grain_cells.io._obsm import FieldReader, element_reader, inspect_element
from grain_cells.io._open import open_file
from grain_cells.storage import ByteReader


@dataclasses.dataclass
class OpenFile:
    """A file's handles in one process.

    Attributes:
        h5: The open file's root (`Format.open`); None once the reader
            reads only through `fd` (`grain_cells.io._layouts`): the
            format's handle is closed right after the first open.
        fd: The file's `ByteReader` (`Format.open_bytes`); None for formats
            that read through their own store.
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


def open_member(files, i: int, checked: _file_lru.Checked | None = None) -> OpenFile:
    """Opens file `i` of `files` in this process, checking it is unchanged.

    With `checked`: a file this process checked in full before (its record
    there) and whose `stat` is unchanged since is not inspected again; its
    matrix summary and obs values are taken from the record, and when the
    record holds its byte layouts (`_layouts`) the file is not opened
    through its format at all: one descriptor, checked by its `fstat`.
    A local file whose arrays are all read positionally keeps only that
    descriptor open (its format's handle closes once inspected).

    Raises:
        errors.SourceChangedError: The file differs from when `files` was built.
    """
    known = None if checked is None else checked.get(i)
    if known is None and checked is not None:
        known = _first_open(files, i, checked)
    if known is not None and known.layouts is not None:
        return reopen(files, i, known)
    expected = files.infos[i]
    path = expected.path
    identity = files.identities[i]
    fmt = formats.for_path(path)
    if identity.stat.content:
        # An object whose ETag does not follow its content (an HTTP server):
        # its sampled bytes now, before the format trusts metadata cached
        # for it.
        now = fmt.stat_path(path, files.storage_options)
        identity.check_stat(now, "when a process opened it")
    # A store's format takes its stat (a digest) anew as it opens.
    f = open_file(path, files.storage_options, identity.stat)
    try:
        if known is not None:  # unchanged since this process checked it
            identity.check_stat(fmt.stat_of(f, path), "when a process opened it")
            info = known.info
        else:
            info = inspect_element(f, files.element)
            if info.describe() != expected.describe():
                raise errors.SourceChangedError(
                    f"{path}: changed since the AnnDataSource was built: "
                    f"{expected.describe()} then, {info.describe()} now. Build "
                    "a new source (and do not restore iterator state saved "
                    "for the old one)."
                )
            identity.check_stat(fmt.stat_of(f, path), "when a process opened it")
            identity.check_layout(f, "when a process opened it")
        fd = fmt.open_bytes(f, path, files.storage_options, identity.stat)
    except BaseException:
        f.close()
        raise
    try:
        if fd is not None:
            identity.check_stat(fd.stat(), "when a process opened it")
        reader = element_reader(f, info, fd)
        # Mapped from a cache file that every process shares (`_obs_cache`).
        if known is not None:
            obs = known.obs
        else:
            specs = {c: files.obs[c] for c in files.obs_names}
            obs = _obs_cache.file_obs(f, identity, specs, i, info.n_obs)
        layouts = _layouts.layouts_of(reader, fd)
        if checked is not None:
            checked.put(i, info, obs, layouts, fmt)
        fmt.opened(f)
        if layouts is None:
            return OpenFile(f, fd, reader, obs, fmt)
        # Read through the descriptor alone: the format's handle goes now.
        reader = _layouts.reader_of(info, layouts, fd)
        f.close()
        return OpenFile(None, fd, reader, obs, fmt)
    except BaseException:
        if fd is not None:
            fd.close()
        f.close()
        raise


def _first_open(files, i: int, checked: _file_lru.Checked):
    """File `i`'s record from its cached byte layouts (`_meta_cache`), or None."""
    found = _meta_cache.first_open(files, i)
    if found is None:
        return None
    fmt, layouts, obs = found
    checked.put(i, files.infos[i], obs, layouts, fmt)
    return checked.get(i)


def reopen(files, i: int, known) -> OpenFile:
    """`open_member` of a file whose byte layouts this process holds.

    One descriptor, checked (`fstat`) against the file's identity as every
    open is; the reader is rebuilt from the layouts on first use, with no
    format library.
    """
    path = files.infos[i].path
    identity = files.identities[i]
    fmt = known.format
    fd = fmt.open_bytes(None, path, files.storage_options, identity.stat)
    try:
        identity.check_stat(fd.stat(), "when a process opened it")
        if known.flat is False:  # computed once per record, then reused
            known.flat = _direct_csr.flat_from(known.layouts, known.info, fd)
        flat = None if known.flat is None else known.flat.over(fd)
    except BaseException:
        fd.close()
        raise
    return OpenFile(None, fd, None, known.obs, fmt, flat, known.layouts, known.info)


def weight_of(handle: OpenFile) -> int:
    """A handle's weight in the `"auto"` bound (`_file_lru.DEFAULT_BUDGET`)."""
    return 1 if handle.h5 is None else _file_lru.FORMAT_WEIGHT


__all__ = ["OpenFile", "open_member", "reopen", "weight_of"]
