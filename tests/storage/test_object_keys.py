"""Object keys and paths with non-ASCII and URL-special characters.

h5py names a file opened on a file-like object by its `repr` squeezed to
ASCII, so `s3://cells/odd/zellé-ü.h5ad` once came back from `f.filename` as
`s3://cells/odd/zell?-?.h5ad`, which then read as a URL with a query (issue
27, item 5). Each name is read through the moto S3 server, through nginx (as
an S3 bucket and as a plain `http://` URL) and as a local path; the oracle is
`anndata.read_h5ad` of the local file.
"""

from __future__ import annotations

import anndata
import numpy as np
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.testing import NginxFolder, nginx_folder

pytest.importorskip("obstore", reason="obstore is not installed (.[cloud])")

NAMES = [
    pytest.param("zellé-ü.h5ad", id="accents"),
    pytest.param("細胞 Ω.h5ad", id="cjk-greek-space"),
    pytest.param("a b+c%d&e=f.h5ad", id="url-special"),
]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """One small CSR file per name, value (i, j) = i * 100 + j + 1."""
    folder = tmp_path_factory.mktemp("odd")
    x = (np.arange(23)[:, None] * 100 + np.arange(7) + 1).astype(np.float32)
    x[::3, ::2] = 0
    for param in NAMES:
        anndata.AnnData(X=sp.csr_matrix(x)).write_h5ad(folder / param.values[0])
    return folder


def _check(source: grain_cells.AnnDataSource, path) -> None:
    want = anndata.read_h5ad(path).X.toarray()
    rows = np.array([22, 0, 5, 11])
    np.testing.assert_array_equal(source.read(rows).X.toarray(), want[rows])


@pytest.mark.parametrize("name", NAMES)
def test_local_path(local, name):
    path = local / name
    _check(grain_cells.AnnDataSource(str(path), block_size=4), path)


@pytest.mark.parametrize("name", NAMES)
def test_moto_s3_key(local, s3, name):
    url = s3.upload(local / name, f"odd/{name}")
    source = grain_cells.AnnDataSource(url, block_size=4, storage_options=s3.options)
    assert source.paths == (url,)
    _check(source, local / name)


@pytest.mark.parametrize("name", NAMES)
def test_nginx_s3_and_http(local, tmp_path, name):
    if nginx_folder.find_nginx() is None:
        pytest.skip(f"nginx is not installed: {nginx_folder.INSTALL_HINT}")
    with NginxFolder(tmp_path, objects={f"b/odd/{name}": local / name}) as server:
        for url, options in (
            (f"s3://b/odd/{name}", server.storage_options()),
            (f"{server.endpoint_url}/b/odd/{name}", None),
        ):
            source = grain_cells.AnnDataSource(
                url, block_size=4, storage_options=options
            )
            _check(source, local / name)
