"""The decoded-`indptr` cache: one bounded LRU per process, emptied with its readers.

Each compressed file's `indptr` reader used to keep up to 64 MiB of decoded
chunks for the life of the process; with many files open that was
unbounded. Now every reader shares `SHARED`, trimmed to the
readers' `cache_bytes`, and a reader's chunks leave when it is collected.
"""

from __future__ import annotations

import gc
import os
import signal
import time

import h5py
import numpy as np
import pytest

from grain_cells.formats import ChunkCache
from grain_cells.hdf5._chunks import ChunkedReader


@pytest.fixture
def gz_files(tmp_path):
    paths = []
    for i in range(3):
        path = str(tmp_path / f"ptr{i}.h5")
        with h5py.File(path, "w") as f:
            f.create_dataset(
                "indptr",
                data=np.arange(10_000, dtype=np.int64) * (i + 1),
                chunks=(1_000,),
                compression="gzip",
            )
        paths.append(path)
    return paths


def _reader(path, cache_bytes):
    f = h5py.File(path)
    fd = os.open(path, os.O_RDONLY)
    return f, fd, ChunkedReader.create(f["indptr"], path, fd, cache_bytes=cache_bytes)


def test_one_budget_for_all_readers(gz_files, monkeypatch):
    cache = ChunkCache()
    monkeypatch.setattr("grain_cells.hdf5._chunks.SHARED", cache)
    budget = 5 * 8_000  # five decoded chunks, over three readers of ten each
    opened = [_reader(p, budget) for p in gz_files]
    try:
        for i, handles in enumerate(opened):
            reader = handles[2]
            for a in range(0, 10_000, 1_000):
                out = np.empty(3, np.int64)
                reader.read(np.array([a + 10]), np.array([a + 13]), out)
                np.testing.assert_array_equal(out, np.arange(a + 10, a + 13) * (i + 1))
            assert cache.nbytes <= budget
        assert cache.nbytes == budget
        # A hit returns the same values without decoding again.
        reader = opened[-1][2]
        out = np.empty(2, np.int64)
        reader.read(np.array([9_998]), np.array([10_000]), out)
        np.testing.assert_array_equal(out, [9_998 * 3, 9_999 * 3])
    finally:
        for handles in opened:
            handles[0].close()
            os.close(handles[1])
    del opened, reader, handles
    gc.collect()
    assert cache.nbytes == 0  # every reader gone: its chunks too


def test_uncached_readers_keep_nothing(gz_files, monkeypatch):
    cache = ChunkCache()
    monkeypatch.setattr("grain_cells.hdf5._chunks.SHARED", cache)
    f, fd, reader = _reader(gz_files[0], 0)
    try:
        out = np.empty(10_000, np.int64)
        reader.read(np.array([0]), np.array([10_000]), out)
        np.testing.assert_array_equal(out, np.arange(10_000))
        assert cache.nbytes == 0
    finally:
        f.close()
        os.close(fd)


def test_a_drop_while_the_lock_is_held_does_not_deadlock():
    """A reader's finalizer may run inside `get` (the collector runs anywhere)."""
    import threading

    cache = ChunkCache()
    cache.put(1, 0, np.zeros(10), budget=1 << 20)
    cache.put(2, 0, np.ones(10), budget=1 << 20)
    done = threading.Event()

    def collected_inside_get():
        with cache._lock:  # as `get` holds it when the finalizer runs
            cache.drop(1)
        done.set()

    threading.Thread(target=collected_inside_get, daemon=True).start()
    assert done.wait(10), "drop() waited on the lock its own thread held"
    assert cache.get(1, 0) is None  # gone at the next use of the lock
    assert cache.get(2, 0) is not None
    assert cache.nbytes == 80


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_a_thread_holds_the_lock_reads_on():
    """A fork while another thread is inside the cache (a reader thread of the
    parent) gives the child an empty cache with a free lock, not a deadlock.
    """
    cache = ChunkCache()
    cache.put(1, 0, np.arange(4), 1 << 20)
    cache._lock.acquire()  # as a parent's reader thread inside get/put would
    try:
        pid = os.fork()
        if pid == 0:  # the child: only its own thread, the lock copied held
            chunk = cache.get(1, 0)
            cache.put(1, 1, np.arange(4), 1 << 20)
            os._exit(0 if chunk is None and cache.nbytes == 32 else 1)
    finally:
        cache._lock.release()
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child deadlocked on the cache's lock")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(done[1]) == 0
