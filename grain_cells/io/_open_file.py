"""One file's handles in one process, and a fetch's files opened directly.

`open_member` opens a file checked against its identity; one read positionally
keeps only its descriptor and reopens from its byte layouts (`reopen`).
`pinned_flats` gives a many-file fetch its files' CSR byte pieces.

Design notes: docs/reference/design.md#io-layouts, #io-direct-open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence

import numpy as np

from grain_cells import errors, formats
from grain_cells.formats import PositionalReader
from grain_cells.io import _direct_csr, _file_lru, _h5ad, _meta_cache, _obs_cache
from grain_cells.io._h5ad import check_content, inspect_element, open_unchanged
from grain_cells.io._identity import fstat_key, stat_key
from grain_cells.io._matrix import CsrReader, DenseReader, FieldReader, element_reader
from grain_cells.io._obs_rows import stacked
from grain_cells.storage import ByteReader, FileStat
from grain_cells.storage.remote import is_url


@dataclasses.dataclass(eq=False)
class OpenFile:
    """A file in one process: what its first full open learnt, and its handles.

    `h5`: the format's handle (None once `fd` alone reads); `flat`: its
    `_direct_csr.Flat` from `layouts` (None: not a plain CSR's). A `Checked`
    record has no handles; a reopen from `layouts` builds its reader on first use.
    """

    info: _h5ad.MatrixInfo
    obs: dict[str, np.ndarray]
    format: formats.Format
    layouts: dict | None = None
    h5: object | None = None
    fd: ByteReader | None = None
    _reader: CsrReader | DenseReader | FieldReader | None = None
    flat: _direct_csr.Flat | None = None

    def __post_init__(self):
        self.obs = stacked(self.obs)  # one slice per file in a fetch
        if self.flat is None and self.layouts is not None:
            self.flat = _direct_csr.flat_from(self.layouts, self.info)

    @property
    def reader(self) -> CsrReader | DenseReader | FieldReader:
        """The matrix's row reader."""
        if self._reader is None:
            self._reader = reader_of(self.info, self.layouts, self.fd)
        return self._reader

    @property
    def nbytes(self) -> int:
        """A record's weight in `Checked`: its arrays, layouts and objects."""
        arrays = [*self.obs.values(), *(self.layouts or {}).values()]
        total = sum(int(getattr(a, "nbytes", 0)) for a in arrays)
        return _file_lru.RECORD_OVERHEAD_BYTES + total

    def close(self) -> None:
        """Closes the descriptor and the file."""
        if self.fd is not None:
            self.fd.close()
            self.fd = None
        if self.h5 is not None:
            self.h5.close()
            self.h5 = None


def open_member(files, i: int, checked: _file_lru.Checked | None = None) -> OpenFile:
    """Opens file `i` of `files`, checked; one known (record, entry): not inspected."""
    known = None if checked is None else checked.get(i)
    if known is None and checked is not None and (found := first_open(files, i)):
        checked.put(i, found[0])
        return reopen(files, i, *found)
    when = "when a process opened it"
    if known is not None and known.layouts is not None:
        if is_url(known.info.path):  # its sampled bytes read again where due
            check_content(files.identities[i], files.storage_options, when)
        return reopen(files, i, known)
    identity = files.identities[i]
    expected = files.infos[i]
    path = expected.path
    fmt = formats.for_path(path)
    # Its stat checked (an object's sampled bytes, where its ETag does not
    # follow its content) before the format trusts metadata cached for it.
    f = open_unchanged(identity, files.storage_options, when)
    try:
        if known is not None:  # unchanged since this process checked it
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
            identity.check_layout(f, when)
        fd = open_bytes(files, i, fmt, f)
    except BaseException:
        f.close()
        raise
    try:
        reader = element_reader(f, info, fd)
        if known is not None:
            obs = known.obs
        else:  # mapped from a cache file that every process shares
            specs = {c: files.obs[c] for c in files.obs_names}
            obs = _obs_cache.file_obs(f, identity, specs, i, info.n_obs)
        layouts = _meta_cache.layouts_of(reader, fd, identity)
        record = OpenFile(info, obs, fmt, layouts)
        if checked is not None:
            checked.put(i, record)
        fmt.opened(f)
        if record.layouts is None:  # (its obs stacked once, shared)
            return OpenFile(info, record.obs, fmt, None, f, fd, reader)
        f.close()  # read through the descriptor alone: the format's handle goes
        return reopen(files, i, record, fd)
    except BaseException:
        if fd is not None:
            fd.close()
        f.close()
        raise


def first_open(files, i: int) -> tuple[OpenFile, ByteReader] | None:
    """A process's first open of file `i` from its metadata entry, or None.

    None for what has no entry to read (`entry_open`) and for files whose
    obs columns come from the shared obs cache (`_obs_cache.MIN_CELLS`).
    """
    info = files.infos[i]
    if files.obs_names and info.n_obs >= _obs_cache.MIN_CELLS:
        return None
    fmt = formats.for_path(info.path)
    found = entry_open(files, i, fmt)
    if found is None:
        return None
    (obs, layouts), fd = found
    return OpenFile(info, obs, fmt, layouts), fd


def entry_open(files, i: int, fmt) -> tuple[tuple, ByteReader] | None:
    """`(entry_of's (obs, layouts), fd)` of file `i` over its checked `fd`, or None.

    None for what has no entry to read: stores and files not cached. An object
    whose ETag does not follow its content has its sampled bytes read first.
    """
    identity = files.identities[i]
    if not (identity.local or identity.is_object):
        return None
    check_content(identity, files.storage_options, "when a process opened it")
    fd = open_bytes(files, i, fmt)
    try:  # (an object's pins raise what a failing store says)
        found = None if fd is None else _meta_cache.entry_of(files, i, fd)
    except BaseException:
        fd.close()
        raise
    if found is None and fd is not None:
        fd.close()
    return None if found is None else (found, fd)


def reopen(files, i: int, known: OpenFile, fd: ByteReader | None = None) -> OpenFile:
    """`open_member` of a file whose byte layouts this process holds: one descriptor.

    `fd`: its descriptor, opened and checked already (else opened here).
    """
    if fd is None:
        fd = open_bytes(files, i, known.format)
    return OpenFile(
        known.info, known.obs, known.format, known.layouts, None, fd, None, known.flat
    )


def open_bytes(files, i: int, fmt, f=None) -> ByteReader | None:
    """File `i`'s `ByteReader` as `fmt` opens it (None: none), its `fstat` checked."""
    identity = files.identities[i]
    path, options = files.infos[i].path, files.storage_options
    fd = fmt.open_bytes(f, path, options, identity.stat)
    if fd is not None:
        try:
            identity.check_stat(fd.stat(), "when a process opened it")
        except BaseException:
            fd.close()
            raise
    return fd


def reader_of(info, layouts: dict, fd) -> CsrReader | DenseReader | FieldReader:
    """The matrix reader of `info` over `fd`, from `layouts_of`'s layouts."""
    arrays = {k: PositionalReader(v, info.path, fd) for k, v in layouts.items()}
    kinds = {FieldReader.KEY: FieldReader, DenseReader.KEY: DenseReader}
    cls = next((kinds[k] for k in arrays if k in kinds), CsrReader)
    if fd.remote and "indptr" in arrays:  # one GET, as `CsrReader.open` pins it
        arrays["indptr"].pin()
    return cls(info, arrays, fd)


@contextlib.contextmanager
def pinned_flats(handles, indices: Sequence[int], *, hint=False) -> Iterator[tuple]:
    """`(flats, fds, obs)` of files `indices` for `_direct_csr` (flat None: not so).

    Closed files whose `Flat` their record holds through descriptors of the
    call's own (a fetch makes room in the bound), other files of a fetch through
    the bound (pinned, checked); a `hint` neither opens nor marks files used.
    """
    files = handles.files
    entries = handles.pin_if_open(indices, touch=not hint)
    n = len(indices)
    flats: list = [None] * n
    fds = [-1] * n
    obs: list = [None] * n
    closed = [k for k, entry in enumerate(entries) if entry is None]
    own: list[int] = []  # descriptors opened here
    slow: list[int] = []  # positions of a fetch's files opened through the bound
    try:
        for k, entry in enumerate(entries):
            if entry is not None:
                if not hint:
                    handles.check_at_read(indices[k], entry.handle)
                flats[k], fds[k], obs[k] = _of_handle(entry.handle)
        if hint:
            records = [handles._checked.peek(indices[k]) for k in closed]
        else:
            handles.reserve(len(closed))  # the fetch's own descriptors fit the bound
            records = handles._checked.get_many([indices[k] for k in closed])
        for k, record in zip(closed, records, strict=True):
            flat = None if record is None else record.flat
            fd = None if flat is None else _open_known(files, indices[k])
            if fd is None:  # pieces not known yet, or gone or changed
                slow.append(k)
                continue
            own.append(fd)
            flats[k], fds[k], obs[k] = flat, fd, record.obs
        slow = [] if hint else slow
        with handles.pinned([indices[k] for k in slow], at_read=True) as opened:
            for k, handle in zip(slow, opened, strict=True):
                flats[k], fds[k], obs[k] = _of_handle(handle)
            yield flats, fds, obs
    finally:
        for fd in own:
            os.close(fd)
        handles.release(entries)


def _of_handle(handle: OpenFile) -> tuple:
    """`(flat, fd, obs)` of an open file for `pinned_flats` (flat None: not so)."""
    flat = handle.flat
    return flat, -1 if flat is None else handle.fd.fd, handle.obs


def _open_known(files, i: int) -> int | None:
    """A descriptor of file `i` whose `fstat` matches its identity, or None.

    Raises `SourceChangedError` if it changed; None if it changed in nothing a
    read depends on, or is gone (its open through the bound says how).
    """
    identity = files.identities[i]
    try:
        fd = os.open(files.infos[i].path, os.O_RDONLY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if fstat_key(st) == stat_key(identity.stat):
            return fd
        identity.check_stat(FileStat.of(st), "when a process opened it")
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None
