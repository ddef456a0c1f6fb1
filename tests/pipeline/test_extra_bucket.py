"""Extra matrices (`Layer`, `raw/X`, `Obsm`) of `s3://` objects on a local moto.

The files of `test_matrices` (values encode row and gene; obsm (i, k) =
i * 10 + k) are uploaded to `s3_server.s3_auth`, which refuses requests not
signed with its keys. The source gets the endpoint and keys in
`storage_options` only: no `AWS_*` variable, no `~/.aws`. So every extra
matrix that comes back equal to `anndata.read_h5ad` of the local copy was read
with the source's own options, and an object overwritten under the source
raises `SourceChangedError` from the extra readers as it does from X.
"""

from __future__ import annotations

import anndata
import numpy as np
import pytest
from test_matrices import N_RAW, SIZES, _write, csr_rows

pytest.importorskip("obstore", reason="obstore is not installed")
pytest.importorskip("boto3", reason="boto3 is not installed")

import grain_cells
from grain_cells.pipeline._fetch import readers

_AWS_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_ALLOW_HTTP",
)


@pytest.fixture
def bare_env(tmp_path, monkeypatch):
    """No AWS settings anywhere but `storage_options`."""
    for name in _AWS_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def files(tmp_path_factory, s3_auth):
    """test_matrices' files: local paths and their URLs on the auth server."""
    paths = _write(tmp_path_factory.mktemp("extra_bucket"))
    urls = []
    for i, path in enumerate(paths):
        s3_auth.client.upload_file(path, s3_auth.bucket, f"extra/{i}.h5ad")
        urls.append(f"s3://{s3_auth.bucket}/extra/{i}.h5ad")
    return paths, urls


def _options(s3_auth) -> dict:
    return {"endpoint_url": s3_auth.endpoint, "region": "us-east-1", **s3_auth.keys}


def test_layers_and_obsm_read_with_the_sources_options(files, s3_auth, bare_env):
    paths, urls = files
    adatas = [anndata.read_h5ad(p) for p in paths]
    counts = np.concatenate([a.layers["counts"].toarray() for a in adatas])
    raw = np.concatenate([a.raw.X.toarray() for a in adatas])
    pca = np.concatenate([a.obsm["X_pca"] for a in adatas])
    source = grain_cells.AnnDataSource(
        urls, block_size=4, storage_options=_options(s3_auth), read_threads=2
    )
    ds = grain_cells.cell_dataset(
        source,
        batch_size=8,
        fetch_factor=3,
        extra={
            "counts": grain_cells.Layer("counts", grain_cells.DenseOutput()),
            "raw": grain_cells.Layer("raw"),
            "pca": grain_cells.Obsm("X_pca"),
        },
    )
    seen = []
    for batch in ds:
        real = batch["mask"]
        rows = batch["row_ids"][real]
        np.testing.assert_array_equal(batch["counts/X"][real], counts[rows])
        np.testing.assert_array_equal(csr_rows(batch, "raw/", N_RAW)[real], raw[rows])
        np.testing.assert_array_equal(batch["pca"][real], pca[rows])
        seen += rows.tolist()
    assert sorted(seen) == list(range(sum(SIZES)))


def test_overwritten_object_raises_in_extra_readers(tmp_path, s3_auth, bare_env):
    """Content uploaded at the same key after the source was built is refused."""
    paths = _write(tmp_path)
    urls = []
    for i, path in enumerate(paths):
        s3_auth.client.upload_file(path, s3_auth.bucket, f"changing/{i}.h5ad")
        urls.append(f"s3://{s3_auth.bucket}/changing/{i}.h5ad")
    source = grain_cells.AnnDataSource(
        urls, block_size=4, storage_options=_options(s3_auth)
    )
    extra = readers(
        source,
        {"counts": grain_cells.Layer("counts"), "pca": grain_cells.Obsm("X_pca")},
    )
    starts, stops = np.array([1, SIZES[0] + 2]), np.array([5, SIZES[0] + 7])
    before = extra["counts"].fetch(starts, stops, None, 0)
    np.testing.assert_array_equal(
        before.row_ids, np.r_[1:5, SIZES[0] + 2 : SIZES[0] + 7]
    )
    other = tmp_path / "other"
    other.mkdir()
    changed = anndata.read_h5ad(paths[1])
    changed.layers["counts"] = changed.layers["counts"] * 2
    changed.obsm["X_pca"] = changed.obsm["X_pca"] + 1
    changed.write_h5ad(other / "m1.h5ad")
    s3_auth.client.upload_file(
        str(other / "m1.h5ad"), s3_auth.bucket, "changing/1.h5ad"
    )
    with pytest.raises(
        grain_cells.errors.SourceChangedError, match=r"changing/1\.h5ad"
    ):
        extra["pca"].fetch(starts, stops)
    with pytest.raises(
        grain_cells.errors.SourceChangedError, match=r"changing/1\.h5ad"
    ):
        readers(source, {"counts": grain_cells.Layer("counts")})["counts"].fetch(
            starts, stops, None, 0
        )
    with pytest.raises(
        grain_cells.errors.SourceChangedError, match=r"changing/1\.h5ad"
    ):
        extra["counts"].fetch(starts, stops, None, 0)  # opened before the change
