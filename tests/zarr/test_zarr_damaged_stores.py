"""Damaged zarr stores: an error naming store, array, chunk and rows, never zeros.

Each test writes a store with zarr into `tmp_path`, damages it the way a
failed copy or a disk would (a chunk deleted, a shard cut short, a byte
flipped, garbage written, metadata changed after consolidation), and reads.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import warnings

import numpy as np
import pytest
import zarr
import zarr.codecs as zc

from grain_cells import errors
from grain_cells.formats import wait_all
from grain_cells.zarr._reads import RangeReader
from grain_cells.zarr._store import open_group

N = 1000


def _store(tmp_path, fmt=3, **kwargs):
    path = tmp_path / "s.zarr"
    g = zarr.open_group(path, mode="w", zarr_format=fmt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g.create_array(
            "x", data=np.arange(1, N + 1, dtype=np.float32), chunks=(100,), **kwargs
        )
    return path


def _reader(path, **kwargs):
    return RangeReader(open_group(str(path))["x"], str(path), **kwargs)


def _read_all(reader):
    out = np.empty(N, reader.dtype)
    reader.read(np.array([0]), np.array([N]), out)
    return out


@pytest.mark.parametrize("fmt, key", [(2, "x/3"), (3, "x/c/3")], ids=["v2", "v3"])
def test_a_missing_chunk_is_an_error_not_fill_values(tmp_path, fmt, key):
    path = _store(tmp_path, fmt)
    os.remove(path / key)
    assert (zarr.open_group(path, mode="r")["x"][300:400] == 0).all()  # zarr: zeros
    with pytest.raises(errors.CorruptChunkError, match="is missing") as e:
        _read_all(_reader(path))
    assert e.value.chunk_key == key and e.value.rows == (300, 400)
    assert str(path) in str(e.value) and "/x" in str(e.value)
    # Chunks that are not asked for do not matter.
    out = np.empty(100, np.float32)
    _reader(path).read(np.array([0]), np.array([100]), out)
    assert out[0] == 1
    # Opting in reads the fill value, as zarr does.
    assert (_read_all(_reader(path, fill_missing=True))[300:400] == 0).all()


def test_zarr_omits_all_fill_chunks_and_a_sharded_index_says_so(tmp_path):
    """What anndata's writes leave out: chunks whose values all equal the fill
    value (zarr's write_empty_chunks=False); the reader refuses to guess."""
    path = tmp_path / "s.zarr"
    values = np.arange(1, N + 1, dtype=np.float32)
    values[200:300] = 0
    g = zarr.open_group(path, mode="w")
    g.create_array("x", data=values, chunks=(100,), shards=(500,))
    with pytest.raises(errors.CorruptChunkError, match="index marks it empty") as e:
        _read_all(_reader(path))
    assert e.value.rows == (200, 300) and e.value.chunk_key == "x/c/0"
    np.testing.assert_array_equal(_read_all(_reader(path, fill_missing=True)), values)


def test_a_truncated_shard(tmp_path):
    path = _store(tmp_path, 3, shards=(500,))
    shard = path / "x" / "c" / "1"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(errors.CorruptChunkError, match=r"corrupt index|truncated") as e:
        _read_all(_reader(path))
    assert e.value.rows == (500, 1000)
    assert "x/c/1" in str(e.value)


def test_a_shard_whose_index_points_past_its_end(tmp_path):
    """Cut from the middle (the index at the end intact): chunks run past the end."""
    path = _store(tmp_path, 3, shards=(500,), compressors=None)
    shard = path / "x" / "c" / "0"
    data = shard.read_bytes()
    index_bytes = 5 * 16 + 4
    shard.write_bytes(data[:1000] + data[-index_bytes:])
    with pytest.raises(errors.CorruptChunkError, match=r"truncated|corrupt") as e:
        _read_all(_reader(path))
    assert e.value.chunk_key == "x/c/0"


def test_a_wrong_crc32c(tmp_path):
    path = _store(tmp_path, 3, compressors=[zc.Crc32cCodec()])
    chunk = path / "x" / "c" / "4"
    data = bytearray(chunk.read_bytes())
    data[17] ^= 0x40  # a value changes; the checksum no longer matches
    chunk.write_bytes(bytes(data))
    with pytest.raises(errors.CorruptChunkError, match="crc32c mismatch") as e:
        _read_all(_reader(path))
    assert e.value.rows == (400, 500) and e.value.chunk_key == "x/c/4"


@pytest.mark.parametrize("fmt, key", [(2, "x/7"), (3, "x/c/7")], ids=["v2", "v3"])
def test_undecodable_bytes(tmp_path, fmt, key):
    path = _store(tmp_path, fmt)
    (path / key).write_bytes(b"not a compressed chunk at all" * 3)
    with pytest.raises(errors.CorruptChunkError, match="is corrupt") as e:
        _read_all(_reader(path))
    assert e.value.rows == (700, 800)


def test_consolidated_metadata_that_disagrees_with_the_array(tmp_path):
    path = _store(tmp_path, 2)
    zarr.consolidate_metadata(path)
    # The array is rewritten shorter after consolidation; .zmetadata still
    # says 1000 elements.
    meta = json.loads((path / "x" / ".zarray").read_text())
    meta["shape"] = [600]
    (path / "x" / ".zarray").write_text(json.dumps(meta))
    group = open_group(str(path))
    assert group["x"].shape == (1000,)  # zarr trusts the consolidated document
    with pytest.raises(
        errors.AnnDataFormatError, match="consolidated metadata of /x disagrees"
    ) as e:
        RangeReader(group["x"], str(path))
    assert "shape" in str(e.value)


def test_a_store_that_is_not_zarr(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("hello")
    with pytest.raises(errors.AnnDataFormatError, match="not a zarr store") as e:
        open_group(str(tmp_path / "folder"))
    assert "notes.txt" in str(e.value)
    with pytest.raises(FileNotFoundError):
        open_group(str(tmp_path / "absent.zarr"))


def test_arrays_read_through_zarr_python_refuse_missing_chunks_too(tmp_path):
    """A codec decoded only by zarr-python (here `transpose`) takes the slow
    path; it checks once that every chunk was written."""
    path = tmp_path / "t.zarr"
    values = np.arange(40 * 6, dtype=np.int32).reshape(40, 6)
    g = zarr.open_group(path, mode="w")
    g.create_array(
        "x", data=values, chunks=(10, 6), filters=[zc.TransposeCodec(order=(1, 0))]
    )
    reader = RangeReader(open_group(str(path))["x"], str(path))
    assert not reader.direct
    out = np.empty((15, 6), np.int32)
    reader.read(np.array([2, 30]), np.array([7, 40]), out)
    np.testing.assert_array_equal(out, np.concatenate([values[2:7], values[30:40]]))
    os.remove(path / "x" / "c" / "2" / "0")
    with pytest.raises(errors.CorruptChunkError, match="never written"):
        RangeReader(open_group(str(path))["x"], str(path)).read(
            np.array([0]), np.array([5]), out
        )


@pytest.mark.parametrize("fmt, key", [(2, "x/3"), (3, "x/c/3")], ids=["v2", "v3"])
def test_an_unreadable_chunk_names_its_file_and_the_array(tmp_path, fmt, key):
    """A chunk that cannot be read (here a folder where its file should be)
    raises the OS's error naming the chunk's file, with a note naming the
    array and store (`formats.naming_errors`), not a bare descriptor number.
    """
    path = _store(tmp_path, fmt)
    os.remove(path / key)
    os.mkdir(path / key)
    with pytest.raises(IsADirectoryError) as e:
        _read_all(_reader(path))
    assert e.value.filename == str(path / key)
    assert f"grain_cells: reading /x of {path}" in getattr(e.value, "__notes__", [])


def test_an_unreadable_chunk_read_by_a_pool_task_names_the_array(tmp_path):
    """The same through read threads whose tasks the caller waits for later
    (`pending`): the note comes from the task, once.
    """
    path = _store(tmp_path, 3, compressors=[zc.ZstdCodec()])
    os.remove(path / "x/c/3")
    os.mkdir(path / "x/c/3")
    reader, pending = _reader(path), []
    out = np.empty(N, reader.dtype)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pool.threads = 2
        reader.read(np.array([0]), np.array([N]), out, pool, pending)
        with pytest.raises(IsADirectoryError) as e:
            wait_all(pending)
    assert e.value.__notes__ == [f"grain_cells: reading /x of {path}"]
