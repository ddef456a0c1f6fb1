"""Minibatches leased from a worker's slot: values kept, no starving, no leaks.

The trainer hands a worker's minibatch to the user as arrays inside the
worker's shared-memory slot (a lease), and the slot goes back only when the
last of those arrays dies; beyond the ring's lease budget it copies instead.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import pickle
import time

import numpy as np
import pytest
import scipy.sparse as sp

from grain_cells.transport import _ring as transport
from grain_cells.transport import _shm as shm_names


def batch(i: int) -> dict[str, np.ndarray]:
    """Minibatch `i`: every value names i and its position."""
    return {
        "values": np.arange(3000, dtype=np.float64) + i * 1e6,
        "i": np.array([i], np.int32),
    }


def check(received: dict, i: int) -> None:
    for key, want in batch(i).items():
        np.testing.assert_array_equal(received[key], want, err_msg=f"{i}/{key}")


def leased(received: dict) -> bool:
    """Whether a minibatch's arrays are views of a slot (not private copies)."""
    return not any(arr.flags.owndata for arr in received.values())


def produce(queue, n: int, slots: int, leases: int) -> None:
    """Producer: `n` minibatches through a ring; reports how long puts waited."""
    ring = transport.SlotRing(max_slots=slots, leases=leases)
    waits = []
    for i in range(n):
        start = time.monotonic()
        handle = ring.put(batch(i))
        waits.append(time.monotonic() - start)
        queue.put(handle)
    queue.put(max(waits))
    time.sleep(60)  # killed by the test: names stay while the consumer reads


def produce_sizes(queue, n: int) -> None:
    """Producer: `n` minibatches of 1-4x the size through 3 slots, 2 lendable."""
    ring = transport.SlotRing(max_slots=3, leases=2)
    for i in range(n):
        queue.put(ring.put(sized(i)))
    time.sleep(60)  # killed by the test


