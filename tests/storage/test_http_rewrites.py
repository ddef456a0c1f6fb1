"""Objects rewritten in place on a server whose ETag is mtime-size (issue 27, item 3).

nginx's ETag is `"<mtime hex>-<size hex>"`, so a same-size rewrite that keeps
the modification time (`rsync -t`, `cp -p`) keeps every header and passes
`If-Match`: a source once read 268 of 300 cells from the new content without
a word. Such objects now carry a digest of sampled bytes, read again when a
process opens them, at restore and periodically while reading
(`grain_cells.storage.remote._versions`); with the `verify_reads` storage
option (issue 34, item 2: a rewrite during iteration was read for 276 of 300
cells before the periodic check) every block read is checked against
digests of the whole object. Files are written by anndata: the
old one's value (i, j) is `i * 100 + j + 1`, the new one's its negative, with
the same sparsity (hence the same size).
"""

from __future__ import annotations

import os
import pathlib
import pickle
import shutil
import subprocess
import sys

import anndata
import numpy as np
import pytest
import scipy.sparse as sp
from conftest import close_iterator, hdf5_opens

import grain_cells
from grain_cells import errors
from grain_cells.storage import FileStat
from grain_cells.storage.remote import _store as object_store
from grain_cells.storage.remote import _versions as versions
from grain_cells.testing import NginxFolder, nginx_folder

pytest.importorskip("obstore", reason="obstore is not installed (.[cloud])")

N_CELLS, N_GENES = 300, 20


def _write(path, sign: int, n_cells: int = N_CELLS) -> str:
    rng = np.random.default_rng(0)
    x = (np.arange(n_cells)[:, None] * 100 + np.arange(N_GENES) + 1).astype(np.float32)
    x[rng.random(x.shape) < 0.6] = 0
    anndata.AnnData(sp.csr_matrix(x * sign)).write_h5ad(path)
    return str(path)


@pytest.fixture(scope="module")
def versions_on_disk(tmp_path_factory):
    folder = tmp_path_factory.mktemp("versions")
    old, new = _write(folder / "old.h5ad", 1), _write(folder / "new.h5ad", -1)
    assert os.path.getsize(old) == os.path.getsize(new)
    return old, new


@pytest.fixture
def served(versions_on_disk, tmp_path):
    """nginx serving a copy of the old file; yields (url, served path, server)."""
    if nginx_folder.find_nginx() is None:
        pytest.skip(f"nginx is not installed: {nginx_folder.INSTALL_HINT}")
    path = tmp_path / "served.h5ad"
    shutil.copyfile(versions_on_disk[0], path)
    with NginxFolder(tmp_path / "root", objects={"b/c.h5ad": path}) as server:
        yield f"{server.endpoint_url}/b/c.h5ad", path, server


@pytest.fixture(autouse=True)
def _root(tmp_path, monkeypatch):
    """nginx's (empty) root folder, and a metadata cache of this test's own."""
    (tmp_path / "root").mkdir()
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))


def _rewrite_keeping_mtime(path, new: str, url: str) -> None:
    """`cp -p new path`: same size, the old modification time.

    The new content gets the old times before it replaces the served file in
    one rename: a check running meanwhile (workers, `content_check_s=0`) sees
    the old object or the new one, never `cp`'s truncated file or a new mtime
    (CI, leg 2: "0 bytes now" instead of "bytes differ").
    """
    before = versions.head(url)
    st = os.stat(path)
    staged = pathlib.Path(path).with_name(pathlib.Path(path).name + ".new")
    shutil.copyfile(new, staged)
    os.utime(staged, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(staged, path)
    after = versions.head(url)
    assert after == before  # every header nginx sends is unchanged


def _loader(url, worker_count=0, options=None, epochs=1):
    source = grain_cells.AnnDataSource(url, block_size=10, storage_options=options)
    return grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=2, num_epochs=epochs),
        operations=grain_cells.fetch_operations(
            source, batch_size=10, fetch_factor=3, seed=2
        ),
        worker_count=worker_count,
    )


def _old_values(batch) -> bool:
    """Whether every stored value is the old file's (positive)."""
    data = np.asarray(batch["data"])[: int(np.asarray(batch["indptr"])[-1])]
    return bool((data > 0).all())


