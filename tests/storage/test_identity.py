"""File identity: changed or replaced files are refused, copies restore.

Files come from `conftest.write_files` (value at (row i, gene j) is
`i * 100 + j + 1`), copied per test so that each test may rewrite them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import anndata
import h5py
import numpy as np
import pytest

import grain_cells
from grain_cells.errors import CheckpointMismatchError, SourceChangedError
from grain_cells.io import _identity as identity

CONFIG = {"block_size": 5, "batch_size": 4, "fetch_factor": 5, "seed": 3}


@pytest.fixture
def files(tmp_path, csr_paths):
    """Private copies of the session's CSR files (times preserved)."""
    out = []
    for p in csr_paths:
        dest = tmp_path / "data" / os.path.basename(p)
        dest.parent.mkdir(exist_ok=True)
        shutil.copy2(p, dest)
        out.append(str(dest))
    return out


def negate_values_in_place(path, keep_mtime=True):
    """Negates X/data's bytes where they lie (as another process writing in
    place would; HDF5 refuses to reopen a file this process reads), then
    restores the mtime unless told not to."""
    st = os.stat(path)
    with h5py.File(path, "r") as f:
        ds = f["X/data"]
        pieces = []
        if ds.chunks is None:
            pieces.append((ds.id.get_offset(), ds.size * ds.dtype.itemsize))
        else:
            ds.id.chunk_iter(lambda c: pieces.append((c.byte_offset, c.size)))
        dtype = ds.dtype
    fd = os.open(path, os.O_RDWR)
    try:
        for offset, size in pieces:
            values = np.frombuffer(os.pread(fd, size, offset), dtype)
            os.pwrite(fd, (-values).tobytes(), offset)
    finally:
        os.close(fd)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.path.getsize(path) == st.st_size


def replace_with_other_data(path, tmp_path):
    """Replaces the file (new inode) by one of the same shape, other values."""
    other = tmp_path / "other.h5ad"
    shutil.copy2(path, other)
    negate_values_in_place(other)
    os.replace(other, path)


def expected_rows(path, rows):
    x = anndata.read_h5ad(path).X[rows]
    return x if isinstance(x, np.ndarray) else x.toarray()


# -- in one process: any write after the source was built -------------------------


@pytest.mark.parametrize("mtime", ["new-mtime", "mtime-restored"])
def test_values_rewritten_in_place_mid_epoch(files, helpers, mtime):
    *_, loader = helpers.build(files, **CONFIG)
    iterator = iter(loader)
    helpers.take(iterator, 3)
    negate_values_in_place(files[1], keep_mtime=mtime == "mtime-restored")
    with pytest.raises(SourceChangedError, match=files[1]) as e:
        helpers.take(iterator)
    assert "changed since the AnnDataSource was built" in str(e.value)


def test_rewrite_in_place_detected_at_next_read(files):
    source = grain_cells.AnnDataSource(files)
    first = source.read([0, 1]).X.toarray()
    np.testing.assert_array_equal(first, expected_rows(files[0], [0, 1]))
    negate_values_in_place(files[0])
    with pytest.raises(SourceChangedError, match="inode changed"):
        source.read([0, 1])
    source.close()


def test_dense_file_rewritten_with_x_moved(tmp_path, dense_paths):
    path = str(tmp_path / "dense.h5ad")
    shutil.copy2(dense_paths[0], path)
    source = grain_cells.AnnDataSource(path)
    np.testing.assert_array_equal(source.read([3]).X, expected_rows(path, [3]))
    before = source.file_identity(0).layout
    # Another process rewrites X (same values) after new data, so X moves
    # within the same inode, while this one has the file open.
    script = (
        "import h5py, numpy as np, sys\n"
        "with h5py.File(sys.argv[1], 'r+') as f:\n"
        "    x, attrs = f['X'][()], dict(f['X'].attrs)\n"
        "    del f['X']\n"
        "    f['uns/padding'] = np.arange(5000)\n"
        "    f.create_dataset('X', data=x).attrs.update(attrs)\n"
    )
    ino = os.stat(path).st_ino
    # HDF5's file locks would stop the writer while this process reads; many
    # clusters turn them off (NFS, Lustre), as here.
    env = {**os.environ, "HDF5_USE_FILE_LOCKING": "FALSE"}
    subprocess.run([sys.executable, "-c", script, path], check=True, env=env)
    assert os.stat(path).st_ino == ino
    with pytest.raises(SourceChangedError, match=path):
        source.read([3])
    source.close()
    with h5py.File(path, "r") as f:
        assert identity.layout_digest(f, "X") != before


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_file_replaced_before_workers_open_it(files, helpers, tmp_path, workers):
    *_, loader = helpers.build(files, worker_count=workers, **CONFIG)
    replace_with_other_data(files[2], tmp_path)
    iterator = iter(loader)
    try:
        with pytest.raises(SourceChangedError, match=files[2]) as e:
            helpers.take(iterator)
        assert "another file" in str(e.value)
    finally:
        helpers.close_iterator(iterator)


