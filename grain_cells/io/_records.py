"""A file set's per-file records (`MatrixInfo`, `FileIdentity`) held as columns.

Every process (each Grain worker unpickles the source) holds them: as objects
about 820 bytes a file (14 objects), as columns about 110. `infos` and
`identities` are read-only sequences that build a record on `[i]`.

Design notes: docs/reference/design.md#io-file-set.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Sequence

import numpy as np

from grain_cells.io._h5ad import MatrixInfo
from grain_cells.io._identity import FileIdentity, content_entry, stat_key
from grain_cells.storage import FileStat

_INFO = ("element", "encoding", "n_obs", "n_vars", "dtype", "nnz", "chunk_bytes")
_KEY = ("ino", "dev", "size", "mtime_ns", "ctime_ns")  # `stat_key`'s fields
_TAGS = operator.attrgetter("etag", "content", "store")  # `FileStat`'s strings
_IDENTITY = ("element", "layout", "sample", "format")


class _Column:
    """One field over the files, in the narrowest of four forms that holds it
    exactly: one value (`same`); `int`s or None as offsets from the least, in
    the narrowest unsigned type (None: the top code); lowercase hex strings of
    one length as their bytes; else each file's code into its distinct values.
    """  # noqa: D205

    __slots__ = ("codes", "kind", "n", "values")

    def __init__(self, values: list):
        self.n = len(values)
        keys = [(type(v), v) for v in values]  # (3 == np.int64(3): kept apart)
        distinct = {key: k for k, key in enumerate(dict.fromkeys(keys))}
        if len(distinct) <= 1:
            self.kind, self.codes = "same", None
            self.values = values[0] if values else None
        elif _ints(values):
            low = min(v for v in values if v is not None)
            top = max(v for v in values if v is not None) - low + 1
            codes = [top if v is None else v - low for v in values]
            self.kind, self.values = "int", (low, top)
            self.codes = np.array(codes, np.min_scalar_type(top))
        elif _hexes(values):
            raw = np.frombuffer(bytes.fromhex("".join(values)), np.uint8)
            self.kind, self.values, self.codes = "hex", None, raw.reshape(self.n, -1)
        else:
            codes = [distinct[key] for key in keys]
            self.kind, self.values = "code", tuple(v for _, v in distinct)
            self.codes = np.array(codes, np.min_scalar_type(len(distinct)))

    def __getitem__(self, i: int):
        kind = self.kind
        if kind == "same":
            return self.values
        if kind == "int":
            low, top = self.values
            code = int(self.codes[i])
            return None if code == top else low + code
        if kind == "hex":
            return self.codes[i].tobytes().hex()
        return self.values[self.codes[i]]

    def tolist(self) -> list:
        """Every file's value."""
        kind, values = self.kind, self.values
        if kind == "same":
            return [values] * self.n
        if kind == "code":
            return [values[c] for c in self.codes.tolist()]
        if kind == "hex":
            text, w = self.codes.tobytes().hex(), 2 * self.codes.shape[1]
            return [text[k : k + w] for k in range(0, len(text), w)]
        low, top = values
        return [None if c == top else low + c for c in self.codes.tolist()]


def _ints(values: list) -> bool:
    """Whether `values` are `int`s (not bools, not NumPy's) or None, spanning
    less than 2**63 (an offset and None's code fit in an unsigned type).
    """  # noqa: D205
    if not all(v is None or type(v) is int for v in values):
        return False
    ints = [v for v in values if v is not None]
    return bool(ints) and max(ints) - min(ints) < 2**63


def _hexes(values: list) -> bool:
    """Whether `values` are lowercase hex strings of one even length (digests)."""
    if not all(type(v) is str for v in values) or len({len(v) for v in values}) > 1:
        return False
    try:
        return all(len(v) and bytes.fromhex(v).hex() == v for v in values)
    except ValueError:
        return False


