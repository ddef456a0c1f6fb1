"""Zarr stores in a bucket (`s3://` on a local moto server) through the loader.

The conftest files, copied by anndata into zarr stores (`tests/zarr_copies.py`),
are uploaded key by key to `s3_server.s3_auth`, which refuses requests not
signed with its keys; the source gets the endpoint and keys in
`storage_options` only. The minibatches must be those of the `.h5ad`
originals, with 0 and 2 workers, and the values those of
`anndata.read_zarr` of the local store.
"""

from __future__ import annotations

import os

import pytest
from absl import flags
from test_zarr_loader import CONFIG, assert_equals_anndata, assert_same_batches
from zarr_copies import copy_as

pytest.importorskip("obstore", reason="obstore is not installed")
pytest.importorskip("boto3", reason="boto3 is not installed")

import grain_cells


def upload_store(s3, folder: str, prefix: str) -> str:
    """Puts every key of a local store under `prefix`; returns the store's URL."""
    for root, _, files in os.walk(folder):
        for name in files:
            full = os.path.join(root, name)
            key = f"{prefix}/{os.path.relpath(full, folder)}"
            s3.client.upload_file(full, s3.bucket, key)
    return f"s3://{s3.bucket}/{prefix}"


@pytest.fixture(scope="module")
def stores(csr_paths, tmp_path_factory, s3_auth):
    """(local copies, their URLs) for the v2 and v3 sharded layouts."""
    out = {}
    for layout in ("zarr-v2", "zarr-v3-sharded"):
        local = copy_as(csr_paths, tmp_path_factory.mktemp(f"bucket-{layout}"), layout)
        urls = [
            upload_store(s3_auth, p, f"zarr-e2e/{layout}/{os.path.basename(p)}")
            for p in local
        ]
        out[layout] = local, urls
    return out


def _epoch(urls, options, workers, helpers):
    source = grain_cells.AnnDataSource(
        urls,
        block_size=CONFIG["block_size"],
        obs_columns=("plate", "cell_type", "idx"),
        storage_options=options,
    )
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=CONFIG["seed"]),
        operations=grain_cells.fetch_operations(
            source,
            batch_size=CONFIG["batch_size"],
            fetch_factor=CONFIG["fetch_factor"],
            seed=CONFIG["seed"],
        ),
        worker_count=workers,
    )
    return helpers.run(loader)


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
@pytest.mark.parametrize(
    ("layout", "workers"),
    [
        pytest.param("zarr-v3-sharded", 0, id="zarr-v3-sharded-0"),
    ],
)
def test_bucket_store_equals_h5ad_and_anndata(
    stores, csr_paths, s3_auth, helpers, layout, workers
):
    flags.FLAGS.mark_as_parsed()
    local, urls = stores[layout]
    options = {"endpoint_url": s3_auth.endpoint, "region": "us-east-1", **s3_auth.keys}
    got = _epoch(urls, options, workers, helpers)
    assert_equals_anndata(got, local, helpers)
    assert_same_batches(got, helpers.run(helpers.build(csr_paths, **CONFIG)[2]))
