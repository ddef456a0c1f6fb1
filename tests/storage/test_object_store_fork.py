"""A process forked after its parent read an `.h5ad` object gets an error, not a hang.

obstore's runtime does not survive `os.fork`: before the guard in
`grain_cells.storage.remote._store`, the child's read hung (and the child
died with "double free or corruption"). Spawned processes (Grain's
workers) start their own runtime and are not affected.
"""

from __future__ import annotations

import numpy as np
import pytest
from s3_server import s3  # noqa: F401
from test_fork import in_fork

import grain_cells
from grain_cells import errors

pytest.importorskip("obstore")


def _read_or_error(source) -> object:
    try:
        return source.read(np.arange(5)).X.toarray().tolist()
    except errors.ObjectStoreError as e:
        return str(e)


def test_a_child_forked_after_a_remote_read_is_told_why(csr_paths, s3):  # noqa: F811
    url = s3.upload(csr_paths[0])
    before = grain_cells.AnnDataSource(url, storage_options=s3.options, block_size=4)
    # The source's own HEADs count as use: a child forked now is refused.
    message = in_fork(lambda: _read_or_error(before))
    assert "does not survive os.fork" in message and "spawn" in message
    assert url in message
    want = before.read(np.arange(5)).X.toarray()
    np.testing.assert_array_equal(
        want, grain_cells.AnnDataSource(csr_paths[0]).read(np.arange(5)).X.toarray()
    )
