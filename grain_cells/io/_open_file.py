"""One file's handles in one process, and a fetch's or hint's files opened directly.

`open_member` opens a file checked against its identity; one read positionally
keeps only its descriptor and reopens from its byte layouts (`reopen`).
`pinned_flats`/`hint_flats` give a fetch or hint its files' CSR byte pieces.

Design notes: docs/reference/design.md#io-layouts, #io-direct-open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
from collections.abc import Iterator, Sequence

import numpy as np

from grain_cells import errors, formats
from grain_cells.formats import PositionalReader
from grain_cells.io import _direct_csr, _file_lru, _h5ad, _meta_cache, _obs_cache
from grain_cells.io._h5ad import inspect_element, open_unchanged
from grain_cells.io._identity import fstat_key, stat_key
from grain_cells.io._matrix import CsrReader, DenseReader, FieldReader, element_reader
from grain_cells.io._obs_rows import stacked
from grain_cells.storage import ByteReader, FileStat, LocalByteReader

_DTYPES_OF = operator.attrgetter("dtypes")


@dataclasses.dataclass(eq=False)
class OpenFile:
    """A file in one process: what its first full open learnt, and its handles.

    `h5`: the format's handle (None once `fd` alone reads); `flat`: its
    `_direct_csr.Flat` (None: not so; False: not asked yet). A `Checked` record
    has no handles; a reopen from `layouts` builds its reader on first use.
    """

    info: _h5ad.MatrixInfo
    obs: dict[str, np.ndarray]
    format: formats.Format
    layouts: dict | None = None
    h5: object | None = None
    fd: ByteReader | None = None
    _reader: CsrReader | DenseReader | FieldReader | None = None
    flat: object = False
    want: tuple | None = None  # (path, stat fields) a fetch's own open checks

    def __post_init__(self):
        self.obs = stacked(self.obs)  # one slice per file in a fetch

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
    if known is not None and known.layouts is not None:
        return reopen(files, i, known)
    expected = files.infos[i]
    path = expected.path
    identity = files.identities[i]
    fmt = formats.for_path(path)
    when = "when a process opened it"
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
        obs = stacked(obs)  # once: the record and the handle share it
        layouts = _meta_cache.layouts_of(reader, fd)
        if checked is not None:
            checked.put(i, OpenFile(info, obs, fmt, layouts))
        fmt.opened(f)
        if layouts is None:
            return OpenFile(info, obs, fmt, None, f, fd, reader)
        f.close()  # read through the descriptor alone: the format's handle goes
        return OpenFile(info, obs, fmt, layouts, None, fd)
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

    None for what has no entry to read: remote files, stores, files not cached.
    """
    if not files.identities[i].local:
        return None
    fd = open_bytes(files, i, fmt)
    found = None if fd is None else _meta_cache.entry_of(files, i, fd)
    if found is None and fd is not None:
        fd.close()
    return None if found is None else (found, fd)