def sized(i: int) -> dict[str, np.ndarray]:
    """Minibatch `i` of a size that rises and falls (slots get replaced)."""
    rows = 500 * (1 + (i * 7 // 5) % 4)
    return {"values": np.arange(rows, dtype=np.float64) + i * 1e6}


@pytest.mark.slow
def test_leases_keep_every_value_while_slots_are_reused():
    """The consumer keeps the last two minibatches (both leased, often) while
    the producer refills its remaining slot over and over: every value of
    every minibatch is checked on arrival and again when it is dropped."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue(maxsize=4)
    producer = ctx.Process(target=produce_sizes, args=(queue, 400))
    producer.start()
    try:
        window, leases = [], 0
        for i in range(400):
            got = queue.get(timeout=60)
            np.testing.assert_array_equal(got["values"], sized(i)["values"])
            leases += leased(got)
            window.append((i, got))
            if len(window) > 2:
                j, old = window.pop(0)
                np.testing.assert_array_equal(old["values"], sized(j)["values"])
        assert leases > 100, leases  # about every other one (the budget is 2)
    finally:
        producer.kill()
        producer.join(30)
        transport.release_dead_rings()


@pytest.mark.slow
def test_a_user_who_keeps_every_minibatch_gets_copies_not_a_hang():
    """With 8 slots, 4 of them lendable, a consumer keeps all 120 minibatches:
    the first 4 are leases, the rest copies, and the producer never waits for
    a slot (it would wait `_WAIT_S` each time the trainer held them all)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue(maxsize=2)
    producer = ctx.Process(target=produce, args=(queue, 120, 8, 4))
    producer.start()
    try:
        held = [queue.get(timeout=60) for _ in range(120)]
        longest_wait = queue.get(timeout=60)
        assert [leased(b) for b in held] == [True] * 4 + [False] * 116
        for i, received in enumerate(held):
            check(received, i)
        assert longest_wait < transport._WAIT_S / 2, longest_wait
    finally:
        producer.kill()
        producer.join(30)
        transport.release_dead_rings()


def test_a_lease_keeps_its_slot_until_its_last_array_dies():
    ring = transport.SlotRing(max_slots=4, leases=2)
    try:
        first = pickle.loads(pickle.dumps(ring.put(batch(0))))
        assert leased(first)
        view = transport._RINGS[ring.name]
        slot = next(iter(view.leased))
        values = first.pop("values")[10:20]  # a view of a view, alone
        del first
        gc.collect()
        assert slot in view.leased, "handed back while an array lived"
        # Until then the worker cannot reuse the slot: the next put goes
        # elsewhere and the kept values stay.
        for i in range(1, 6):
            check(pickle.loads(pickle.dumps(ring.put(batch(i)))), i)
        np.testing.assert_array_equal(values, np.arange(10, 20.0))
        del values
        assert slot not in view.leased
        ring._collect(1.0)
        assert not any(ring._busy), "the slot did not come back to the ring"
    finally:
        ring.close()
        transport.release_dead_rings()


class _CountingSocket:
    """Stands for a view's socket to its worker; counts the sends."""

    def __init__(self, sock):
        self.sock, self.sends = sock, 0

    def send(self, data, flags=0):
        self.sends += 1
        return self.sock.send(data, flags)

    def fileno(self):
        return self.sock.fileno()

    def close(self):
        self.sock.close()


def test_ended_leases_go_back_in_groups_within_the_budget():
    """A ring lending 64 slots (group 16): 200 minibatches dropped one by
    one go back in about 200 / 16 sends (one send per minibatch cost the
    trainer of a plain `grain.DataLoader` about a tenth of its CPU), every
    slot comes back, and slots waiting to go back count against the
    budget: with 60 kept, the next minibatches are copies, not leases."""
    ring = transport.SlotRing(max_slots=80, leases=64)
    try:
        first = pickle.loads(pickle.dumps(ring.put(batch(0))))
        view = transport._RINGS[ring.name]
        view.sock = counting = _CountingSocket(view.sock)
        del first
        for i in range(1, 200):
            got = pickle.loads(pickle.dumps(ring.put(batch(i))))
            assert leased(got)
            check(got, i)
            del got
            ring._collect(0)
        assert counting.sends <= 200 // 16 + 1, counting.sends
        assert len(view.pending) < 16
        view.hand_back()
        for _ in range(3):
            ring._collect(0.1)
        assert not any(ring._busy), "a slot did not come back"
        # 60 held and 4 ended (waiting in the group): the budget of 64 is
        # spent, so the next one is a copy, and the copy sends the group.
        held = [pickle.loads(pickle.dumps(ring.put(batch(i)))) for i in range(64)]
        del held[60:]
        assert len(view.pending) == 4
        sends = counting.sends
        copy = pickle.loads(pickle.dumps(ring.put(batch(64))))
        assert not leased(copy) and all(leased(b) for b in held)
        assert not view.pending and counting.sends > sends
        for i, b in enumerate(held):
            check(b, i)
    finally:
        ring.close()
        transport.release_dead_rings()


def test_a_lease_ending_as_another_thread_ends_its_send_is_not_left_pending():
    """Thread B's lease ends just as thread A's hand-back has sent: B's slot
    is sent too, not left pending (it used to wait for the next minibatch,
    and a worker short of slots waited with it)."""
    import threading

    ring = transport.SlotRing(max_slots=8, leases=4)
    try:
        first = pickle.loads(pickle.dumps(ring.put(batch(0))))
        second = [pickle.loads(pickle.dumps(ring.put(batch(1))))]
        assert leased(first) and leased(second[0])
        view = transport._RINGS[ring.name]
        assert view.group == 1
        hand_back = view.hand_back

        def send_then_b_ends(slot=None):
            hand_back(slot)
            if second:  # once: B drops the second minibatch meanwhile
                b = threading.Thread(target=second.clear)
                b.start()
                b.join()

        view.hand_back = send_then_b_ends
        del first  # A: its lease ends, A sends
        assert not second
        assert not view.pending, "B's slot was left pending"
    finally:
        ring.close()
        transport.release_dead_rings()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fd_targets() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def _shm_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/" in line for line in f)


def worker_exits(ring: transport.SlotRing) -> None:
    """What a worker's exit does to its ring in this process: names unlinked,
    sockets closed, its own mappings gone (the trainer keeps its own)."""
    ring.close()
    ring._slots.clear()  # unmapped as they go


@pytest.mark.slow
def test_nothing_leaks_after_1000_rings_dropped_with_leases_outstanding():
    """Each round stands for an iterator's worker: a ring sends minibatches,
    the trainer leases some, the ring closes while they are still held (the
    worker exited), then the user drops them. Views, sockets, mappings and
    names must all go."""
    transport.release_dead_rings()
    gc.collect()
    fds, maps = _fds(), _shm_mappings()
    kept = []
    for r in range(1000):
        ring = transport.SlotRing(max_slots=4, leases=2)
        got = [pickle.loads(pickle.dumps(ring.put(batch(i)))) for i in range(3)]
        assert [leased(b) for b in got] == [True, True, False]
        worker_exits(ring)
        kept.append(got)
        if len(kept) > 3:  # leases outlive their ring for a few rounds
            check(kept[0][1], 1)
            del kept[0]
        if r % 50 == 0:
            transport.release_dead_rings()
    del got, kept
    gc.collect()
    transport.release_dead_rings()
    gc.collect()
    prefixes = [v.prefix for v in transport._RINGS.values()]
    assert not transport._RINGS, prefixes
    assert _fds() <= fds + 2
    assert _shm_mappings() <= maps
    mine = [n for n in os.listdir(shm_names.SHM_DIR) if f"_{os.getpid()}_" in n]
    assert not mine, mine[:5]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_minibatches_held_while_the_loader_goes_on_keep_their_values(
    csr_paths, helpers, workers
):
    """Every minibatch of two epochs kept (more than the rings lend: the
    later ones are copies), each checked against anndata at the end."""
    source, _, loader = helpers.build(csr_paths, worker_count=workers, num_epochs=2)
    truth = helpers.Truth(source, csr_paths)
    iterator = iter(loader)
    try:
        held = list(iterator)
    finally:
        helpers.close_iterator(iterator)
    if workers:
        assert any(leased(b) for b in held) and not all(leased(b) for b in held)
    rows = np.concatenate([b["row_ids"][b["mask"]] for b in held])
    assert sorted(rows) == sorted(list(range(helpers.N_CELLS)) * 2)
    for b in held:
        ids = b["row_ids"][b["mask"]]
        np.testing.assert_array_equal(b["obs/idx"][: ids.size], ids)
        x = sp.csr_matrix(
            (b["data"], b["indices"], b["indptr"]), shape=(4, helpers.N_GENES)
        ).toarray()
        np.testing.assert_array_equal(x[: ids.size], truth.x(ids))


def drop_in_child(held: dict) -> None:
    """In a forked child: the inherited lease dies here (and must not return)."""
    held.clear()
    gc.collect()


def test_a_forked_child_hands_back_no_lease_of_its_parent():
    ring = transport.SlotRing(max_slots=4, leases=2)
    try:
        held = pickle.loads(pickle.dumps(ring.put(batch(0))))
        assert leased(held)
        child = multiprocessing.get_context("fork").Process(
            target=drop_in_child, args=(held,)
        )
        child.start()
        child.join(30)
        assert child.exitcode == 0
        for _ in range(3):  # accept the trainer's connection, then read it
            ring._collect(0.1)
        assert ring._busy[0], "a forked child's dropped copy freed the slot"
        check(held, 0)
    finally:
        ring.close()
        transport.release_dead_rings()


def _worker_names(pids) -> list[str]:
    return [
        n
        for n in os.listdir(shm_names.SHM_DIR)
        if (found := shm_names.owner(n)) is not None and found[0] in pids
    ]


@pytest.mark.slow
def test_nothing_leaks_after_400_iterators_dropped_mid_epoch(csr_paths):
    """400 iterators of one pipeline (no workers), each dropped mid-epoch
    (half closed, half collected) with its last minibatches still held for
    a few rounds: no file descriptor, running-iterator entry or growing
    memory stays behind. (No read-ahead: each new iterator would otherwise
    compute the block keys of its whole window, the cost of this test.)"""
    import tracemalloc

    import grain_cells
    from grain_cells.pipeline import _dataset

    source = grain_cells.AnnDataSource(csr_paths, block_size=5, obs_columns=["idx"])
    ops = grain_cells.fetch_operations(source, batch_size=4, fetch_factor=5)
    sampler = grain_cells.BlockSampler(source, seed=0, num_epochs=None)
    dataset = grain_cells.pipeline.CellDataset(
        source, sampler, ops[1].split, readahead_cells=0
    )
    next(iter(dataset))  # files opened, caches filled
    gc.collect()
    fds, targets = _fds(), _fd_targets()
    kept = []
    tracemalloc.start()
    try:
        for r in range(400):
            iterator = iter(dataset)
            kept.append([next(iterator) for _ in range(2)])
            if r % 2:
                iterator.close()
            del iterator  # the others close when collected
            if len(kept) > 3:
                del kept[0]
            if r == 100:  # caches warm: later growth would be a leak
                gc.collect()
                base = tracemalloc.get_traced_memory()[0]
        del kept
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert not _dataset._RUNNING
    assert _fds() <= fds + 2, _fd_targets() - targets
    # ~50 kB of noise; a leak of 2.3 kB per iterator fails (was 900 and 2 MiB).
    assert grown < 700 << 10, f"{grown} bytes still held after 300 iterators"


@pytest.mark.slow
def test_iterators_with_workers_dropped_with_leases_outstanding_leave_nothing(
    csr_paths, helpers
):
    """Iterators with 2 workers, dropped (one closed, one collected) while
    leased minibatches of their workers are still held, then the leases
    dropped: workers, views, sockets, mappings and names all go, and the
    held values stay right until then."""
    import psutil

    *_, loader = helpers.build(csr_paths, worker_count=2, num_epochs=None)
    # The first workers start what a process keeps (multiprocessing's
    # resource tracker and its pipes, its shared heap): not per iterator.
    with iter(loader) as first:
        next(first)
    transport.release_dead_rings()
    gc.collect()
    fds, maps, targets = _fds(), _shm_mappings(), _fd_targets()
    me = psutil.Process()
    before = {c.pid for c in me.children()}

    def new_workers() -> set:
        return {
            c.pid
            for c in me.children()
            if "resource_tracker" not in " ".join(c.cmdline())
        } - before

    held, workers = [], set()
    for r in range(2):
        iterator = iter(loader)
        batches = [next(iterator) for _ in range(8)]
        assert any(leased(b) for b in batches)
        workers |= new_workers()
        held += batches
        if r:
            iterator.close()
        del iterator, batches
        gc.collect()
    for b in held:  # leases outlived their iterators and workers
        ids = b["row_ids"][b["mask"]]
        np.testing.assert_array_equal(b["obs/idx"][: ids.size], ids)
    del held, b
    gc.collect()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        transport.release_dead_rings()
        alive = [p for p in workers if shm_names.alive(p)]
        if not alive and not transport._RINGS:
            break
        time.sleep(0.2)
    assert not [p for p in workers if shm_names.alive(p)], "workers outlived close"
    assert not transport._RINGS
    assert _fds() <= fds + 2, _fd_targets() - targets
    assert _shm_mappings() <= maps
    assert not _worker_names(workers | {os.getpid()})