def test_rewrite_with_kept_mtime_is_caught_at_restore(served, versions_on_disk):
    url, path, _ = served
    loader = _loader(url)
    iterator = iter(loader)
    first = [next(iterator) for _ in range(3)]
    assert all(_old_values(b) for b in first)
    state = iterator.get_state()
    _rewrite_keeping_mtime(path, versions_on_disk[1], url)
    # The same loader (a restore within the run that built the source).
    with pytest.raises(errors.SourceChangedError, match="bytes differ"):
        iter(loader).set_state(state)


def test_a_new_source_over_the_rewrite_refuses_the_old_state(served, versions_on_disk):
    """A restart: the new source's identity must be the new content's.

    The metadata cache was keyed by URL, ETag, size and mtime only, so the new
    source read the old file's sampled values from it and took the old
    identity: the old state restored onto new data without a word.
    """
    url, path, _ = served
    iterator = iter(_loader(url))
    next(iterator)
    state = iterator.get_state()
    _rewrite_keeping_mtime(path, versions_on_disk[1], url)
    with pytest.raises(errors.CheckpointMismatchError):
        iter(_loader(url)).set_state(state)


def test_verify_files_and_a_new_process_open_see_the_rewrite(served, versions_on_disk):
    url, path, _ = served
    source = grain_cells.AnnDataSource(url, block_size=10)
    _rewrite_keeping_mtime(path, versions_on_disk[1], url)
    with pytest.raises(errors.SourceChangedError, match=r"cp -p"):
        source.verify_files()
    # A process opening the object (here: this one, after a reset) checks it.
    source.close()
    with pytest.raises(errors.SourceChangedError, match="when a process opened it"):
        source.read(np.arange(3))


