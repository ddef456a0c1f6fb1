"""The slot-ring transport: every value survives slot reuse; waits do not spin.

A producer process (spawned, as Grain's workers are) writes minibatches whose
every value encodes (minibatch, position) into a ring of very few slots, so
each slot is refilled as soon as the consumer hands it back; the consumer
checks every value of every minibatch it copies out.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time

import grain
import numpy as np
import psutil
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.transport import _ring as transport
from grain_cells.transport import _shm as segments
from grain_cells.transport import _shm as shm_names
from grain_cells.transport._ring import SlotWriter as writer_for

N_BATCHES = 400
ROWS = 4096  # 4096 x 8 float64 + 4096 int64: ~300 KB per minibatch


def batch(i: int, mode: str = "put") -> dict[str, np.ndarray]:
    """Minibatch `i`: every value names i and its position.

    With `mode="writer"` sizes vary (1-4x, rising and falling), so a
    writer's slot is sometimes too small.
    """
    rows = ROWS * (1 + (i * 7 // 5) % 4) if mode == "writer" else ROWS
    base = np.arange(rows * 8, dtype=np.float64).reshape(rows, 8)
    return {
        "values": base + i * 1e6,
        "row_ids": np.arange(rows, dtype=np.int64) + i * ROWS,
        "i": np.array([i], np.int32),
    }


def written(ring: transport.SlotRing, i: int) -> transport.SlotHandle:
    """Minibatch `i` formatted through `writer_for(ring)`, as a worker does.

    Its arrays are allocated in the slot except "i" (private: `send` copies
    it in), and every third minibatch also allocates scratch it does not
    send, so the slot can overflow while the minibatch alone would fit (the
    arrays must then not be moved over themselves).
    """
    writer = writer_for(ring)
    out = {}
    for key, arr in batch(i, "writer").items():
        if key == "i":
            out[key] = arr
            continue
        if i % 3 == 0:
            writer.empty((arr.size // 2,), arr.dtype)[...] = -1
        dst = writer.empty(arr.shape, arr.dtype)
        dst[...] = arr
        out[key] = dst
    return writer.send(out)


def produce(queue, done, n: int, slots: int, mode: str = "put") -> None:
    """Producer: `n` minibatches through a ring of `slots` slots."""
    ring = transport.SlotRing(max_slots=slots)
    for i in range(n):
        queue.put(ring.put(batch(i)) if mode == "put" else written(ring, i))
    queue.put(None)
    done.get()  # keep the ring's names until the consumer is through
    ring.close()


def check(received: dict, i: int, mode: str = "put") -> None:
    expected = batch(i, mode)
    assert received.keys() == expected.keys()
    for key, want in expected.items():
        np.testing.assert_array_equal(received[key], want, err_msg=f"{i}/{key}")


@pytest.mark.parametrize(
    "slots, mode",
    [
        (1, "put"),
        pytest.param(3, "put", marks=pytest.mark.slow),
        pytest.param(1, "writer", marks=pytest.mark.slow),
        pytest.param(3, "writer", marks=pytest.mark.slow),
    ],
)
def test_every_value_survives_slot_reuse(slots, mode):
    ctx = multiprocessing.get_context("spawn")
    to_consumer, to_producer = ctx.Queue(maxsize=8), ctx.Queue()
    producer = ctx.Process(
        target=produce, args=(to_consumer, to_producer, N_BATCHES, slots, mode)
    )
    producer.start()
    try:
        held = []
        for i in range(N_BATCHES):
            got = to_consumer.get(timeout=60)  # unpickling copies out, hands back
            assert not isinstance(got, transport.ExpiredBatch)
            check(got, i, mode)
            held.append(got)
            if i % 7 == 0:  # hold some copies: they must not change either
                check(held[i // 2], i // 2, mode)
        assert to_consumer.get(timeout=60) is None
        for i in range(0, N_BATCHES, 37):
            check(held[i], i, mode)
        to_producer.put("done")
        producer.join(30)
        assert producer.exitcode == 0
    finally:
        if producer.is_alive():
            producer.kill()
        transport.release_dead_rings()


def test_a_writer_formats_in_place_and_survives_overflows():
    # In one process: each handle unpickles through the ring's socket as in
    # the trainer. After the first minibatch, arrays are written in the slot
    # (`put` only when the slot overflows) and every value comes back.
    ring = transport.SlotRing(max_slots=2)
    fallbacks = []
    put = ring.put
    ring.put = lambda *args, **kw: fallbacks.append(kw) or put(*args, **kw)
    try:
        for i in range(40):
            check(pickle.loads(pickle.dumps(written(ring, i))), i, "writer")
    finally:
        ring.close()
        view = transport._RINGS.pop(ring.name, None)
        if view is not None:
            view.close()
    assert 1 < len(fallbacks) < 10, fallbacks  # the first one, then growth


def hold_one_slot(queue, ready, done) -> None:
    """Producer: fills its only slot, then waits for it (nobody hands it back)."""
    ring = transport.SlotRing(max_slots=1)
    queue.put(ring.put(batch(0)))
    ready.set()
    start = time.monotonic()
    handle = ring.put(batch(1))  # no free slot: waits, then a one-off segment
    queue.put((handle, time.monotonic() - start))
    done.get()
    ring.close()


@pytest.mark.slow
def test_waiting_for_a_slot_does_not_spin():
    ctx = multiprocessing.get_context("spawn")
    queue, ready, done = ctx.Queue(), ctx.Event(), ctx.Queue()
    producer = ctx.Process(target=hold_one_slot, args=(queue, ready, done))
    producer.start()
    try:
        assert ready.wait(60)
        # Not consumed: the slot stays busy while the producer waits.
        time.sleep(0.3)
        cpu0 = psutil.Process(producer.pid).cpu_times()
        time.sleep(1.0)
        cpu1 = psutil.Process(producer.pid).cpu_times()
        busy = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        assert busy < 0.2, f"a producer waiting for a slot used {busy:.2f} s of CPU"
        time.sleep(transport._WAIT_S)  # past its wait: a one-off segment
        first = queue.get(timeout=60)
        second, waited = queue.get(timeout=60)
        check(first, 0)
        check(second, 1)  # the one-off segment after _WAIT_S
        assert transport._WAIT_S * 0.9 <= waited < transport._WAIT_S + 1.2
        done.put("done")
        producer.join(30)
    finally:
        if producer.is_alive():
            producer.kill()
        transport.release_dead_rings()


def test_stale_names_of_dead_processes_are_removed():
    gone = psutil.Popen(["true"])
    gone.wait()
    stale = f"/gcells_{gone.pid}_deadbeef_1"
    live = f"/gcells_{os.getpid()}_deadbeef_1"
    for name in (stale, live):
        segments.create(name, 4096)
    try:
        removed = shm_names.remove_stale()
        assert stale.lstrip("/") in removed
        assert not os.path.exists(shm_names.SHM_DIR + stale)
        assert os.path.exists(shm_names.SHM_DIR + live)  # its owner is alive
    finally:
        shm_names.unlink(stale)
        shm_names.unlink(live)


@pytest.mark.slow
def test_dataset_api_workers_use_the_ring(csr_paths, helpers):
    """Grain ships the pipeline to `mp_prefetch` workers pickled, so their
    minibatches come through the ring (not Grain's per-array segments), and
    every value is right."""
    source = grain_cells.AnnDataSource(csr_paths, block_size=5, obs_columns=["idx"])
    ds = grain_cells.cell_dataset(source, batch_size=4, fetch_factor=5, seed=2)
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    before = set(transport._RINGS)
    iterator = iter(ds)
    batches = [helpers.detach(b) for b in iterator]
    rings = {transport._RINGS[name].pid for name in set(transport._RINGS) - before}
    del iterator
    truth = helpers.Truth(source, csr_paths)
    rows = np.concatenate([b["row_ids"][b["mask"]] for b in batches])
    assert sorted(rows) == list(range(helpers.N_CELLS))
    for b in batches:
        ids = b["row_ids"][b["mask"]]
        np.testing.assert_array_equal(b["obs/idx"][: ids.size], ids)
        x = sp.csr_matrix(
            (b["data"], b["indices"], b["indptr"]), shape=(4, helpers.N_GENES)
        ).toarray()
        np.testing.assert_array_equal(x[: ids.size], truth.x(ids))
    assert len(rings) == 2, "mp_prefetch workers did not send through the ring"
    transport.release_dead_rings()


def copy_in_child(queue, paths) -> None:
    """In a multiprocessing child: a deep copy of the fetch transform."""
    import copy

    source = grain_cells.AnnDataSource(paths, block_size=5)
    _, split = grain_cells.fetch_operations(source, batch_size=4, fetch_factor=5)
    blocks = np.array([source[k] for k in range(5)], np.int64)
    batch = copy.deepcopy(split).flat_map(blocks)[0]
    queue.put(type(batch).__name__)


@pytest.mark.slow
def test_a_copy_in_one_process_returns_dicts(csr_paths):
    """Only a transform unpickled in another process than the one that pickled
    it sends slot handles; a copy made inside a child returns plain dicts."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=copy_in_child, args=(queue, csr_paths))
    child.start()
    try:
        assert queue.get(timeout=60) == "dict"
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()


def test_a_starved_ring_waits_once_not_per_minibatch(monkeypatch):
    """Nobody hands slots back (the trainer closed the iterator, or a fetch
    holds more minibatches than the ring): one wait, then one-off segments at
    once; before, every further minibatch waited `_WAIT_S` (a close took
    minutes on a 512-minibatch fetch)."""
    monkeypatch.setattr(transport, "_WAIT_S", 0.3)
    ring = transport.SlotRing(max_slots=1)
    try:
        handles = [ring.put(batch(0))]
        start = time.monotonic()
        handles += [ring.put(batch(i)) for i in range(1, 6)]
        waited = time.monotonic() - start
        assert 0.25 <= waited < 0.3 * 2, waited
        for i, h in enumerate(handles):
            check(pickle.loads(pickle.dumps(h)), i)
    finally:
        ring.close()
        view = transport._RINGS.pop(ring.name, None)
        if view is not None:
            view.close()
