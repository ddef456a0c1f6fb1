"""A many-file fetch's files, opened for that fetch alone when their layouts are known.

`pinned_flats` gives a many-file fetch its files' `Flat`s: files open in
the bound (`grain_cells.io._file_lru`) as they are, a closed file whose CSR
pieces this process holds (its `Checked` record's `flat`) through a
descriptor of the fetch's own (`os.open`, `fstat` compared with its
identity, `os.close`; room reserved by `FileLru.reserve`), anything else
through the bound. `hint_flats` is the same for a read-ahead hint, with
bare descriptors for the closed files.

Design notes: docs/reference/design.md#io-direct-open.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

from grain_cells.io import _direct_csr
from grain_cells.storage import FileStat, LocalByteReader


@contextlib.contextmanager
def pinned_flats(
    handles, lru, checked, indices: Sequence[int]
) -> Iterator[tuple | None]:
    """`(flats, fds, obs)` of files `indices` for `_direct_csr.read`, or None.

    `flats[k]` is file `indices[k]`'s `_direct_csr.Flat`, `fds[k]` a
    descriptor of it open until the block ends, `obs[k]` its obs values.
    None when a file is not read positionally (the caller reads file by
    file). `handles`' bound `lru` and records `checked` (`OpenFiles.pinned_flats`).

    Raises:
        errors.SourceChangedError: A file differs from when the source was built.
    """
    files = handles.files
    entries = lru.pin_if_open(indices)
    closed = [i for i, e in zip(indices, entries, strict=True) if e is None]
    # The fetch's own descriptors fit within the bound: room is made once
    # (the bound only grows again by files opened through it).
    lru.reserve(len(closed))
    records = iter(checked.get_many(closed))
    own: list[int] = []  # descriptors opened here
    readers: list = []  # `ByteReader`s of `_first_reader`
    slow: list[int] = []  # positions of files opened through the bound
    identities, infos = files.identities, files.infos
    n = len(indices)
    flats: list = [None] * n
    fds = [-1] * n
    obs: list = [None] * n
    try:
        for k, (i, entry) in enumerate(zip(indices, entries, strict=True)):
            if entry is not None:
                handle = entry.handle
                _check_held(handles, i, handle)
                if handle.flat is False:
                    handle.flat = _direct_csr.flat_of(handle.reader, handle.fd)
                flats[k], obs[k] = handle.flat, handle.obs
                continue
            record = next(records)
            if record is not None and record.flat is False and record.layouts:
                # Its pieces, once, through a descriptor of its format's.
                readers.append(_first_reader(files, i, record))
                if isinstance(record.flat, _direct_csr.Flat):
                    flats[k], obs[k] = record.flat, record.obs
                    continue
            flat = None if record is None else record.flat
            if not isinstance(flat, _direct_csr.Flat):  # unknown yet: the bound
                slow.append(k)
                continue
            fd = open_checked(identities[i], infos[i].path)
            if fd is None:  # gone or changed: the bound's open says how
                slow.append(k)
                continue
            own.append(fd)
            flats[k], fds[k], obs[k] = flat, fd, record.obs
        if not slow:
            yield _valid(flats, fds, obs)
            return
        with handles.pinned([indices[k] for k in slow], at_read=True) as opened:
            for k, handle in zip(slow, opened, strict=True):
                if handle.flat is False:
                    handle.flat = _direct_csr.flat_of(handle.reader, handle.fd)
                flats[k], obs[k] = handle.flat, handle.obs
            yield _valid(flats, fds, obs)
    finally:
        for fd in own:
            os.close(fd)
        for reader in readers:
            reader.close()
        lru.release([e for e in entries if e is not None])


def _check_held(handles, i: int, handle) -> None:
    """`handles.check_at_read` of an open file: its `fstat` compared first."""
    reader = handle.fd
    if isinstance(reader, LocalByteReader) and handles.files.identities[i].stat.matches(
        os.fstat(reader.fd)
    ):
        return
    handles.check_at_read(i, handle)


@contextlib.contextmanager
def hint_flats(lru, checked, files, indices: Sequence[int]) -> Iterator[tuple]:
    """`(flats, fds, rest)` of files `indices` for one read-ahead hint.

    `flats[k]`, `fds[k]`: file `indices[k]`'s `_direct_csr.Flat` and a
    descriptor of it open until the block ends, or None and -1: not hinted
    here. An open file as it is (pinned, its place in the bound unchanged);
    a closed one whose pieces this process knows through a bare descriptor
    of the hint's own (`os.open` alone: a hint's reads stay inside the
    file's known pieces and its pointers are checked against its `nnz`, so
    a file changed since is hinted harmlessly, a gone one not at all; the
    read checks and reports both). `rest`: positions of files to hint one by
    one through `OpenFiles.for_hints` (open, not read positionally; or
    closed with byte layouts whose pieces are not known yet). Files with
    nothing known are in neither (hinting them would cost a format open).
    """
    entries = lru.pin_if_open(indices, touch=False)
    n = len(indices)
    flats: list = [None] * n
    fds = [-1] * n
    rest: list[int] = []
    own: list[int] = []
    infos = files.infos
    try:
        for k, (i, entry) in enumerate(zip(indices, entries, strict=True)):
            if entry is not None:
                handle = entry.handle
                if handle.flat is False:
                    handle.flat = _direct_csr.flat_of(handle.reader, handle.fd)
                if handle.flat is None:
                    rest.append(k)
                else:
                    flats[k], fds[k] = handle.flat, handle.flat.fd
                continue
            record = checked.peek(i)  # not marked used: a hint
            if record is None or record.layouts is None:
                continue
            if not isinstance(record.flat, _direct_csr.Flat):
                if record.flat is False:  # pieces not known yet: reopen once
                    rest.append(k)
                continue
            try:
                fd = os.open(infos[i].path, os.O_RDONLY)
            except OSError:  # gone: the read reports it
                continue
            own.append(fd)
            flats[k], fds[k] = record.flat, fd
        yield flats, fds, rest
    finally:
        for fd in own:
            os.close(fd)
        lru.release([e for e in entries if e is not None])


def _first_reader(files, i: int, record):
    """File `i`'s `ByteReader` as its format opens it; sets `record.flat`.

    `record.flat`: the file's `Flat` (or None: not so) from its byte layouts,
    as `_open_file.reopen` computes it.
    """
    identity = files.identities[i]
    reader = record.format.open_bytes(
        None, files.infos[i].path, files.storage_options, identity.stat
    )
    try:
        identity.check_stat(reader.stat(), "when a process opened it")
        record.flat = _direct_csr.flat_from(record.layouts, record.info, reader)
    except BaseException:
        reader.close()
        raise
    return reader


def _valid(flats: list, fds: list, obs: list) -> tuple | None:
    """`(flats, fds, obs)` when every file has a `Flat`, all of one dtype.

    A file without a descriptor of its own in `fds` is read through its
    flat's (one open in the bound, or just opened).
    """
    if any(f is None for f in flats) or len({f.dtypes for f in flats}) != 1:
        return None
    fds = [f.fd if d < 0 else d for f, d in zip(flats, fds, strict=True)]
    return flats, fds, obs


def open_checked(identity, path: str) -> int | None:
    """A descriptor of `path` whose `fstat` matches `identity`, or None."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if not identity.stat.matches(st):
        os.close(fd)
        identity.check_stat(FileStat.of(st), "when a process opened it")
        return None  # changed in nothing a read depends on: through the bound
    return fd


__all__ = ["hint_flats", "open_checked", "pinned_flats"]