@pytest.mark.parametrize("worker_count", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_rewrite_during_iteration_is_caught_by_the_periodic_check(
    served, versions_on_disk, worker_count
):
    url, path, _ = served
    options = {"content_check_s": 0}  # check at every read
    # Workers may read the small file's whole first epoch ahead of the
    # trainer, before the rewrite (CI, leg 2): later epochs follow it.
    epochs = 4
    iterator = iter(_loader(url, worker_count, options, epochs))
    try:
        assert _old_values(next(iterator))
        _rewrite_keeping_mtime(path, versions_on_disk[1], url)
        with pytest.raises(errors.SourceChangedError, match="bytes differ"):
            for _ in range(epochs * N_CELLS):  # more minibatches than there are
                next(iterator)
    finally:
        close_iterator(iterator)


@pytest.mark.parametrize("worker_count", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_verify_reads_never_returns_a_byte_of_the_rewrite(
    served, versions_on_disk, worker_count
):
    """Issue 34, item 2: with the default checks 276 of 300 cells came from
    the rewrite, read before the next periodic check. `verify_reads` checks
    every byte read against block digests taken when the source was built.
    """
    url, path, _ = served
    # Reads run ahead (the file is small): later epochs follow the rewrite.
    epochs = 4
    iterator = iter(_loader(url, worker_count, {"verify_reads": True}, epochs))
    try:
        assert _old_values(next(iterator))
        _rewrite_keeping_mtime(path, versions_on_disk[1], url)
        with pytest.raises(errors.SourceChangedError, match="verify_reads"):
            for _ in range(epochs * N_CELLS):  # more minibatches than there are
                assert _old_values(next(iterator)), "new values were read"
    finally:
        close_iterator(iterator)


# Run in a process of its own (as a worker opens the object): for each way
# of rewriting, rewrites the served file at the K-th read HDF5 makes through
# `RangeFile`, for each K, then reads X. Prints one line per (way, K): the
# way, K, then "old" or the error's type and message. Both ways run in the
# one process (one interpreter start with anndata's imports, not two).
_OPEN_DURING_A_REWRITE = """
import faulthandler, os, shutil, sys
faulthandler.enable()
import anndata
from grain_cells.hdf5 import _open as hdf5_open
from grain_cells.storage.remote import version_of

url, path, old, new, cache, *hows = sys.argv[1:]
options = {"verify_reads": True}
real_read = hdf5_open.RangeFile._read
for how, k in [(how, k) for how in hows for k in range(1, 13)]:
    shutil.copyfile(old, path)
    st = os.stat(path)
    stat = version_of(url, options)
    os.environ["GRAIN_CELLS_CACHE"] = os.path.join(cache, how, str(k))
    hdf5_open._metadata.clear()  # HDF5's reads go to the server
    calls = [0]

    def _read(self, off, n, k=k, st=st):
        calls[0] += 1
        if calls[0] == k:
            if how == "truncate":  # shutil.copyfile's first step
                os.truncate(path, st.st_size // 2)
            else:  # cp -p: all of it, the old mtime put back
                shutil.copyfile(new, path)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        return real_read(self, off, n)

    hdf5_open.RangeFile._read = _read
    try:
        with hdf5_open.open_remote(url, options, stat) as f:
            x = anndata.io.read_elem(f["X"])
        print(how, k, "old" if (x.data > 0).all() else "NEW VALUES", flush=True)
    except Exception as e:
        print(how, k, type(e).__name__, str(e).replace(chr(10), " "), flush=True)
"""
_HOWS = ("truncate", "rewrite")


@pytest.fixture(scope="module")
def opened_mid_rewrite(tmp_path_factory):
    """(url, exit status, stderr, {how: lines}) of one run of the script above."""
    if nginx_folder.find_nginx() is None:
        pytest.skip(f"nginx is not installed: {nginx_folder.INSTALL_HINT}")
    tmp_path = tmp_path_factory.mktemp("mid_rewrite")
    (tmp_path / "root").mkdir()
    old = _write(tmp_path / "old.h5ad", 1, n_cells=4000)  # several 64 KiB blocks
    new = _write(tmp_path / "new.h5ad", -1, n_cells=4000)
    assert os.path.getsize(old) == os.path.getsize(new) > 4 * 65536
    path = tmp_path / "served.h5ad"
    shutil.copyfile(old, path)
    script = tmp_path / "open_during_a_rewrite.py"
    script.write_text(_OPEN_DURING_A_REWRITE)
    with NginxFolder(tmp_path / "root", objects={"b/c.h5ad": path}) as server:
        url = f"{server.endpoint_url}/b/c.h5ad"
        args = [url, path, old, new, tmp_path / "cache", *_HOWS]
        run = subprocess.run(
            [sys.executable, script, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    lines = {how: [] for how in _HOWS}
    for line in run.stdout.splitlines():
        how, rest = line.split(" ", 1)
        lines[how].append(rest)
    return url, run.returncode, run.stderr, lines


@pytest.mark.parametrize("how", _HOWS)
def test_a_process_opening_the_object_mid_rewrite_gets_a_named_error(
    opened_mid_rewrite, how
):
    """A worker opened the object while it was rewritten and died of SIGSEGV
    in HDF5 once in CI. Here the rewrite lands at each of the first reads
    HDF5 makes through `RangeFile`, in a process of its own: every open
    either reads old values only or raises `SourceChangedError` naming
    verify_reads, and the process exits normally.
    """
    url, returncode, stderr, outcomes = opened_mid_rewrite
    assert returncode == 0, (returncode, stderr[-3000:])
    lines = outcomes[how]
    assert len(lines) == 12, outcomes
    changed = 0
    for line in lines:
        _, outcome = line.split(" ", 1)
        if outcome != "old":
            assert outcome.startswith("SourceChangedError "), line
            assert "verify_reads" in outcome and url in outcome, line
            changed += 1
    assert changed, lines  # some rewrite landed before a read


def test_a_failed_open_keeps_no_buffer_of_hdf5_and_no_cycle(served, monkeypatch):
    """The error out of a failed open holds no frame that keeps HDF5's
    buffer (`RangeFile.readinto`'s `b`), and the file is freed without the
    garbage collector: a cycle of ours freed only at exit made the process
    die of SIGSEGV there.
    """
    import gc
    import weakref

    from grain_cells.hdf5 import _open as hdf5_open
    from grain_cells.storage.remote import version_of

    url, path, _ = served
    made = []
    init = hdf5_open.RangeFile.__init__

    def record(self, *args):
        init(self, *args)
        made.append(weakref.ref(self))

    monkeypatch.setattr(hdf5_open.RangeFile, "__init__", record)
    stat = version_of(url, {"verify_reads": True})
    os.truncate(path, 1000)  # caught at HDF5's first read
    gc.disable()
    try:  # not pytest.raises: its record of the error would keep the file
        message = held = None
        try:
            hdf5_open.open_remote(url, {"verify_reads": True}, stat)
        except errors.SourceChangedError as e:
            # (Not this frame: reading its locals would keep `e`.)
            message, held = str(e), _buffers_held(e.__traceback__.tb_next)
        assert message is not None and "verify_reads" in message, message
        assert not held, held
        assert [r() for r in made] == [None]
    finally:
        gc.enable()


def _buffers_held(tb) -> list:
    """(function, name) of each local of the traceback's frames that is a
    Cython view of a C buffer (what h5py hands `readinto`)."""
    held = []
    while tb is not None:
        for name, value in tb.tb_frame.f_locals.items():
            if type(value).__module__ != "builtins" and "memoryview" in repr(
                type(value)
            ):
                held.append((tb.tb_frame.f_code.co_name, name))
        tb = tb.tb_next
    return held


def test_verify_reads_sees_a_change_the_sampled_windows_miss(tmp_path):
    """One changed value in the middle: outside the 32 sampled windows."""
    if nginx_folder.find_nginx() is None:
        pytest.skip(f"nginx is not installed: {nginx_folder.INSTALL_HINT}")
    path = pathlib.Path(_write(tmp_path / "big.h5ad", 1, n_cells=4000))
    with NginxFolder(tmp_path / "root", objects={"b/big.h5ad": path}) as server:
        _change_one_byte_outside_the_windows(f"{server.endpoint_url}/b/big.h5ad", path)


def _change_one_byte_outside_the_windows(url, path):
    source = grain_cells.AnnDataSource(
        url, block_size=10, storage_options={"verify_reads": True}
    )
    stat, sampled = versions.head(url), versions.version_of(url).content
    data = bytearray(path.read_bytes())
    windows = versions.content_windows(len(data))
    at = next(
        o
        for o in range(len(data) // 2, len(data))
        if data[o] and not any(a <= o < b for a, b in windows)
    )
    st = os.stat(path)
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert versions.head(url) == stat
    assert versions.version_of(url).content == sampled  # the default checks pass
    with pytest.raises(errors.SourceChangedError, match="verify_reads"):
        source.read(np.arange(source.num_cells))
    with pytest.raises(errors.SourceChangedError, match="bytes differ"):
        source.verify_files()


def _heads_to_reopen(source) -> int:
    """HEADs this process sends to reopen `source`'s object and read 3 cells."""
    source.close()  # (the open-file bound closes objects the same way)
    before = object_store.request_counts().get("head", 0)
    source.read(np.arange(3))
    return object_store.request_counts().get("head", 0) - before


def test_a_reopen_reads_the_sampled_bytes_once_per_content_check_s(
    served, versions_on_disk
):
    """A process reopening an object whose bytes it read less than
    `content_check_s` ago does not read them again (a HEAD and 32 window
    GETs per reopen, each time the open-file bound closed the object); the
    periodic check that a reopen leaves due still sees a rewrite.
    """
    url, path, _ = served
    want = anndata.read_h5ad(path).X[:3].toarray()
    source = grain_cells.AnnDataSource(url, block_size=10)
    np.testing.assert_array_equal(source.read(np.arange(3)).X.toarray(), want)
    assert _heads_to_reopen(source) == 0
    np.testing.assert_array_equal(source.read(np.arange(3)).X.toarray(), want)

    every = grain_cells.AnnDataSource(
        url, block_size=10, storage_options={"content_check_s": 0}
    )
    every.read(np.arange(3))
    assert _heads_to_reopen(every) >= 1  # due at each open
    _rewrite_keeping_mtime(path, versions_on_disk[1], url)
    every.close()
    with pytest.raises(errors.SourceChangedError, match="when a process opened it"):
        every.read(np.arange(3))
    # The other source's reader: its check is due once this process has
    # found other bytes there (not `content_check_s` after its own last).
    with pytest.raises(errors.SourceChangedError, match="bytes differ"):
        source.read_blocks([0])


def test_opens_under_the_open_file_bound_read_the_saved_byte_layouts(
    versions_on_disk, tmp_path, monkeypatch
):
    """Two objects with one open at a time: a process's first open of each
    reads the byte layouts its build saved and each reopen those of the
    first open, with no HDF5 open (each open was a whole HDF5 open: a HEAD,
    32 window GETs and HDF5's metadata); the sampled bytes are read at the
    first open and then once `content_check_s` has passed, and see a rewrite.
    """
    if nginx_folder.find_nginx() is None:
        pytest.skip(f"nginx is not installed: {nginx_folder.INSTALL_HINT}")
    paths = [tmp_path / "a.h5ad", tmp_path / "b.h5ad"]
    for p in paths:
        shutil.copyfile(versions_on_disk[0], p)
    objects = {f"b/{p.name}": p for p in paths}
    want = np.vstack([anndata.read_h5ad(paths[0]).X[:10].toarray()] * 2)
    with NginxFolder(tmp_path / "root", objects=objects) as server:
        urls = [f"{server.endpoint_url}/{name}" for name in objects]
        for check_s, heads in ((60, 2), (0, 8)):
            options = {"content_check_s": check_s}
            built = grain_cells.AnnDataSource(
                urls, block_size=10, max_open_files=1, storage_options=options
            )
            source = pickle.loads(pickle.dumps(built))  # a worker's: nothing open
            versions._content_read.clear()  # nor sampled (as after a fork)
            opens = hdf5_opens(monkeypatch)
            before = object_store.request_counts().get("head", 0)
            n = len(source) // 2  # blocks per object
            for _ in range(4):  # each pass opens both objects in turn
                np.testing.assert_array_equal(
                    source.read_blocks([0, n]).X.toarray(), want
                )
            sent = object_store.request_counts().get("head", 0) - before
            assert opens == [] and sent >= heads, (check_s, opens, sent)
            assert check_s == 0 or sent == heads
        _rewrite_keeping_mtime(paths[1], versions_on_disk[1], urls[1])
        with pytest.raises(errors.SourceChangedError, match="bytes differ"):
            source.read_blocks([0, n])  # (content_check_s=0: due at each open)


def test_verify_reads_is_checked():
    with pytest.raises(ValueError, match="verify_reads"):
        versions.verify_reads({"verify_reads": "yes"})


def test_unchanged_object_passes_every_check(served):
    url = served[0]
    options = {"content_check_s": 0}
    source = grain_cells.AnnDataSource(url, block_size=10, storage_options=options)
    assert source.file_identity(0).stat.content.startswith("sha256:")
    source.verify_files()
    want = anndata.read_h5ad(served[1])
    rows = np.array([299, 0, 150])
    np.testing.assert_array_equal(source.read(rows).X.toarray(), want.X[rows].toarray())


@pytest.mark.parametrize(
    "url, etag, size, follows",
    [
        pytest.param(
            "s3://b/k", '"0cc175b9c0f1b6a831c399e269772661"', 9, True, id="s3-md5"
        ),
        pytest.param(
            "s3://b/k",
            '"9b2cf535f27731c974343645a3985328-12"',
            10,
            True,
            id="s3-multipart",
        ),
        pytest.param("gs://b/k", '"CJ+Dq4X1/4kDEAE="', 10, True, id="gcs"),
        pytest.param(
            "s3://b/k", '"6b081b08-dff8"', 0xDFF8, False, id="nginx-behind-s3-url"
        ),
        pytest.param("s3://b/k", '"dff8-5f1e2c3a4b5c6"', 0xDFF8, False, id="apache"),
        pytest.param("s3://b/k", 'W/"abc"', 10, False, id="weak"),
        pytest.param("s3://b/k", "", 10, False, id="none"),
        pytest.param(
            "https://h/k", '"0cc175b9c0f1b6a831c399e269772661"', 9, False, id="http"
        ),
    ],
)
def test_which_etags_follow_content(url, etag, size, follows):
    stat = FileStat(0, 0, size, 0, 0, etag)
    assert versions.tag_follows_content(url, stat) is follows


def test_content_windows_cover_the_start_and_the_end():
    assert versions.content_windows(0) == []
    assert versions.content_windows(1000) == [(0, 1000)]
    size = 10 << 20
    windows = versions.content_windows(size)
    assert len(windows) == versions.CONTENT_WINDOWS
    assert windows[0][0] == 0 and windows[-1][1] == size
    assert all(b - a == versions.CONTENT_WINDOW for a, b in windows)


@pytest.mark.parametrize("bad", [-1, "60", float("nan"), True])
def test_content_check_s_is_checked(bad):
    with pytest.raises(ValueError, match="content_check_s"):
        versions.content_check_s({"content_check_s": bad})
