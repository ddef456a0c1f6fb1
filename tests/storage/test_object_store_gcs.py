"""`gs://` URLs, offline: obstore's GCS client against a server on localhost.

No GCS emulator on PyPI serves obstore: `gcp-storage-emulator` sends no
`ETag` header on the XML API, and obstore's GCS client refuses every answer
without one. Reads through the GCS client are XML-API requests (`GET` and
`HEAD` of `/bucket/key` with `Range` and `If-Match`), the same path-style
requests S3 clients send, so these tests point the client at
`grain_cells.testing.S3FolderServer` through the two fields obstore reads
from a service-account key for emulators (`gcs_base_url`, `disable_oauth`).
That covers everything of ours on the `gs://` path (URL parsing, storage
options, the store per bucket, metadata, range reads, the ETag check) and
obstore's GCS client itself; not Google's authentication.

The files are conftest's (every value names its cell); the oracle is
`anndata.read_h5ad` of the same file.
"""

from __future__ import annotations

import json
import os
import shutil

import anndata
import numpy as np
import pytest
import scipy.sparse as sp
from conftest import OBS, run, write_files

import grain_cells
from grain_cells import errors
from grain_cells.testing import S3FolderServer

BUCKET = "atlas"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """Serves a folder as a GCS bucket; yields (local paths, gs URLs, options)."""
    root = tmp_path_factory.mktemp("gcs")
    (root / BUCKET).mkdir()
    paths = write_files(root / BUCKET)
    urls = [f"gs://{BUCKET}/{os.path.basename(p)}" for p in paths]
    with S3FolderServer(root) as server:
        key = {
            "private_key": "",
            "private_key_id": "",
            "client_email": "",
            "gcs_base_url": server.endpoint_url,
            "disable_oauth": True,
        }
        options = {
            "service_account_key": json.dumps(key),
            "client_options": {"allow_http": True},
        }
        yield paths, urls, options


def _dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def test_gs_rows_equal_anndata(gcs):
    paths, urls, options = gcs
    source = grain_cells.AnnDataSource(urls, obs_columns=OBS, storage_options=options)
    oracle = [anndata.read_h5ad(p) for p in paths]
    want_x = np.concatenate([_dense(a.X) for a in oracle])
    want_idx = np.concatenate([a.obs["idx"].to_numpy() for a in oracle])
    rows = np.random.default_rng(0).permutation(source.num_cells)
    got = source.read(rows)
    np.testing.assert_array_equal(_dense(got.X), want_x[rows])
    np.testing.assert_array_equal(got.obs["idx"], want_idx[rows])


def _loader(files, options, worker_count):
    source = grain_cells.AnnDataSource(
        files, block_size=5, obs_columns=OBS, storage_options=options
    )
    return grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=3, readahead_cells=40),
        operations=grain_cells.fetch_operations(
            source, batch_size=4, fetch_factor=5, seed=3
        ),
        worker_count=worker_count,
    )


@pytest.mark.parametrize("worker_count", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_gs_loader_batches_equal_local(gcs, worker_count):
    paths, urls, options = gcs
    got = run(_loader(urls, options, worker_count))
    want = run(_loader(paths, None, 0))
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_gs_changed_object_raises(tmp_path):
    for name in (BUCKET, "a", "b"):
        (tmp_path / name).mkdir()
    first, second = write_files(tmp_path / "a"), write_files(tmp_path / "b", seed=1)
    served = tmp_path / BUCKET / "x.h5ad"
    shutil.copy(first[0], served)
    with S3FolderServer(tmp_path) as server:
        key = json.dumps(
            {
                "private_key": "",
                "private_key_id": "",
                "client_email": "",
                "gcs_base_url": server.endpoint_url,
                "disable_oauth": True,
            }
        )
        options = {"service_account_key": key, "client_options": {"allow_http": True}}
        source = grain_cells.AnnDataSource(
            f"gs://{BUCKET}/x.h5ad", storage_options=options
        )
        source.read(np.arange(3))
        os.replace(shutil.copy(second[0], tmp_path / "new.h5ad"), served)
        with pytest.raises(errors.SourceChangedError, match=f"gs://{BUCKET}/x.h5ad"):
            source.read(np.arange(source.num_cells))


def _gcs_options(server, **more) -> dict:
    key = {
        "private_key": "",
        "private_key_id": "",
        "client_email": "",
        "gcs_base_url": server.endpoint_url,
        "disable_oauth": True,
    }
    return {
        "service_account_key": json.dumps(key),
        "client_options": {"allow_http": True},
        **more,
    }


def test_requester_pays_bucket_is_billed_to_user_project(tmp_path):
    """Issue 33: Arc's Virtual Cell Atlas lies in a requester-pays bucket.

    The server refuses, as GCS does, every request that names no billing
    project; with `user_project` each one carries `x-goog-user-project`.
    """
    (tmp_path / "vca").mkdir()
    paths = write_files(tmp_path / "vca")
    url = f"gs://vca/{os.path.basename(paths[0])}"
    with S3FolderServer(tmp_path, requester_pays=("vca",)) as server:
        with pytest.raises(PermissionError, match="user_project"):
            grain_cells.AnnDataSource(url, storage_options=_gcs_options(server))
        assert server.user_projects == []
        options = _gcs_options(server, user_project="my-billing-project")
        source = grain_cells.AnnDataSource(url, storage_options=options)
        got = source.read(np.arange(source.num_cells))
        np.testing.assert_array_equal(
            _dense(got.X), _dense(anndata.read_h5ad(paths[0]).X)
        )
        assert len(server.user_projects) >= 2  # the HEAD and the GETs
        assert set(server.user_projects) == {"my-billing-project"}


@pytest.mark.parametrize(
    "url, project, match",
    [
        pytest.param("s3://b/a.h5ad", "p", "request_payer", id="s3"),
        pytest.param("gs://b/a.h5ad", "", "project ID", id="empty"),
        pytest.param("gs://b/a.h5ad", 7, "project ID", id="not-a-string"),
    ],
)
def test_user_project_is_checked(url, project, match):
    from grain_cells.storage.remote import _store as object_store

    with pytest.raises(ValueError, match=match):
        object_store.store_for(url, {"user_project": project, "anon": True})