class FileRecords:
    """Each file's `MatrixInfo` and `FileIdentity` fields as `_Column`s.

    `paths`: the file set's; records whose paths differ keep their own.
    `stat_keys`: each file's `stat_key` (int64 unless a field is not an `int`
    of int64: then objects), one row compared at every read (`check_stat`).
    """

    __slots__ = (
        "identity",
        "identity_paths",
        "info",
        "info_paths",
        "paths",
        "stat_keys",
    )

    def __init__(self, paths: tuple, infos: Sequence, identities: Sequence):
        self.paths = paths
        self.identity_paths = _own_paths(paths, [d.path for d in identities])
        self.identity = {n: _column(identities, n) for n in _IDENTITY}
        stats = [d.stat for d in identities]
        self.identity["tags"] = _Column([_TAGS(s) for s in stats])
        keys = [stat_key(s) for s in stats]
        fits = all(type(v) is int and -(2**63) <= v < 2**63 for k in keys for v in k)
        self.stat_keys = np.array(keys, np.int64 if fits else object).reshape(-1, 5)
        self._set_infos(infos)

    def _set_infos(self, infos: Sequence) -> None:
        self.info_paths = _own_paths(self.paths, [i.path for i in infos])
        self.info = {n: _column(infos, n) for n in _INFO}

    def with_infos(self, infos: Sequence) -> FileRecords:
        """These identities beside other `infos` (another element's)."""
        out = object.__new__(FileRecords)
        out.paths, out.identity_paths = self.paths, self.identity_paths
        out.identity, out.stat_keys = self.identity, self.stat_keys
        out._set_infos(infos)
        return out

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def infos(self) -> Sequence[MatrixInfo]:
        """Each file's `MatrixInfo` (built on `[i]`)."""
        return _Records(self, FileRecords.info_at, FileRecords._all_infos)

    @property
    def identities(self) -> Sequence[FileIdentity]:
        """Each file's `FileIdentity` (built on `[i]`)."""
        return _Records(self, FileRecords.identity_at, FileRecords._all_identities)

    def _all_infos(self) -> Iterator[MatrixInfo]:
        """Every `MatrixInfo`, column by column (a loop over `[i]` costs ~5x)."""
        columns = [self.info[n].tolist() for n in _INFO]
        paths = self.info_paths or self.paths
        return itertools.starmap(MatrixInfo, zip(paths, *columns, strict=True))

    def _all_identities(self) -> Iterator[FileIdentity]:
        """Every `FileIdentity`, column by column."""
        c = self.identity
        keys, tags = self.stat_keys.tolist(), c["tags"].tolist()
        stats = (
            FileStat(dev, ino, *rest, *t)
            for (ino, dev, *rest), t in zip(keys, tags, strict=True)
        )
        parts = [c[n].tolist() for n in _IDENTITY]
        paths = self.identity_paths or self.paths
        rows = zip(paths, parts[0], stats, *parts[1:], strict=True)
        return itertools.starmap(FileIdentity, rows)

    def info_at(self, i: int) -> MatrixInfo:
        """File `i`'s `MatrixInfo`."""
        path = (self.info_paths or self.paths)[i]
        return MatrixInfo(path, *(self.info[n][i] for n in _INFO))

    def identity_at(self, i: int) -> FileIdentity:
        """File `i`'s `FileIdentity`."""
        path, c = (self.identity_paths or self.paths)[i], self.identity
        element, layout, sample, fmt = (c[n][i] for n in _IDENTITY)
        return FileIdentity(path, element, self.stat_at(i), layout, sample, fmt)

    def stat_at(self, i: int) -> FileStat:
        """File `i`'s `FileIdentity.stat`."""
        ino, dev, *rest = self.stat_keys[i].tolist()
        return FileStat(dev, ino, *rest, *self.identity["tags"][i])

    def contents(self) -> list[dict]:
        """Each file's cells and `FileIdentity.content()`, column by column."""
        c = self.identity
        parts = [c[n].tolist() for n in ("format", "element", "layout", "sample")]
        sizes, cells = self.stat_keys[:, 2].tolist(), self.info["n_obs"].tolist()
        return [
            {"cells": n, **content_entry(f, e, size, layout, sample)}
            for n, f, e, layout, sample, size in zip(cells, *parts, sizes, strict=True)
        ]

    def column(self, name: str) -> list:
        """Every file's `MatrixInfo` field `name` (`n_obs`, `nnz`, ...)."""
        return self.info[name].tolist()

    def check_stat(self, i: int, now: FileStat, when: str) -> None:
        """`FileIdentity.check_stat` of file `i` (its record built only if changed)."""
        tags = self.identity["tags"]
        if list(stat_key(now)) != self.stat_keys[i].tolist() or _TAGS(now) != tags[i]:
            self.identity_at(i).check_stat(now, when)


def _column(records: Sequence, name: str) -> _Column:
    return _Column([getattr(r, name) for r in records])


def _own_paths(paths: tuple, own: list) -> tuple:
    """`own` paths where they differ from `paths`, else () (the set's)."""
    return () if tuple(own) == paths else tuple(own)


class _Records(Sequence):
    """A read-only sequence of records built on `[i]` by `at(records, i)`."""

    __slots__ = ("all", "at", "records")

    def __init__(self, records: FileRecords, at, all_):
        self.records, self.at, self.all = records, at, all_

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(len(self))[i]]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"file {i} of {n}")
        return self.at(self.records, i % n)

    def __iter__(self):
        return self.all(self.records)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)
