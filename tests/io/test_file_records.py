"""A file set's per-file records held as columns (`io._records.FileRecords`).

A source over many files keeps each file's `MatrixInfo` and `FileIdentity`
as columns, not objects; `files.infos[i]` and `files.identities[i]` must
still be exactly the records the build took, in the build's process and in
one that unpickled the source, and a file changed since must be refused.
Files are written by anndata; the value at (global row r, gene j) is
`r * 10 + j + 1`.
"""

from __future__ import annotations

import dataclasses
import pickle

import anndata
import numpy as np
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.errors import SourceChangedError
from grain_cells.io import FileIdentity, MatrixInfo, inspect_matrix, open_file
from grain_cells.io._records import FileRecords
from grain_cells.storage import FileStat

N_FILES = 300
GENES = 4


def _write(path: str, first: int, n: int) -> None:
    rows = np.arange(first, first + n)
    values = rows[:, None] * 10 + np.arange(GENES)[None, :] + 1.0
    values[(rows[:, None] + np.arange(GENES)[None, :]) % 3 == 0] = 0
    anndata.AnnData(X=sp.csr_matrix(values.astype(np.float32))).write_h5ad(path)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("records")
    out, first = [], 0
    for f in range(N_FILES):
        n = 1 + f % 7  # cells, stored values and layouts differ between files
        out.append(str(folder / f"part{f:03d}.h5ad"))
        _write(out[-1], first, n)
        first += n
    return out


def _taken(path: str) -> tuple[MatrixInfo, FileIdentity]:
    """What the build records of a file, taken afresh."""
    with open_file(path) as f:
        return inspect_matrix(f, "X"), FileIdentity.take(f, path, "X")


def test_records_are_the_files_records_before_and_after_a_pickle(paths):
    source = grain_cells.AnnDataSource(paths, block_size=2)
    copy = pickle.loads(pickle.dumps(source))
    try:
        for files in (source.files, copy.files):
            assert len(files.infos) == len(files.identities) == N_FILES
            for i, path in enumerate(paths):
                info, identity = _taken(path)
                assert files.infos[i] == info and files.identities[i] == identity
                assert repr(files.identities[i]) == repr(identity)
            assert files.n_obs.tolist() == [1 + f % 7 for f in range(N_FILES)]
            assert [i.n_obs for i in files.infos[-3:]] == files.n_obs[-3:].tolist()
        assert copy.file_identity(5).content() == source.file_identity(5).content()
        with pytest.raises(IndexError):
            source.files.infos[N_FILES]
    finally:
        source.close()
        copy.close()


def test_a_changed_file_is_refused_at_a_read_after_a_pickle(paths, tmp_path):
    moved = [str(tmp_path / f"c{f}.h5ad") for f in range(3)]
    for f, p in enumerate(moved):
        _write(p, 10 * f, 10)
    source = pickle.loads(pickle.dumps(grain_cells.AnnDataSource(moved)))
    try:
        source.read([15, 16])  # file 1's own read: it stays open
        _write(moved[1], 50, 10)  # other values, same shape
        with pytest.raises(
            SourceChangedError, match=r"c1\.h5ad: .*\(detected at a read\)"
        ):
            source.read([15])
        source.read([0, 25])  # the unchanged files still read
    finally:
        source.close()


def _info(path, **changes) -> MatrixInfo:
    info = MatrixInfo(path, "X", "csr_matrix", 3, 4, np.dtype("float32"), 5)
    return dataclasses.replace(info, **changes)


def _identity(path, fmt=None, **stat) -> FileIdentity:
    fields = {"dev": 1, "ino": 2, "size": 3, "mtime_ns": 4, "ctime_ns": 5, **stat}
    return FileIdentity(path, "X", FileStat(**fields), "ab" * 32, "0f" * 32, fmt)


@pytest.mark.parametrize(
    "infos, identities",
    [
        pytest.param(
            [_info("a", nnz=None), _info("b", chunk_bytes=2**40), _info("c")],
            [_identity("a"), _identity("b", ino=2**64 - 1), _identity("c", "zarr")],
            id="none-huge-inode-format",
        ),
        pytest.param(
            [_info("a", n_obs=np.int64(3)), _info("b", dtype=np.dtype("<i8"))] * 2,
            [_identity("a", etag='"e1"', content="blocks:9"), _identity("b")] * 2,
            id="numpy-int-etag-content",
        ),
        pytest.param(
            [_info("a"), _info("b", element="layers/x")],
            [
                dataclasses.replace(_identity("a"), layout="XY", sample=""),
                dataclasses.replace(_identity("b"), layout="abc", sample="0f"),
            ],
            id="digests-not-hex",
        ),
    ],
)
def test_every_value_comes_back_exactly(infos, identities):
    paths = tuple(i.path for i in infos)
    records = pickle.loads(pickle.dumps(FileRecords(paths, infos, identities)))
    for k, (info, identity) in enumerate(zip(infos, identities, strict=True)):
        assert records.infos[k] == info and records.identities[k] == identity
        assert repr(records.infos[k]) == repr(info)
        assert repr(records.identities[k]) == repr(identity)
    assert list(records.infos) == infos and records.identities == identities
    assert records.column("nnz") == [i.nnz for i in infos]
    other = [dataclasses.replace(i, path=f"{i.path}!") for i in infos]
    assert list(records.with_infos(other).infos) == other


def test_a_changed_stat_is_refused_with_the_identity_s_words():
    identities = [_identity("a"), _identity("b", etag='"e"')]
    records = FileRecords(("a", "b"), [_info("a"), _info("b")], identities)
    records.check_stat(1, identities[1].stat, "at a read")  # unchanged
    for now in (
        dataclasses.replace(identities[1].stat, mtime_ns=9),
        dataclasses.replace(identities[1].stat, etag='"f"'),
    ):
        with pytest.raises(SourceChangedError) as expected:
            identities[1].check_stat(now, "at a read")
        with pytest.raises(SourceChangedError) as found:
            records.check_stat(1, now, "at a read")
        assert str(found.value) == str(expected.value)


def test_contents_are_each_identitys_content_and_cells(tmp_path):
    """`FileRecords.contents` (a checkpoint's files, column by column) equals
    what each file's records give, key order included.
    """
    from grain_cells.io import _identity

    x = sp.random(30, 7, density=0.3, format="csr", dtype=np.float32, random_state=0)
    paths = []
    for k in range(3):
        path = str(tmp_path / f"f{k}.h5ad")
        anndata.AnnData(X=x[k * 10 : k * 10 + 10 - k]).write_h5ad(path)
        paths.append(path)
    source = grain_cells.AnnDataSource(paths)
    want = [
        {"cells": source.file_info(i).n_obs, **source.file_identity(i).content()}
        for i in range(len(paths))
    ]
    got = _identity.file_entries(source)
    assert got == want and [list(d) for d in got] == [list(d) for d in want]
    assert [d["cells"] for d in got] == [10, 9, 8]
