"""A sharded v3 store whose shard index is cut short or has flipped bytes.

Building a source reads a few values through zarr-python (the ends of
`indptr`, the windows its identity samples); a damaged shard index makes
zarr-python raise a bare `ValueError` ("Stored and computed checksum do not
match"). The source raises `CorruptChunkError` naming the store, the array,
the shard key and the fix instead (docs/reference/bad-input.md).
"""

from __future__ import annotations

import pathlib

import anndata
import numpy as np
import pytest
import scipy.sparse as sp
from zarr_copies import write_store

import grain_cells
from grain_cells import errors


def _cut(raw: bytes) -> bytes:
    return raw[:-10]  # the index (and its crc32c) sits at the shard's end


def _flip(raw: bytes) -> bytes:
    out = bytearray(raw)
    out[-6] ^= 0xFF  # a byte of the last index entry
    return bytes(out)


@pytest.mark.parametrize("damage", [_cut, _flip], ids=["cut", "flipped"])
@pytest.mark.parametrize("array", ["data", "indices", "indptr"])
def test_a_damaged_shard_index_is_named_at_construction(tmp_path, damage, array):
    x = sp.random(200, 30, density=0.2, format="csr", dtype=np.float32, rng=0)
    path = write_store(
        anndata.AnnData(X=x), tmp_path / "a.zarr", "zarr-v3-sharded", chunk=16
    )
    shard = pathlib.Path(path) / "X" / array / "c" / "0"
    shard.write_bytes(damage(shard.read_bytes()))
    with pytest.raises(errors.CorruptChunkError) as e:
        grain_cells.AnnDataSource(path)
    message = str(e.value)
    assert message.startswith(f"{path}: /X/{array} shard 'X/{array}/c/0'")
    assert "checksum" in message  # what zarr-python found
    assert "rewrite it, or copy it again" in message
    assert e.value.chunk_key == f"X/{array}/c/0"
    assert e.value.rows[0] == 0
