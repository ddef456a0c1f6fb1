"""Opening zarr stores: local, zip, `file://`, S3 (moto); identity; processes.

The S3 store is a local store uploaded key by key to the moto server the
suite starts (`tests/s3_server.py`); reads through obstore must equal the
local reads, and the identity digest must follow a re-upload.
"""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import warnings

import numpy as np
import pytest
import zarr
from s3_server import s3  # noqa: F401
from test_fork import in_fork

from grain_cells import errors
from grain_cells.storage.remote import _store as object_store
from grain_cells.zarr._format import ZARR
from grain_cells.zarr._reads import RangeReader
from grain_cells.zarr._store import open_group, store_digest

N = 1500


def _write(path, fmt=3, **kwargs):
    g = zarr.open_group(path, mode="w", zarr_format=fmt)
    values = np.arange(N * 3, dtype=np.int32).reshape(N, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g.create_array("X", data=values, chunks=(100, 3), **kwargs)
        zarr.consolidate_metadata(path)
    return values


def _read(group, path, starts, stops):
    reader = RangeReader(group["X"], path)
    out = np.empty((int((stops - starts).sum()), 3), reader.dtype)
    reader.read(starts, stops, out)
    return reader, out


STARTS, STOPS = np.array([3, 250, 1390]), np.array([40, 420, 1500])


def _want(values):
    return np.concatenate([values[a:b] for a, b in zip(STARTS, STOPS, strict=False)])


def test_is_zarr_path(tmp_path):
    is_zarr_path = ZARR.can_open
    assert is_zarr_path("s3://b/atlas.zarr") and is_zarr_path("gs://b/a.zarr/")
    assert is_zarr_path(str(tmp_path)) and is_zarr_path("x.zarr.zip")
    assert not is_zarr_path("s3://b/atlas.h5ad") and not is_zarr_path(
        str(tmp_path / "a.h5ad")
    )


def test_file_url_and_digest(tmp_path):
    path = tmp_path / "a.zarr"
    values = _write(path)
    group = open_group(path.as_uri())
    np.testing.assert_array_equal(
        _read(group, str(path), STARTS, STOPS)[1], _want(values)
    )
    before = store_digest(str(path))
    assert store_digest(path.as_uri()) == before
    chunk = path / "X" / "c" / "3" / "0"
    data = chunk.read_bytes()
    chunk.write_bytes(data)  # the same bytes, rewritten: a new mtime
    os.utime(chunk, ns=(1, 1))
    assert store_digest(str(path)) != before
    (path / "X" / "zarr.json").write_text((path / "X" / "zarr.json").read_text() + " ")
    assert store_digest(str(path)) != before


def test_digest_of_a_zip_store(tmp_path):
    path = tmp_path / "a.zarr.zip"
    with zarr.storage.ZipStore(path, mode="w") as store:
        zarr.create_array(store, name="X", data=np.arange(10), chunks=(4,))
    assert len(store_digest(str(path))) == 64


def _upload(s3, folder: pathlib.Path, prefix: str) -> str:  # noqa: F811
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            s3.upload(f, f"{prefix}/{f.relative_to(folder).as_posix()}")
    return f"s3://{s3.bucket}/{prefix}"


@pytest.mark.parametrize(
    "fmt, kwargs", [(2, {}), (3, {"shards": (500, 3)})], ids=["v2", "v3-sharded"]
)
def test_s3_store_reads_equal_local_ones(tmp_path, s3, fmt, kwargs):  # noqa: F811
    path = tmp_path / "a.zarr"
    values = _write(path, fmt, **kwargs)
    url = _upload(s3, path, f"t{fmt}/a.zarr")
    counts = object_store.request_counts()
    group = open_group(url, s3.options)
    reader, out = _read(group, url, STARTS, STOPS)
    assert reader.remote and reader.direct
    np.testing.assert_array_equal(out, _want(values))
    digest = store_digest(url, s3.options)
    assert object_store.request_counts().get("list", 0) > counts.get("list", 0)
    # Re-upload one chunk with other bytes: the digest follows the ETag.
    key = "X/c/0/0" if fmt == 3 else "X/0.0"
    s3.put_bytes(f"t{fmt}/a.zarr/{key}", b"other bytes")
    assert store_digest(url, s3.options) != digest
    fresh = RangeReader(open_group(url, s3.options)["X"], url)
    with pytest.raises(errors.CorruptChunkError, match=key):
        fresh.read(np.array([0]), np.array([10]), np.empty((10, 3), np.int32))
    s3.client.delete_object(Bucket=s3.bucket, Key=f"t{fmt}/a.zarr/{key}")
    # `fresh` was opened with the listing of the digest before it (as the
    # io layer opens stores): a key removed since is a change, not a hole.
    with pytest.raises(errors.SourceChangedError, match="removed"):
        fresh.read(np.array([0]), np.array([10]), np.empty((10, 3), np.int32))
    store_digest(url, s3.options)
    reopened = RangeReader(open_group(url, s3.options)["X"], url)
    with pytest.raises(errors.CorruptChunkError, match="is missing"):
        reopened.read(np.array([0]), np.array([10]), np.empty((10, 3), np.int32))


def test_advise_fetches_ahead_from_a_bucket(tmp_path, s3):  # noqa: F811
    """After `advise`, a read takes the fetched bytes: it succeeds even once
    the chunks are deleted from the bucket (and reads them only once)."""
    path = tmp_path / "a.zarr"
    values = _write(path, 3, shards=(500, 3))
    url = _upload(s3, path, "ahead/a.zarr")
    reader = RangeReader(open_group(url, s3.options)["X"], url)
    out = np.empty((int((STOPS - STARTS).sum()), 3), np.int32)
    reader.read(STARTS[:1], STOPS[:1], out)  # (the first read's check with zarr)
    reader.advise(STARTS, STOPS)
    reader.wait_prefetch(range(15))  # the background GETs are done
    for shard in ("0", "2"):  # rows [0, 500) and [1000, 1500)
        s3.client.delete_object(Bucket=s3.bucket, Key=f"ahead/a.zarr/X/c/{shard}/0")
    reader.read(STARTS, STOPS, out)
    np.testing.assert_array_equal(out, _want(values))
    with pytest.raises(errors.CorruptChunkError, match="is missing"):
        reader.read(STARTS, STOPS, out)  # taken once: now fetched, and gone


def test_s3_missing_store_is_named(s3):  # noqa: F811
    with pytest.raises(errors.AnnDataFormatError, match="not a zarr store"):
        open_group(f"s3://{s3.bucket}/absent.zarr", s3.options)


def test_a_forked_child_reads_local_stores_and_refuses_s3_after_use(tmp_path, s3):  # noqa: F811
    """zarr's event loop is reset after a fork (zarr does it); obstore's runtime
    is not: a child forked after the parent read a bucket gets an error
    naming the fix, never a hang."""
    path = tmp_path / "a.zarr"
    values = _write(path, 3, shards=(500, 3))
    url = _upload(s3, path, "fork/a.zarr")
    local = RangeReader(open_group(str(path))["X"], str(path))
    remote = RangeReader(open_group(url, s3.options)["X"], url)
    want = _want(values)

    def read(reader):
        out = np.empty(want.shape, reader.dtype)
        reader.read(STARTS, STOPS, out)
        return out

    np.testing.assert_array_equal(read(remote), want)  # the parent used obstore
    np.testing.assert_array_equal(read(local), want)
    np.testing.assert_array_equal(in_fork(lambda: read(local)), want)

    def remote_in_child():
        try:
            read(remote)
        except errors.ObjectStoreError as e:
            return str(e)
        return "read"

    assert "does not survive os.fork" in in_fork(remote_in_child)
    assert "spawn" in in_fork(lambda: _error_of(lambda: open_group(url, s3.options)))


def _error_of(function) -> str:
    try:
        function()
    except errors.ObjectStoreError as e:
        return str(e)
    return "no error"


def _spawned_read(path: str) -> list:
    reader = RangeReader(open_group(path)["X"], path)
    out = np.empty((int((STOPS - STARTS).sum()), 3), reader.dtype)
    reader.read(STARTS, STOPS, out)
    return out.tolist()


@pytest.mark.slow  # a spawned interpreter imports zarr: seconds
def test_a_spawned_process_reads(tmp_path):
    path = tmp_path / "a.zarr"
    values = _write(path, 2)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.apply(_spawned_read, (str(path),))
    np.testing.assert_array_equal(np.array(got), _want(values))


def test_an_http_store_reads_and_has_an_identity(tmp_path):
    """Over plain HTTP (range GETs, no listing): reads equal local ones; the
    digest covers the root's metadata documents."""
    from grain_cells.testing.s3_folder_server import S3FolderServer

    path = tmp_path / "web" / "a.zarr"
    values = _write(path, 3, shards=(500, 3))
    with S3FolderServer(str(tmp_path)) as server:
        url = f"{server.endpoint_url}/web/a.zarr"
        group = open_group(url)
        reader, out = _read(group, url, STARTS, STOPS)
        assert reader.remote
        np.testing.assert_array_equal(out, _want(values))
        digest = store_digest(url)
        meta = path / "zarr.json"
        meta.write_text(meta.read_text() + " ")
        assert store_digest(url) != digest


def test_annbatch_stores_names_what_is_not_a_store(tmp_path):
    """A plain file and a folder without zarr metadata are refused by name,
    with AnnDataSource's message, not a zip or zarr library error."""
    import grain_cells

    plain = tmp_path / "notes.zarr"
    plain.write_text("not a store")
    with pytest.raises(errors.AnnDataFormatError, match="neither a zip archive"):
        grain_cells.annbatch_stores(plain)
    folder = tmp_path / "empty.zarr"
    folder.mkdir()
    (folder / "readme.txt").write_text("x")
    with pytest.raises(errors.AnnDataFormatError, match=r"empty\.zarr") as e:
        grain_cells.annbatch_stores(folder)
    with pytest.raises(errors.AnnDataFormatError) as again:
        grain_cells.AnnDataSource(folder)
    assert str(e.value).split(";")[0] == str(again.value).split(";")[0]
