"""A forked child drops its parent's per-process state right after the fork.

`grain_cells._util.fork` runs the registered resets in the child: module
caches (thread pools, object-store clients) and per-instance ones (a source's
open files), the latter held by weak references.
"""

from __future__ import annotations

import gc
import os
import pickle
import select
import signal
import warnings
import weakref

import anndata
import numpy as np
import pytest
from conftest import FILE_SIZES

from grain_cells._util import fork
from grain_cells.io import _range_reads as range_reads
from grain_cells.io._file_set import FileSet, OpenFiles

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
CHILD_TIMEOUT_S = 30


def in_fork(function):
    """`function()`'s result (picklable) computed in a forked child."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        # Python >= 3.12 warns when a process with threads forks; the child
        # here only runs `function` and exits.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: report, then leave without running pytest's exit
        try:
            os.close(read_end)
            payload = pickle.dumps(("ok", function()))
        except BaseException as e:
            payload = pickle.dumps(("error", repr(e)))
        with os.fdopen(write_end, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as data:
        if not select.select([data], [], [], CHILD_TIMEOUT_S)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung (on a lock its parent held?)")
        payload = data.read()
    os.waitpid(pid, 0)
    status, value = pickle.loads(payload)
    assert status == "ok", value
    return value


class Cache:
    def __init__(self):
        self.entries = {"parent": 1}
        fork.in_child_of(self, Cache.reset)

    def reset(self):
        self.entries = {}


def test_resets_run_in_the_child_only():
    module_cache = {"parent": 1}
    fork.in_child(module_cache.clear)
    cache = Cache()
    assert in_fork(lambda: (dict(module_cache), cache.entries)) == ({}, {})
    assert module_cache == {"parent": 1}
    assert cache.entries == {"parent": 1}


def test_a_registration_does_not_keep_its_instance_alive():
    cache = Cache()
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None
    assert in_fork(lambda: "forked") == "forked"  # no reset of a dead instance


def test_a_forked_child_reads_with_its_own_handles(csr_paths):
    files = FileSet.inspect(
        csr_paths,
        element="X",
        obs_names=(),
        genes=None,
        join="exact",
        obs_missing="error",
    )
    handles = OpenFiles(files, read_threads=2)
    offsets = np.cumsum([0, *FILE_SIZES])
    rows = np.array([97, 200])
    expected = anndata.read_h5ad(csr_paths[1]).X[[0, 103]].toarray()
    range_reads.read_rows(handles, offsets, np.array([0, 96, 97, 200, 287]))
    for start in offsets[:-1]:  # a read of one file opens it in the bound
        range_reads.read_rows(handles, offsets, np.array([start]))
    assert handles.open_count  # the parent holds its files open

    def child():
        opened = handles.open_count  # what the child holds after the fork
        return opened, range_reads.read_rows(handles, offsets, rows).X.toarray()

    opened, got = in_fork(child)
    assert opened == 0
    np.testing.assert_array_equal(got, expected)
    # The parent's handles are untouched by the child's reset.
    assert handles.open_count
    got = range_reads.read_rows(handles, offsets, rows).X.toarray()
    np.testing.assert_array_equal(got, expected)


def test_module_pools_are_the_childs_own():
    parent_pool = fork.thread_pool("test", 1)
    parent_tokens = fork.thread_pool("grain_cells-tokens", 64)

    def child():
        return (
            fork.thread_pool("test", 1) is parent_pool,
            fork.thread_pool("grain_cells-tokens", 64) is parent_tokens,
            fork.thread_pool("test", 1).submit(lambda: 7).result(),
        )

    assert in_fork(child) == (False, False, 7)
    assert fork.thread_pool("test", 1) is parent_pool


def test_a_process_cache_makes_each_value_once_per_process():
    cache = fork.ProcessCache()
    made = []

    def make():
        made.append(1)
        return object()

    first = cache.get_or_make("k", make)
    assert cache.get_or_make("k", make) is first and len(made) == 1
    cache._lock.acquire()  # as a parent thread holding it at the fork would
    try:
        in_child = in_fork(lambda: (len(cache), cache.get_or_make("k", make) is first))
    finally:
        cache._lock.release()
    assert in_child == (0, False)  # emptied, and its lock is the child's own
    assert cache.get_or_make("k", make) is first


def _hold_inherited(kept: dict, dropped: dict, want: dict, go, out) -> None:
    """A fork-method child: after the parent read on, compare and then write."""
    go.wait(120)
    changed = [
        key
        for name, batch in (("kept", kept), ("dropped", dropped))
        for key in batch
        if not np.array_equal(batch[key], want[name][key])
    ]
    for batch in (kept, dropped):
        for arr in batch.values():
            if arr.size:
                arr.reshape(-1)[:] = 0  # must not reach the parent
    out.send(changed)


@pytest.mark.slow
def test_a_fork_child_keeps_inherited_leases_private(csr_paths, helpers):
    """A child made with multiprocessing's fork method while the trainer holds
    leased minibatches: the one the parent then drops (its slot reused by the
    worker over 300 more minibatches) and the one it keeps read unchanged in
    the child, and the child's writes do not reach the parent."""
    import multiprocessing

    *_, loader = helpers.build(csr_paths, worker_count=2, num_epochs=None)
    iterator = iter(loader)
    try:
        kept, dropped = next(iterator), next(iterator)
        assert not any(a.flags.owndata for a in [*kept.values(), *dropped.values()])
        want = {"kept": helpers.detach(kept), "dropped": helpers.detach(dropped)}
        ctx = multiprocessing.get_context("fork")
        go = ctx.Event()
        got, out = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_hold_inherited, args=(kept, dropped, want, go, out))
        child.start()
        del dropped  # the parent reads on: its slot goes back to the worker
        for _ in range(300):
            next(iterator)
        go.set()
        assert got.poll(60), "the child did not answer"
        assert got.recv() == [], "the child's inherited minibatch changed"
        child.join(30)
        assert child.exitcode == 0
        for key, arr in kept.items():  # the child's writes stayed in the child
            np.testing.assert_array_equal(arr, want["kept"][key], err_msg=key)
    finally:
        helpers.close_iterator(iterator)
