"""Object-store reads under faults: retries, the named error, changed objects.

A real S3-compatible server on loopback (`grain_cells.testing.S3FolderServer`,
serving a temporary folder) behind `FaultProxy`, which answers chosen range
GETs with 500 or 503 SlowDown, drops connections mid-body and stalls
responses. Checked: a run whose faults are retried gives exactly the
minibatches of a clean run (and of the local file); retries that run out
raise `ObjectStoreError` naming URL, byte range, status and attempts, within
a bounded time (the bound is a hang guard, not a speed figure); an object
replaced mid-run raises `SourceChangedError`.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import time

import numpy as np
import pytest

obstore = pytest.importorskip(
    "obstore", reason="obstore is not installed: pip install grain_cells[cloud]"
)

import grain_cells  # noqa: E402
from grain_cells.storage.remote import _store as store_retries  # noqa: E402
from grain_cells.testing import Fault, ServedFolder, always, every  # noqa: E402

BUCKET = "cells"
HANG_GUARD_S = 20.0
FAST_RETRIES = {
    "max_retries": 4,
    "backoff": {
        "init_backoff": datetime.timedelta(milliseconds=5),
        "max_backoff": datetime.timedelta(milliseconds=50),
    },
    "retry_timeout": datetime.timedelta(seconds=10),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory, csr_paths):
    """The conftest files in a bucket, served on loopback behind a proxy.

    Both run in child processes (`ServedFolder`): never in threads of the
    process that holds h5py's lock while it waits for them.
    """
    root = tmp_path_factory.mktemp("buckets")
    (root / BUCKET).mkdir()
    for path in csr_paths:
        shutil.copy(path, root / BUCKET / os.path.basename(path))
    try:
        stack = ServedFolder(root).start()
    except RuntimeError as e:
        pytest.skip(f"cannot start the local S3 server on loopback: {e}")
    yield root, stack
    stack.stop()


@pytest.fixture
def proxy(served):
    _, stack = served
    stack.set_rule(None)
    stack.stats(reset=True)
    yield stack
    stack.set_rule(None)


def urls(csr_paths) -> list[str]:
    return [f"s3://{BUCKET}/{os.path.basename(p)}" for p in csr_paths]


def options(proxy, retry=None, client=None) -> dict:
    return {
        "endpoint_url": proxy.endpoint_url,
        "access_key_id": "test",
        "secret_access_key": "test",
        "region": "us-east-1",
        "retry_config": retry or FAST_RETRIES,
        "client_options": client or {},
    }


def minibatches(paths, storage_options=None, worker_count=0, n=None):
    source = grain_cells.AnnDataSource(
        paths, block_size=5, obs_columns=("idx",), storage_options=storage_options
    )
    sampler = grain_cells.BlockSampler(len(source), seed=3, num_epochs=1)
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=grain_cells.fetch_operations(
            source, batch_size=4, fetch_factor=5, seed=3
        ),
        worker_count=worker_count,
    )
    out = []
    iterator = iter(loader)
    try:
        for batch in iterator:
            out.append({k: np.array(v) for k, v in batch.items()})
            if n is not None and len(out) == n:
                break
    finally:
        iterator.close()
    return out


def assert_same(a, b):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


# -- the parts themselves ----------------------------------------------------


def test_server_serves_ranges_and_etags(served, proxy, csr_paths):
    root, _ = served
    store = obstore.store.S3Store(
        BUCKET,
        endpoint=proxy.endpoint_url,
        access_key_id="test",
        secret_access_key="test",
        region="us-east-1",
        client_options={"allow_http": True},
    )
    name = os.path.basename(csr_paths[0])
    data = (root / BUCKET / name).read_bytes()
    meta = obstore.head(store, name)
    assert meta["size"] == len(data)
    assert meta["e_tag"] == grain_cells.testing.object_etag(
        os.stat(root / BUCKET / name)
    )
    got = obstore.get(store, name, options={"range": (100, 2100)}).bytes()
    assert bytes(got) == data[100:2100]
    with pytest.raises(obstore.exceptions.PreconditionError):
        obstore.get(store, name, options={"range": (0, 10), "if_match": '"x"'})
    listed = [m["path"] for m in obstore.list(store).collect()]
    assert sorted(listed) == sorted(os.path.basename(p) for p in csr_paths)
    stats = proxy.stats()
    assert stats["range_gets"] == 2 and stats["requests"] == 4  # + HEAD, LIST


@pytest.mark.parametrize("after", [0, 150, 1500], ids=["no-answer", "headers", "body"])
def test_dropped_connections_are_retried(served, proxy, csr_paths, after):
    root, _ = served
    name = os.path.basename(csr_paths[1])
    data = (root / BUCKET / name).read_bytes()
    store = obstore.store.S3Store(
        BUCKET,
        endpoint=proxy.endpoint_url,
        access_key_id="test",
        secret_access_key="test",
        region="us-east-1",
        client_options={"allow_http": True},
        retry_config=FAST_RETRIES,
    )
    proxy.set_rule(every(2, Fault.drop(after_bytes=after)))
    got = obstore.get(store, name, options={"range": (0, 4000)}).bytes()
    assert bytes(got) == data[:4000]
    assert proxy.stats()["faults"] == 1


def test_retry_policy_defaults_and_overrides():
    assert store_retries.retry_config()["max_retries"] == 10
    merged = store_retries.retry_config(
        {"retry_config": {"max_retries": 2, "backoff": {"base": 3}}}
    )
    assert merged["max_retries"] == 2
    assert merged["backoff"]["base"] == 3
    assert merged["backoff"]["init_backoff"] == datetime.timedelta(milliseconds=100)
    assert merged["retry_timeout"] == datetime.timedelta(seconds=60)
    timeouts = store_retries.client_options({"client_options": {"timeout": "5s"}})
    assert timeouts["timeout"] == "5s"
    assert timeouts["connect_timeout"] == datetime.timedelta(seconds=5)
    with pytest.raises(ValueError, match=r"unknown keys \['retries'\]"):
        store_retries.retry_config({"retry_config": {"retries": 2}})


def test_client_options_keep_the_environment(monkeypatch):
    # Explicit client options replace obstore's own reading of these.
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    assert store_retries.client_options()["allow_http"] == "true"
    given = {"client_options": {"allow_http": False}}
    assert store_retries.client_options(given)["allow_http"] is False


# -- through the source and the loader ---------------------------------------


@pytest.fixture(scope="module")
def clean(served, csr_paths):
    """Minibatches of the local files: what every remote run must give."""
    return minibatches(csr_paths)


def test_clean_remote_run_equals_local(proxy, csr_paths, clean):
    assert_same(minibatches(urls(csr_paths), options(proxy)), clean)
    assert proxy.stats()["faults"] == 0


@pytest.mark.parametrize(
    "rule",
    [
        pytest.param(every(2, Fault.server_error()), id="500"),
        pytest.param(every(2, Fault.slow_down(), first=1), id="503-slowdown"),
        pytest.param(every(3, Fault.drop(after_bytes=100)), id="dropped"),
        pytest.param(every(5, Fault.stall(1.0), limit=2), id="stalled"),
    ],
)
def test_retried_faults_give_identical_minibatches(proxy, csr_paths, clean, rule):
    proxy.set_rule(rule)
    # A stalled request is abandoned after the client's timeout and retried.
    client = {"timeout": datetime.timedelta(milliseconds=400)}
    got = minibatches(urls(csr_paths), options(proxy, client=client))
    assert proxy.stats()["faults"] > 0
    assert_same(got, clean)


@pytest.mark.slow
def test_retried_faults_with_workers(proxy, csr_paths):
    clean = minibatches(csr_paths, worker_count=2)  # the order follows workers

    def mixed(request):
        # Every other range GET fails, in turns: 500, 503 SlowDown, dropped.
        kinds = [None, Fault.server_error(), None, Fault.slow_down(), None]
        kinds.append(Fault.drop(100))
        return kinds[request.index % 6] if request.index >= 0 else None

    proxy.set_rule(mixed)
    # Two processes' requests interleave: allow runs of faults.
    retry = {**FAST_RETRIES, "max_retries": 10}
    got = minibatches(urls(csr_paths), options(proxy, retry), worker_count=2)
    assert proxy.stats()["faults"] > 0
    assert_same(got, clean)


@pytest.mark.parametrize(
    ("fault", "status", "cause"),
    [
        pytest.param(Fault.server_error(), 500, "HTTP 500", id="500"),
        pytest.param(Fault.slow_down(), 503, "SlowDown", id="503-slowdown"),
        pytest.param(Fault.drop(after_bytes=100), None, "dropped", id="dropped"),
        pytest.param(Fault.stall(30.0), None, "timed out", id="stalled"),
    ],
)
def test_exhausted_retries_raise_the_named_error(
    proxy, csr_paths, fault, status, cause
):
    retry = {**FAST_RETRIES, "max_retries": 2}
    client = {"timeout": datetime.timedelta(milliseconds=300)}
    source = grain_cells.AnnDataSource(
        urls(csr_paths), block_size=5, storage_options=options(proxy, retry, client)
    )
    proxy.set_rule(always(fault))
    start = time.monotonic()
    with pytest.raises(grain_cells.errors.ObjectStoreError) as info:
        source.read_blocks([0])
    elapsed = time.monotonic() - start
    assert elapsed < HANG_GUARD_S
    error = info.value
    assert error.url == urls(csr_paths)[0]
    assert error.status == status
    assert cause in error.cause
    lo, hi = error.byte_range
    assert 0 <= lo < hi <= os.path.getsize(csr_paths[0])
    message = str(error)
    assert error.url in message and f"bytes {lo}-{hi - 1}" in message
    assert "retry_config" in message  # the fix
    if status is not None:  # obstore counts retries of answered requests
        assert error.attempts == 3
        # The failed GET was sent 3 times; a read may send its indices and
        # data GETs at once, and the other one stops when the first fails.
        assert proxy.stats()["faults"] >= 3


def test_a_failed_open_raises_before_the_next_object_is_tried(served, csr_paths):
    """A fresh process's fetch over every object, the store failing every GET.

    Opening an object pins its `indptr`; a pin that failed was ignored, so
    the fetch opened the next object and spent its retries too (a worker's
    fetch of 64 objects: 5-42 s before the error). The first failure ends it.
    S3-shaped ETags: an open then sends no request before the pin.
    """
    root, _ = served
    with ServedFolder(root, opaque_etags=True) as stack:
        retry = {**FAST_RETRIES, "max_retries": 1}
        source = grain_cells.AnnDataSource(
            urls(csr_paths), block_size=5, storage_options=options(stack, retry)
        )
        fresh = pickle.loads(pickle.dumps(source))  # as a worker: none open
        stack.stats(reset=True)
        stack.set_rule(always(Fault.slow_down()))
        with pytest.raises(grain_cells.errors.ObjectStoreError) as info:
            fresh.read_blocks(range(len(fresh)))
        assert info.value.url in urls(csr_paths) and info.value.attempts == 2
        assert stack.stats()["faults"] == 2  # one GET, sent twice; no other's
        # The array is named too (the GET's error names only the object).
        notes = getattr(info.value, "__notes__", [])
        assert f"reading /X/indptr of {info.value.url}" in " ".join(notes), notes


@pytest.mark.parametrize(
    "workers", [0, pytest.param(2, marks=pytest.mark.slow, id="2")], ids=str
)
def test_exhausted_retries_through_the_loader(proxy, csr_paths, workers):
    retry = {**FAST_RETRIES, "max_retries": 1}
    paths = urls(csr_paths)
    source = grain_cells.AnnDataSource(
        paths, block_size=5, storage_options=options(proxy, retry)
    )
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=0, num_epochs=1),
        operations=grain_cells.fetch_operations(source, batch_size=4, fetch_factor=5),
        worker_count=workers,
    )
    proxy.set_rule(always(Fault.slow_down()))
    with pytest.raises(grain_cells.errors.ObjectStoreError, match="SlowDown") as info:
        for _ in loader:
            pass
    # Intact across worker processes: the attributes, not only the text.
    assert info.value.url in paths and info.value.status == 503
    # The retries ran out as configured, in the workers too (no wall-clock
    # bound here: two worker starts alone took over 20 s on a loaded machine).
    assert info.value.attempts == 2


def test_object_replaced_mid_run_raises(served, proxy, csr_paths, tmp_path):
    root, _ = served
    name = os.path.basename(csr_paths[1])
    # A copy of its own, so the module's other tests keep the original.
    target = root / BUCKET / f"replaced-{name}"
    shutil.copy(csr_paths[1], target)
    url = f"s3://{BUCKET}/replaced-{name}"
    source = grain_cells.AnnDataSource(
        url, block_size=5, storage_options=options(proxy)
    )
    assert len(source.read_blocks([0])) > 0
    # Same bytes, new object: an overwrite (a new ETag) mid-run.
    fresh = tmp_path / "new.h5ad"
    shutil.copy(csr_paths[1], fresh)
    os.replace(fresh, target)
    with pytest.raises(grain_cells.errors.SourceChangedError, match=url):
        source.read_blocks(list(range(len(source))))


def _same_layout_pair(tmp_path) -> tuple[str, str]:
    """Two .h5ad files whose X pieces sit at the same byte offsets but whose
    values and gene indices differ: bytes of one read as if of the other
    would give cells of neither."""
    import anndata
    import h5py
    import scipy.sparse

    n_cells, n_genes = 4000, 100
    pattern = scipy.sparse.random(
        n_cells, n_genes, density=0.3, format="csr", random_state=1
    )
    rows = np.repeat(np.arange(n_cells), np.diff(pattern.indptr))
    paths = []
    for sign, name in ((1, "old.h5ad"), (-1, "new.h5ad")):
        x = pattern.copy()
        x.data = (sign * (rows * 1000 + x.indices + 1)).astype(np.float32)
        if sign < 0:  # the same row lengths, other genes
            x.indices = (n_genes - 1 - x.indices).astype(x.indices.dtype)
            x.has_sorted_indices = False
            x.sort_indices()
        path = str(tmp_path / name)
        anndata.AnnData(X=x).write_h5ad(path)
        paths.append(path)
    with h5py.File(paths[0]) as a, h5py.File(paths[1]) as b:
        for key in ("X/data", "X/indices", "X/indptr"):
            assert a[key].id.get_offset() == b[key].id.get_offset(), key
    return paths[0], paths[1]


def test_object_replaced_between_the_gets_of_a_batch_raises(served, proxy, tmp_path):
    """GETs of one batch carry no `If-Match`: the object is replaced (same
    layout, other values) after the batch's first GET, so its second returns
    the new version's bytes; the HEAD after the batch must refuse the mix
    (its message says "detected after a read", If-Match's does not)."""
    root, _ = served
    old, new = _same_layout_pair(tmp_path)
    target = root / BUCKET / "mixed.h5ad"
    shutil.copy(old, target)
    staged = root / "staged.h5ad"  # outside the bucket, same file system
    shutil.copy(new, staged)
    url = f"s3://{BUCKET}/mixed.h5ad"
    source = grain_cells.AnnDataSource(
        url, block_size=5, storage_options=options(proxy)
    )
    assert len(source.read_blocks([0])) == 5  # indptr is read and pinned
    seen = [0]

    def replace_before_the_second_get(request):
        if request.index >= 0:
            seen[0] += 1
            if seen[0] == 2:
                os.replace(staged, target)
        return None

    proxy.set_rule(replace_before_the_second_get)
    # Blocks ~90 KB apart: no two pieces merge, so each dataset's pieces
    # are several requests of one batch (a lone request carries If-Match).
    keys = list(range(1, len(source), 150))
    with pytest.raises(grain_cells.errors.SourceChangedError, match="after a read"):
        source.read_blocks(keys)
    assert not staged.exists()  # the replacement did happen mid-read
