"""A zarr store in a bucket re-uploaded during iteration (issue 34, item 1).

Every key of the store is uploaded again with its values negated after a few
minibatches. The source once read 1,152 of 1,200 cells from the new upload
without a word (zarr key reads sent no `If-Match`); every chunk read is now
conditional on the ETag each key had when the process opened the store
(`grain_cells.zarr._keys.ObjectKeys`), so the loader raises
`SourceChangedError` and never yields a new value. Stores are written by
anndata (`tests/zarr_copies.py`): value (i, j) is `i * 100 + j + 1`, the new
upload's its negative.
"""

from __future__ import annotations

import os

import anndata
import numpy as np
import pytest
import scipy.sparse as sp
from absl import flags
from conftest import close_iterator
from zarr_copies import write_store

pytest.importorskip("obstore", reason="obstore is not installed (.[cloud])")
pytest.importorskip("boto3", reason="boto3 is not installed")

import grain_cells
from grain_cells import errors

N_CELLS, N_GENES = 1200, 12


def _adata(sign: int) -> anndata.AnnData:
    x = (np.arange(N_CELLS)[:, None] * 100 + np.arange(N_GENES) + 1).astype(np.float32)
    x[np.random.default_rng(0).random(x.shape) < 0.5] = 0
    return anndata.AnnData(sp.csr_matrix(x * sign))


@pytest.fixture(scope="module")
def local_stores(tmp_path_factory):
    """{layout: (old store, new store)} on local disk."""
    folder = tmp_path_factory.mktemp("zarr-versions")
    return {
        layout: tuple(
            write_store(_adata(sign), folder / f"{layout}-{name}.zarr", layout, 64)
            for sign, name in ((1, "old"), (-1, "new"))
        )
        for layout in ("zarr-v2", "zarr-v3-sharded")
    }


def _upload(s3, folder: str, prefix: str) -> str:
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            full = os.path.join(root, name)
            s3.client.upload_file(
                full, s3.bucket, f"{prefix}/{os.path.relpath(full, folder)}"
            )
    return f"s3://{s3.bucket}/{prefix}"


def _loader(url, options, workers, epochs=1):
    source = grain_cells.AnnDataSource(url, block_size=10, storage_options=options)
    return grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=3, num_epochs=epochs),
        operations=grain_cells.fetch_operations(
            source, batch_size=20, fetch_factor=2, seed=3
        ),
        worker_count=workers,
    )


def _signs(batch) -> np.ndarray:
    data = np.asarray(batch["data"])[: int(np.asarray(batch["indptr"])[-1])]
    return np.sign(data)


@pytest.mark.parametrize(
    ("layout", "workers"),
    [
        pytest.param("zarr-v2", 0, id="v2-0", marks=pytest.mark.slow),
        pytest.param("zarr-v3-sharded", 0, id="v3-sharded-0"),
        pytest.param("zarr-v3-sharded", 2, id="v3-sharded-2", marks=pytest.mark.slow),
    ],
)
def test_reupload_during_iteration_raises_and_never_yields_new_values(
    s3, local_stores, layout, workers, request
):
    flags.FLAGS.mark_as_parsed()
    old, new = local_stores[layout]
    prefix = f"rewrites/{request.node.callspec.id}/a.zarr"
    url = _upload(s3, old, prefix)
    # Workers read ahead (a small epoch may be read whole before the upload):
    # with workers, epochs after the first are read after it.
    iterator = iter(_loader(url, s3.options, workers, 1 if workers == 0 else 4))
    try:
        for _ in range(6):
            assert (_signs(next(iterator)) > 0).all()
        _upload(s3, new, prefix)
        with pytest.raises(errors.SourceChangedError) as caught:
            for _ in range(4 * N_CELLS):  # more minibatches than the epochs have
                assert (_signs(next(iterator)) > 0).all(), "new values were read"
    finally:
        close_iterator(iterator)
    message = str(caught.value)
    assert url in message and "ETag" in message and "Build a new source" in message


def test_unchanged_store_reads_every_cell(s3, local_stores):
    flags.FLAGS.mark_as_parsed()
    old, _ = local_stores["zarr-v3-sharded"]
    url = _upload(s3, old, "rewrites/unchanged/a.zarr")
    source = grain_cells.AnnDataSource(url, block_size=10, storage_options=s3.options)
    rows = np.array([1199, 0, 640, 7])
    want = _adata(1).X[rows].toarray()
    np.testing.assert_array_equal(source.read(rows).X.toarray(), want)


def test_key_versions_table():
    from grain_cells.zarr._keys import KeyVersions

    versions = KeyVersions(
        [{"path": f"X/data/{i}", "e_tag": f'"{i:032x}"'} for i in range(1000)]
        + [{"path": "obs/.zattrs", "e_tag": None}]
    )
    assert len(versions) == 1001
    assert versions.etag("X/data/7") == f'"{7:032x}"'
    assert versions.etag("obs/.zattrs") == ""  # listed, no ETag: unconditional
    assert versions.etag("X/data/1000") is None  # not in the store when listed
    assert versions.nbytes == 1001 * (8 + 34)  # hash + the longest ETag per key


def test_verify_reads_is_refused_for_zarr_stores(s3, local_stores):
    old, _ = local_stores["zarr-v2"]
    url = _upload(s3, old, "rewrites/verify/a.zarr")
    with pytest.raises(ValueError, match=r"verify_reads.*does not apply to zarr"):
        grain_cells.AnnDataSource(
            url, storage_options={**s3.options, "verify_reads": True}
        )


def test_a_shards_ranges_are_checked_by_one_head(s3, local_stores):
    from grain_cells.storage.remote import _store as object_store

    old, new = local_stores["zarr-v3-sharded"]
    url = _upload(s3, old, "rewrites/shard/a.zarr")
    source = grain_cells.AnnDataSource(url, block_size=10, storage_options=s3.options)
    before = object_store.request_counts().get("check", 0)
    rows = np.arange(0, 200)  # several inner chunks of one shard
    np.testing.assert_array_equal(
        source.read(rows).X.toarray(), _adata(1).X[rows].toarray()
    )
    assert object_store.request_counts().get("check", 0) > before
    _upload(s3, new, "rewrites/shard/a.zarr")
    with pytest.raises(errors.SourceChangedError, match="ETag"):
        source.read(np.arange(200, 400))