def reopen(files, i: int, known: OpenFile, fd: ByteReader | None = None) -> OpenFile:
    """`open_member` of a file whose byte layouts this process holds: one descriptor.

    `fd`: its descriptor, opened and checked already (else opened here).
    """
    if fd is None:
        fd = open_bytes(files, i, known.format)
    try:
        learn_flat(known, fd)
    except BaseException:
        fd.close()
        raise
    flat = None if known.flat is None else known.flat.over(fd)
    return OpenFile(
        known.info, known.obs, known.format, known.layouts, None, fd, None, flat
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


def learn_flat(record: OpenFile, fd=None):
    """`record.flat` from its layouts over `fd` (a handle's own), once per record."""
    if record.flat is False and record.layouts is None:
        record.flat = None  # some array is not positional over a local descriptor
    elif record.flat is False:
        fd = record.fd if fd is None else fd
        record.flat = _direct_csr.flat_from(record.layouts, record.info, fd)
    return record.flat


def reader_of(info, layouts: dict, fd) -> CsrReader | DenseReader | FieldReader:
    """The matrix reader of `info` over `fd`, from `layouts_of`'s layouts."""
    arrays = {k: PositionalReader(v, info.path, fd) for k, v in layouts.items()}
    kinds = {FieldReader.KEY: FieldReader, DenseReader.KEY: DenseReader}
    cls = next((kinds[k] for k in arrays if k in kinds), CsrReader)
    return cls(info, arrays, fd)


@contextlib.contextmanager
def pinned_flats(handles, indices: Sequence[int]) -> Iterator[tuple | None]:
    """`(flats, fds, obs)` of files `indices` for `_direct_csr.read`, or None.

    Closed files with known pieces through descriptors of the fetch's own (room
    made in the bound), others through the bound; None if one is not positional.
    """
    files, checked = handles.files, handles._checked
    entries = handles.pin_if_open(indices)
    n = len(indices)
    flats: list = [None] * n
    fds = [-1] * n
    obs: list = [None] * n
    closed: list[int] = []  # positions of files not open in the bound
    own: list[int] = []  # descriptors opened here
    readers: list = []  # byte readers opened to learn a record's pieces
    slow: list[int] = []  # positions of files opened through the bound
    try:
        for k, entry in enumerate(entries):
            if entry is None:
                closed.append(k)
                continue
            i, handle = indices[k], entry.handle
            reader = handle.fd
            if not (
                isinstance(reader, LocalByteReader)
                and files.identities[i].stat.matches(os.fstat(reader.fd))
            ):
                handles.check_at_read(i, handle)
            flats[k], obs[k] = learn_flat(handle), handle.obs
        handles.reserve(len(closed))  # the fetch's own descriptors fit the bound
        records = checked.get_many([indices[k] for k in closed])
        for k, record in zip(closed, records, strict=True):
            flat = None if record is None else record.flat
            if flat is False and record.layouts:
                # Its pieces, once, through a descriptor its format opens.
                readers.append(open_bytes(files, indices[k], record.format))
                learn_flat(record, readers[-1])
                flat = record.flat
                if isinstance(flat, _direct_csr.Flat):  # read over that one
                    flats[k], obs[k] = flat, record.obs
                    continue
            # Unknown pieces, or gone or changed: the bound's open says how.
            known = flat.__class__ is _direct_csr.Flat
            fd = _open_known(files, indices[k], record) if known else None
            if fd is None:
                slow.append(k)
                continue
            own.append(fd)
            flats[k], fds[k], obs[k] = flat, fd, record.obs
        if not slow:
            yield _valid(flats, fds, obs)
            return
        with handles.pinned([indices[k] for k in slow], at_read=True) as opened:
            for k, handle in zip(slow, opened, strict=True):
                flats[k], obs[k] = learn_flat(handle), handle.obs
            yield _valid(flats, fds, obs)
    finally:
        for fd in own:
            os.close(fd)
        for reader in readers:
            reader.close()
        handles.release(entries)


@contextlib.contextmanager
def hint_flats(handles, indices: Sequence[int]) -> Iterator[tuple]:
    """`(flats, fds, rest)` of files `indices` for one read-ahead hint.

    Closed files with known pieces through bare descriptors (None, -1: not
    hinted here); `rest`: positions to hint one by one (`OpenFiles.for_hints`).
    """
    files, checked = handles.files, handles._checked
    entries = handles.pin_if_open(indices, touch=False)
    n = len(indices)
    flats: list = [None] * n
    fds = [-1] * n
    rest: list[int] = []
    own: list[int] = []
    try:
        for k, (i, entry) in enumerate(zip(indices, entries, strict=True)):
            if entry is not None:
                flat = learn_flat(entry.handle)
                if flat is None:
                    rest.append(k)
                else:
                    flats[k], fds[k] = flat, flat.fd
                continue
            record = checked.peek(i)  # not marked used: a hint
            flat = None if record is None or record.layouts is None else record.flat
            if flat is False:  # pieces not known yet: reopen once
                rest.append(k)
            if not isinstance(flat, _direct_csr.Flat):
                continue
            try:
                fd = os.open(files.infos[i].path, os.O_RDONLY)
            except OSError:  # gone: the read reports it
                continue
            own.append(fd)
            flats[k], fds[k] = record.flat, fd
        yield flats, fds, rest
    finally:
        for fd in own:
            os.close(fd)
        handles.release(entries)


def _valid(flats: list, fds: list, obs: list) -> tuple | None:
    """`(flats, fds, obs)` when every file has a `Flat`, all of one dtype."""
    if None in flats:
        return None
    dtypes = flats[0].dtypes  # interned: one object per dtype triple
    if len(set(map(id, map(_DTYPES_OF, flats)))) != 1 and any(
        f.dtypes != dtypes for f in flats
    ):
        return None
    fds = [f.fd if d < 0 else d for f, d in zip(flats, fds, strict=True)]
    return flats, fds, obs


def _open_known(files, i: int, record: OpenFile) -> int | None:
    """A descriptor of file `i` whose `fstat` matches its identity, or None.

    The path and stat fields are kept on its record; None also for a file
    whose identity is not a local stat (its open through the bound checks it).
    """
    want = record.want
    if want is None:
        identity = files.identities[i]
        if not identity.local:
            return None
        want = record.want = (files.infos[i].path, stat_key(identity.stat))
    try:
        fd = os.open(want[0], os.O_RDONLY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if fstat_key(st) != want[1]:
        os.close(fd)
        files.identities[i].check_stat(FileStat.of(st), "when a process opened it")
        return None  # changed in nothing a read depends on: through the bound
    return fd
