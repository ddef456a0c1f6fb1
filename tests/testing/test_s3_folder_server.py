"""`S3FolderServer` serves files in place: serving never changes a served file.

A run that serves a cached file to a remote benchmark while another run
reads the same file locally must not make the local run see a changed file
(`SourceChangedError`): no hard link (link count, ctime), no write.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

obstore = pytest.importorskip(
    "obstore", reason="obstore is not installed: pip install grain_cells[cloud]"
)

import grain_cells  # noqa: E402
from grain_cells.testing import S3FolderServer, ServedFolder, object_etag  # noqa: E402


def _stat(path) -> tuple:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_nlink, st.st_size, st.st_mtime_ns,
            st.st_ctime_ns, st.st_mode)  # fmt: skip


def _store(server: S3FolderServer, bucket: str):
    from obstore.store import S3Store

    return S3Store(
        bucket,
        endpoint=server.endpoint_url,
        access_key_id="x",
        secret_access_key="x",
        region="us-east-1",
        client_options={"allow_http": True},
    )


def test_objects_are_served_in_place(tmp_path):
    data = np.random.default_rng(0).bytes(300_000)
    outside = tmp_path / "cache" / "file.bin"
    outside.parent.mkdir()
    outside.write_bytes(data)
    root = tmp_path / "root"
    (root / "own").mkdir(parents=True)
    (root / "own" / "local.bin").write_bytes(b"own bytes")
    before = _stat(outside)
    with S3FolderServer(root, objects={"bench/a/file.bin": outside}) as server:
        store = _store(server, "bench")
        meta = obstore.head(store, "a/file.bin")
        assert meta["size"] == len(data)
        assert meta["e_tag"] == object_etag(os.stat(outside))
        got = obstore.get(store, "a/file.bin", options={"range": (1000, 250_000)})
        assert bytes(got.bytes()) == data[1000:250_000]
        assert bytes(obstore.get(store, "a/file.bin").bytes()) == data
        listed = [m["path"] for m in obstore.list(store).collect()]
        assert listed == ["a/file.bin"]
        with pytest.raises(Exception, match="403"):  # mapped objects are read-only
            obstore.put(store, "a/file.bin", b"new")
        # Folders under root are still buckets.
        own = _store(server, "own")
        assert bytes(obstore.get(own, "local.bin").bytes()) == b"own bytes"
    assert _stat(outside) == before  # no link, no write: same inode, ctime, nlink
    assert os.listdir(root) == ["own"]  # nothing was linked or copied into root


def test_bad_object_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="bucket/key"):
        S3FolderServer(tmp_path, objects={"nokey": tmp_path})


def test_local_source_sees_no_change_while_served(tmp_path, csr_paths, monkeypatch):
    """A local run's identity check passes while the same file is served."""
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "metadata"))
    path = shutil.copy(csr_paths[0], tmp_path / "a.h5ad")
    local = grain_cells.AnnDataSource(path)
    before = _stat(path)
    root = tmp_path / "root"
    root.mkdir()
    try:
        served = ServedFolder(root, via_proxy=False, objects={"b/a.h5ad": path})
        served.start()
    except RuntimeError as e:
        pytest.skip(f"cannot start the local S3 server on loopback: {e}")
    try:
        remote = grain_cells.AnnDataSource(
            "s3://b/a.h5ad", storage_options=served.storage_options()
        )
        rows = np.arange(remote.num_cells)
        np.testing.assert_array_equal(
            remote.read(rows).X.toarray(), local.read(rows).X.toarray()
        )
    finally:
        served.stop()
    assert _stat(path) == before
    local.verify_files()  # no SourceChangedError