def test_removed_file_refused_at_restore(files, helpers):
    *_, loader = helpers.build(files, **CONFIG)
    iterator = iter(loader)
    helpers.take(iterator, 2)
    state = iterator.get_state()
    *_, other = helpers.build(files, **CONFIG)
    os.unlink(files[0])
    with pytest.raises(SourceChangedError, match="removed"):
        iter(other).set_state(state)


def test_change_after_build_refused_at_restore(files, helpers):
    *_, loader = helpers.build(files, **CONFIG)
    iterator = iter(loader)
    helpers.take(iterator, 2)
    state = iterator.get_state()
    *_, other = helpers.build(files, **CONFIG)
    negate_values_in_place(files[1])
    with pytest.raises(SourceChangedError, match=files[1]):
        iter(other).set_state(state)


# -- checkpoints: content, not paths -----------------------------------------------


def test_copy_in_another_folder_restores(files, helpers, tmp_path):
    *_, loader = helpers.build(files, **CONFIG)
    everything = helpers.run(loader)
    loader.set_epoch(0)  # each iter() is the next epoch: the same one again
    iterator = iter(loader)
    helpers.take(iterator, 7)
    state = iterator.get_state()
    assert files[0] not in state.decode()  # no paths in the stamp

    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "data", moved)  # copy: new inodes and times
    paths = [str(moved / os.path.basename(p)) for p in files]
    *_, other = helpers.build(paths, **CONFIG)
    restored = iter(other)
    restored.set_state(state)
    got = helpers.take(restored)
    assert len(got) == len(everything) - 7
    for a, b in zip(got, everything[7:], strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_restore_on_replaced_data_is_refused(files, helpers, tmp_path):
    """Same shape, same size, same layout, mtime restored: other values."""
    *_, loader = helpers.build(files, **CONFIG)
    iterator = iter(loader)
    helpers.take(iterator, 4)
    state = iterator.get_state()
    replace_with_other_data(files[1], tmp_path)
    *_, other = helpers.build(files, **CONFIG)
    with pytest.raises(CheckpointMismatchError) as e:
        iter(other).set_state(state)
    message = str(e.value)
    assert "data_source: saved files=" in message
    assert "'sample'" in message


def test_restore_on_other_data_names_what_differs(files, helpers):
    loader_source, _, loader = helpers.build(files, **CONFIG)
    iterator = iter(loader)
    helpers.take(iterator, 4)
    state = iterator.get_state()
    loader_source.close()  # HDF5 cannot rewrite a file this process has open
    adata = anndata.read_h5ad(files[1])
    adata[::-1].copy().write_h5ad(files[1])  # same cells, reversed order
    *_, other = helpers.build(files, **CONFIG)
    with pytest.raises(CheckpointMismatchError, match="data_source: saved files="):
        iter(other).set_state(state)


def test_stamp_is_content(files, helpers):
    source, _, loader = helpers.build(files, **CONFIG)
    stamp = loader.stamp["data_source"]
    json.dumps(stamp)  # JSON-serialisable
    assert [f["cells"] for f in stamp["files"]] == [97, 130, 61]
    assert [f["bytes"] for f in stamp["files"]] == [os.path.getsize(p) for p in files]
    assert stamp["block_size"] == 5
    assert stamp["obs_columns"] == ["plate", "cell_type", "idx"]
    view = source.select(where={"cell_type": ["B"]})
    assert identity.source_identity(view)["blocks"] == view.blocks_id != ""


# -- the identity itself -----------------------------------------------------------


def test_identity_of_a_copy_matches_and_of_a_change_does_not(files, tmp_path):
    def ident(path):
        with h5py.File(path, "r") as f:
            return identity.FileIdentity.take(f, path, "X")

    original = ident(files[0])
    copy = tmp_path / "copy.h5ad"
    shutil.copy(files[0], copy)
    copied = ident(str(copy))
    assert copied.content() == original.content()
    assert copied.stat.ino != original.stat.ino
    negate_values_in_place(str(copy))
    changed = ident(str(copy))
    assert changed.layout == original.layout  # same layout...
    assert changed.sample != original.sample  # ...other values
    assert changed.stat.size == original.stat.size


def test_state_stamped_by_an_earlier_version_is_refused_by_name(files, helpers):
    """Before content stamps, the source was stamped with its repr: such a
    state is an older grain_cells's (0.x), refused saying what to do; the
    iterator then goes on from the start."""
    source, _, loader = helpers.build(files, **CONFIG)
    everything = helpers.run(loader)
    loader.set_epoch(0)  # each iter() is the next epoch: the same one again
    iterator = iter(loader)
    helpers.take(iterator, 5)
    state = json.loads(iterator.get_state())
    state["grain_cells"]["data_source"] = repr(source)
    *_, other = helpers.build(files, **CONFIG)
    restored = iter(other)
    with pytest.raises(CheckpointMismatchError) as e:
        restored.set_state(json.dumps(state).encode())
    for text in [
        "saved by an older grain_cells",
        "records the data source as its repr, with its paths",
        "Start the data iterator afresh",
        "restore the state with the grain_cells version that saved it",
    ]:
        assert text in str(e.value), str(e.value)
    got = helpers.take(restored)
    assert len(got) == len(everything)
    np.testing.assert_array_equal(got[5]["row_ids"], everything[5]["row_ids"])
