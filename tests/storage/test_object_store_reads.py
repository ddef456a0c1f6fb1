"""How remote reads spend requests: GETs in flight, and no over-fetch.

A real S3-compatible server (`grain_cells.testing.S3FolderServer`) behind a
proxy adding 20 ms per request, both in child processes (`ServedFolder`),
serves a file whose blocks are large enough (38 KB of `data` and as much of
`indices` per 16-cell block) that the request counts mean something. The
server's counters (`ServedFolder.stats`: connections accepted, range GETs,
bytes sent) bound what a read costs. The value stored at (row i, gene j) is
`i * 4096 + j` (float32, exact), so every test knows which cells came back.
"""

from __future__ import annotations

import types

import anndata
import numpy as np
import pytest
import scipy.sparse as sp
from conftest import close_iterator, take
from grain import sharding

import grain_cells
from grain_cells.pipeline._stage import Position, ReadFetch
from grain_cells.sampling._stream import BlockStream
from grain_cells.storage.remote import _store as object_store
from grain_cells.testing import ServedFolder

BUCKET = "cells"
N_CELLS, N_GENES, PER_CELL, BLOCK = 2048, 4000, 600, 16
URL = f"s3://{BUCKET}/wide.h5ad"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The file (local path) and the stack serving it with 20 ms per request."""
    root = tmp_path_factory.mktemp("buckets")
    (root / BUCKET).mkdir()
    path = str(root / BUCKET / "wide.h5ad")
    rng = np.random.default_rng(0)
    # PER_CELL distinct random genes per cell (argpartition: 0.1 CPU-s, where
    # a full argsort of the 2048 x 4000 draws took 0.5).
    draws = rng.random((N_CELLS, N_GENES))
    genes = np.sort(np.argpartition(draws, PER_CELL, axis=1)[:, :PER_CELL], axis=1)
    rows = np.repeat(np.arange(N_CELLS), PER_CELL)
    values = (rows * 4096 + genes.ravel()).astype(np.float32)
    indptr = np.arange(N_CELLS + 1) * PER_CELL
    x = sp.csr_matrix((values, genes.ravel(), indptr), shape=(N_CELLS, N_GENES))
    anndata.AnnData(X=x).write_h5ad(path)
    try:
        stack = ServedFolder(root, rtt_s=0.02).start()
    except RuntimeError as e:
        pytest.skip(f"cannot start the local S3 server on loopback: {e}")
    yield path, stack
    stack.stop()


def _options(stack, tag: str, **extra) -> dict:
    # A distinct (ignored) key id per test: a store of its own, so its
    # connection pool starts empty and the server's connection count tells
    # how many GETs were in flight at once.
    return stack.storage_options(access_key_id=f"test-{tag}", **extra)


def _x(batch_or_cells) -> np.ndarray:
    return batch_or_cells.X.toarray()


@pytest.mark.parametrize("bad", [0, -1, 2000, "8", True, 4.0])
def test_max_in_flight_must_be_a_positive_int(served, bad):
    _, stack = served
    with pytest.raises(ValueError, match=r"max_in_flight.*1 to 1024"):
        grain_cells.AnnDataSource(
            URL, storage_options=_options(stack, "bad", max_in_flight=bad)
        ).read_blocks([0])


def test_max_in_flight_bounds_concurrent_gets(served):
    path, stack = served
    local = grain_cells.AnnDataSource(path, block_size=BLOCK)
    # Every fourth block: more than 64 KiB apart, no two pieces merge.
    keys = np.arange(0, N_CELLS // BLOCK, 4)
    connections = {}
    for k in (2, 32):
        source = grain_cells.AnnDataSource(
            URL,
            block_size=BLOCK,
            storage_options=_options(stack, f"k{k}", max_in_flight=k),
        )
        source.read_blocks([1])  # opens the file (indptr pinned)
        stack.stats(reset=True)
        got = source.read_blocks(keys)
        stats = stack.stats()
        np.testing.assert_array_equal(_x(got), _x(local.read_blocks(keys)))
        # Two pieces per block (data and indices), each its own GET.
        assert stats["range_gets"] == 2 * keys.size
        connections[k] = stats["connections"]
    # A fetch's GETs and its read-ahead GETs (indices) use k threads each;
    # the client opens a connection per request in flight (plus the
    # metadata's, and one to replace a connection the server closed).
    assert connections[2] <= 2 * 2 + 3, connections
    assert connections[32] >= 16, connections


def _epoch(stack, tag: str, worker_count: int) -> tuple[list[dict], dict]:
    options = _options(stack, tag)
    grain_cells.AnnDataSource(URL, storage_options=options)  # metadata cached
    stack.stats(reset=True)
    source = grain_cells.AnnDataSource(URL, block_size=BLOCK, storage_options=options)
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=3, num_epochs=1),
        operations=grain_cells.fetch_operations(source, batch_size=64, fetch_factor=4),
        worker_count=worker_count,
    )
    iterator = iter(loader)
    try:
        batches = take(iterator)
    finally:
        close_iterator(iterator)
    return batches, stack.stats()


@pytest.mark.slow
def test_workers_read_ahead_only_their_own_fetches(served):
    path, stack = served
    x_bytes = N_CELLS * PER_CELL * 8  # data (float32) and indices (int32)
    blocks = N_CELLS // BLOCK
    one, one_stats = _epoch(stack, "w0", 0)
    two, two_stats = _epoch(stack, "w2", 2)
    # The same minibatches whatever the worker count, each cell once, with
    # the values anndata reads.
    assert len(one) == len(two) == N_CELLS // 64
    for a, b in zip(one, two, strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    rows = np.concatenate([b["row_ids"][b["mask"]] for b in two])
    np.testing.assert_array_equal(np.sort(rows), np.arange(N_CELLS))
    want = anndata.read_h5ad(path).X[rows[:256]].toarray()
    first = sp.vstack(
        [
            sp.csr_matrix((b["data"], b["indices"], b["indptr"]), (64, N_GENES))
            for b in two[:4]
        ]
    ).toarray()
    np.testing.assert_array_equal(first, want)
    # Each piece is fetched once: no worker reads ahead the other's fetches
    # (that would double the bytes), nothing is fetched twice. Bytes beyond
    # X's: the indptr (once per process) and the gaps (< 64 KiB, here often
    # one block of the other worker's fetch) merged between pieces.
    for stats in (one_stats, two_stats):
        assert stats["response_bytes"] <= 1.3 * x_bytes, stats
        assert stats["range_gets"] <= 2 * blocks + 8, stats
    assert two_stats["response_bytes"] <= 1.25 * one_stats["response_bytes"]


class _Recorder:
    """A source that records the blocks hinted to it."""

    block_size = 4
    hints_wanted = True  # AnnDataSource.hints_wanted

    def __init__(self):
        self.hinted: list[int] = []

    def advise(self, keys) -> None:
        self.hinted.extend(np.asarray(keys).tolist())

    def block_ranges(self, keys):
        keys = np.asarray(keys)
        return np.zeros_like(keys), keys * 4, keys * 4 + 4


class _Stream(BlockStream):
    """A sampler whose position p holds block p."""

    def __init__(self):
        super().__init__(400, 0, 1, sharding.NoSharding(), readahead_cells=0)
        self.epoch_length = 400

    def __len__(self) -> int:
        return 400

    def blocks_at(self, positions):
        return np.asarray(positions, np.int64)


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_fetch_stage_hints_own_fetches_within_the_window(stride):
    source = _Recorder()
    split = types.SimpleNamespace(
        config=types.SimpleNamespace(block_size=4), source=source, read=lambda b: []
    )
    plan = Position(_Stream(), 4)  # fetch f holds blocks 4f .. 4f + 3
    read = ReadFetch(split, plan, stride, readahead_cells=6 * 16)  # 6 fetches
    worker = stride - 1  # the last worker: fetches worker, worker + stride, ...
    for n in range(worker, 60, stride):
        before = len(source.hinted)
        read.map(n)
        fetches = sorted({k // 4 for k in source.hinted[before:]})
        # Only this worker's fetches, after n, within 6 fetches of the stream.
        assert all(
            f % stride == worker and n < f <= n + max(6, stride) for f in fetches
        )
    hinted = [k // 4 for k in source.hinted]
    assert len(hinted) == len(set(source.hinted))  # each block hinted once
    assert set(range(worker + stride, 60, stride)) <= set(hinted)


def test_fetch_stage_works_out_no_hints_while_the_source_wants_none(monkeypatch):
    """A source whose reads find the page cache warm gets no hints, and the
    stage computes no keys for them; once it wants hints again, they resume."""
    source = _Recorder()
    source.hints_wanted = False
    split = types.SimpleNamespace(
        config=types.SimpleNamespace(block_size=4), source=source, read=lambda b: []
    )
    plan = Position(_Stream(), 4)
    computed: list[int] = []
    real = Position.keys

    def keys(self, positions):
        computed.append(len(positions))
        return real(self, positions)

    monkeypatch.setattr(Position, "keys", keys)
    read = ReadFetch(split, plan, 1, readahead_cells=6 * 16)
    for n in range(10):
        read.map(n)
    assert source.hinted == []
    assert len(computed) == 10  # each fetch's own keys, none ahead
    source.hints_wanted = True
    for n in range(10, 20):
        read.map(n)
    hinted = {k // 4 for k in source.hinted}
    assert set(range(11, 20)) <= hinted


def test_reader_options_do_not_reach_the_store():
    store = object_store.store_for(
        "s3://cells/a.h5ad",
        {
            "endpoint_url": "http://127.0.0.1:1",
            "region": "us-east-1",
            "max_in_flight": 8,
        },
    )
    assert store is object_store.store_for(
        "s3://cells/a.h5ad",
        {"endpoint_url": "http://127.0.0.1:1", "region": "us-east-1"},
    )
    assert object_store.max_in_flight(None) == object_store.DEFAULT_MAX_IN_FLIGHT


def test_a_failed_batch_is_raised_after_the_others_stop_writing(monkeypatch):
    """`read_into` raises a failed batch's error after every other batch of
    the call has finished: none writes into the caller's buffer afterwards
    (a buffer the caller reuses for its next fetch).
    """
    import threading
    import time

    from grain_cells.storage import FileStat
    from grain_cells.storage.remote import RemoteByteReader

    stat = FileStat(0, 0, 1 << 30, 0, 0, etag='"e"')
    reader = RemoteByteReader(URL, {"max_in_flight": 40}, stat)
    finished = []
    lock = threading.Lock()

    def get_many(ranges):
        if ranges[0][0] == 0:
            raise OSError("the first batch's GET failed")
        time.sleep(0.3)
        with lock:
            finished.append(len(ranges))
        return [bytes(end - start) for start, end in ranges]

    monkeypatch.setattr(reader, "_get_many", get_many)
    n = 400  # pieces 1 MiB apart: one request each, several batches
    offsets = np.arange(n, dtype=np.int64) << 20
    dest = np.zeros(n * 16, np.uint8)
    with pytest.raises(OSError, match="first batch"):
        reader.read_into(dest, offsets, np.full(n, 16), np.arange(n) * 16)
    batches = len(finished)
    time.sleep(0.5)
    assert batches == len(finished) > 0  # all had finished before the raise
