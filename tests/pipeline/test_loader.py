"""grain_cells.DataLoader end to end: resume, checked restores, failures, leaks.

Worker processes are spawned (about 3 s each on 2 cores), so the
`worker_count=2` cases are few and each does as much as it can.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
import threading
import time

import grain
import numpy as np
import orbax.checkpoint as ocp
import psutil
import pytest
from absl import flags
from grain import sharding
from processes import alive, mapped_rings, wait_until, worker_pids

import grain_cells
from grain_cells import PaddedSparseOutput
from grain_cells.errors import CheckpointMismatchError
from grain_cells.transport import _ring as transport

# Minibatches of 4 cells, 4 blocks of 5 cells (20 cells, 5 minibatches) per fetch.
CONFIG = {"block_size": 5, "batch_size": 4, "fetch_factor": 5, "seed": 3}
K = 8  # minibatches compared after a restore
DEADLINE_S = 60  # a next() that takes longer than this is a hang


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype, (i, k)
            np.testing.assert_array_equal(x[k], y[k], err_msg=f"minibatch {i}, {k}")


def fetch_boundaries(source, sampler, batch_size, g) -> list[int]:
    """Without workers: the minibatch index at which each fetch starts."""
    out, n = [], 0
    for k in range(0, sampler.epoch_length, g):
        out.append(n)
        cells = sum(
            source[sampler[p].record_key].stop - source[sampler[p].record_key].start
            for p in range(k, min(k + g, sampler.epoch_length))
        )
        n += -(-cells // batch_size)
    out.append(n)
    return out


def call_with_deadline(fn, timeout=DEADLINE_S):
    """fn() in a daemon thread: (returned, raised) or pytest.fail on a hang."""
    result = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"{fn} hung for more than {timeout} s")
    return result.get("value"), result.get("error")


# -- 5. resume ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "workers, num_epochs",
    [
        pytest.param(0, 1, id="0-workers"),
        # Slow: with these tiny fetches the fetch stage's read-ahead looks
        # dozens of epochs ahead, and index_shuffle over 59 blocks costs ~0.5 ms.
        pytest.param(0, None, id="0-workers-endless", marks=pytest.mark.slow),
        pytest.param(2, 1, id="2-workers", marks=pytest.mark.slow),
    ],
)
def test_resume_through_orbax(csr_paths, helpers, tmp_path, workers, num_epochs):
    source, sampler, loader = helpers.build(
        csr_paths, worker_count=workers, num_epochs=num_epochs, **CONFIG
    )
    g = CONFIG["batch_size"] * CONFIG["fetch_factor"] // CONFIG["block_size"]
    starts = fetch_boundaries(source, sampler, CONFIG["batch_size"], g)
    total = starts[-1]  # minibatches in one epoch without workers
    rng = np.random.default_rng(2024)
    if workers == 0:
        stops = {
            0,
            2,  # in the middle of the first fetch
            starts[3],  # exactly at a fetch boundary
            starts[3] + 1,  # just after it
            int(rng.integers(starts[4], total - 2)),
        }
        if num_epochs is None:
            stops |= {total + 3, 2 * total + 1}  # later epochs
        else:
            stops |= {total - 1, total}  # the last minibatch, and the end
    else:
        # Workers alternate minibatches: the first fetches of both end at 10.
        stops = {0, 3, 11, int(rng.integers(12, total - K))}
    stops = sorted(stops)
    manager = ocp.CheckpointManager(tmp_path / "ckpt")
    iterator = iter(loader)
    reference = []
    try:
        # To the end of a finite stream; past the last stop of an endless one.
        for step in range(stops[-1] + K if num_epochs is None else 10**6):
            if step in stops:
                manager.save(
                    step,
                    args=ocp.args.Composite(
                        data=grain.checkpoint.CheckpointSave(iterator)
                    ),
                )
                manager.wait_until_finished()
            batch = next(iterator, None)
            if batch is None:
                break
            reference.append(helpers.detach(batch))
    finally:
        helpers.close_iterator(iterator)
    if num_epochs == 1:
        ids = np.concatenate([b["row_ids"][b["mask"]] for b in reference])
        np.testing.assert_array_equal(np.sort(ids), np.arange(helpers.N_CELLS))
    if workers == 0:  # saving did not disturb the stream
        fresh = helpers.run(
            helpers.build(csr_paths, num_epochs=num_epochs, **CONFIG)[2],
            len(reference),
        )
        assert_same_batches(reference, fresh)

    for stop in stops:
        _, _, new_loader = helpers.build(
            csr_paths, worker_count=workers, num_epochs=num_epochs, **CONFIG
        )
        restored = iter(new_loader)
        try:
            manager.restore(
                stop,
                args=ocp.args.Composite(
                    data=grain.checkpoint.CheckpointRestore(restored)
                ),
            )
            got = helpers.take(restored, K)
        finally:
            helpers.close_iterator(restored)
        expected = reference[stop : stop + K]
        assert len(got) == len(expected), f"stop {stop}"
        assert_same_batches(got, expected)
    manager.close()


@pytest.mark.parametrize("advanced", [0, 3], ids=["fresh", "advanced"])
@pytest.mark.parametrize("stop", [0, 4, 5, 13, 40])
def test_get_state_set_state_round_trip(csr_paths, helpers, stop, advanced):
    *_, loader = helpers.build(csr_paths, **CONFIG)
    everything = helpers.run(loader)
    loader.set_epoch(0)  # each iter() is the next epoch: the same one again
    iterator = iter(loader)
    helpers.take(iterator, stop) if stop else None
    state = iterator.get_state()
    assert isinstance(state, bytes)
    saved = json.loads(state)
    assert saved["grain_cells"] == loader.stamp
    # Reading the state does not move the iterator.
    assert_same_batches(helpers.take(iterator), everything[stop:])

    *_, other = helpers.build(csr_paths, **CONFIG)
    restored = iter(other)
    if advanced:  # set_state also rewinds or skips an iterator in use
        helpers.take(restored, advanced)
    restored.set_state(state)
    assert json.loads(restored.get_state()) == saved
    assert_same_batches(helpers.take(restored), everything[stop:])


def test_state_at_the_end(csr_paths, helpers):
    *_, loader = helpers.build(csr_paths, **CONFIG)
    iterator = iter(loader)
    n = len(helpers.take(iterator))
    assert n > 0
    state = iterator.get_state()
    restored = iter(helpers.build(csr_paths, **CONFIG)[2])
    restored.set_state(state)
    with pytest.raises(StopIteration):
        next(restored)


# -- 6. checked restores -----------------------------------------------------------


@pytest.mark.parametrize(
    "change, names",
    [
        pytest.param({"seed": 4}, ["sampler", "operations"], id="seed"),
        pytest.param({"shuffle": False}, ["sampler", "operations"], id="shuffle"),
        pytest.param({"num_epochs": 2}, ["sampler"], id="num_epochs"),
        pytest.param(
            {"block_size": 10, "fetch_factor": 5},
            ["data_source", "sampler", "operations"],
            id="block_size",
        ),
        pytest.param({"fetch_factor": 10}, ["operations"], id="fetch_factor"),
        pytest.param({"batch_size": 5, "fetch_factor": 4}, ["operations"], id="batch"),
        pytest.param({"remainder": "drop"}, ["operations"], id="remainder"),
        pytest.param(
            {"output": PaddedSparseOutput(width=8)}, ["operations"], id="output"
        ),
        pytest.param({"genes": ["g1", "g3"]}, ["data_source"], id="genes"),
    ],
)
def test_restore_under_another_configuration(csr_paths, helpers, change, names):
    *_, loader = helpers.build(csr_paths, **CONFIG)
    iterator = iter(loader)
    helpers.take(iterator, 6)
    state = iterator.get_state()

    *_, other = helpers.build(csr_paths, **{**CONFIG, **change})
    target = iter(other)
    with pytest.raises(CheckpointMismatchError) as e:
        target.set_state(state)
    message = str(e.value)
    for key in ("sampler", "data_source", "operations"):
        assert (f"{key}: saved" in message) == (key in names), (key, message)
    # The refused state left the iterator alone.
    if not other.dataset.worker_count:
        other.set_epoch(0)  # the target's epoch
        assert_same_batches(helpers.take(target, 3), helpers.run(other, 3))


def test_restore_under_another_configuration_through_orbax(
    csr_paths, helpers, tmp_path
):
    *_, loader = helpers.build(csr_paths, **CONFIG)
    iterator = iter(loader)
    helpers.take(iterator, 3)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(
            3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator))
        )
        manager.wait_until_finished()
        *_, other = helpers.build(csr_paths, **{**CONFIG, "seed": 9})
        target = iter(other)
        with pytest.raises(CheckpointMismatchError, match="seed=9"):
            manager.restore(
                3,
                args=ocp.args.Composite(
                    data=grain.checkpoint.CheckpointRestore(target)
                ),
            )


@pytest.mark.parametrize(
    "make_state",
    [
        pytest.param("plain-grain", id="plain-grain-dataloader"),
        pytest.param(b"not json at all", id="not-json"),
        pytest.param(b"[1, 2, 3]", id="json-list"),
        pytest.param(b'{"grain": {"next_index": 3}}', id="no-stamp"),
        pytest.param(b"", id="empty"),
    ],
)
def test_foreign_state(csr_paths, helpers, make_state):
    source, sampler, loader = helpers.build(csr_paths, **CONFIG)
    if make_state == "plain-grain":
        plain = grain.DataLoader(
            data_source=source,
            sampler=sampler,
            operations=grain_cells.fetch_operations(
                source, batch_size=4, fetch_factor=5, seed=3
            ),
            shard_options=sharding.NoSharding(),
        )
        it = iter(plain)
        next(it)
        state = it.get_state()
    else:
        state = make_state
    with pytest.raises(CheckpointMismatchError):
        iter(loader).set_state(state)


def test_marks_absl_flags_as_parsed(csr_paths, helpers):
    flags.FLAGS.unparse_flags()
    try:
        assert not flags.FLAGS.is_parsed()
        helpers.build(csr_paths, worker_count=2, **CONFIG)
        assert flags.FLAGS.is_parsed()
    finally:
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()


# -- 7. failures and leaks -----------------------------------------------------------


def kill_a_worker(csr_paths, helpers, num_epochs):
    """An iterator (worker_count=2) three minibatches in, one worker SIGKILLed."""
    before = worker_pids()
    *_, loader = helpers.build(
        csr_paths,
        worker_count=2,
        num_epochs=num_epochs,
        **{**CONFIG, "block_size": 1},
    )
    iterator = iter(loader)
    helpers.take(iterator, 3)
    workers = worker_pids() - before
    assert len(workers) == 2
    os.kill(min(workers), signal.SIGKILL)
    return before, iterator, min(workers)


def remove_segments_of(pid) -> list[str]:
    """Unlinks the shared memory a (killed) worker left behind; returns names."""
    left = sorted(n for n in shm_files() if n.startswith(f"gcells_{pid}_"))
    for name in left:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join("/dev/shm", name))
    return left


@pytest.mark.slow
def test_killed_worker_raises(csr_paths, helpers):
    before, iterator, victim = kill_a_worker(csr_paths, helpers, num_epochs=None)
    try:

        def drain():
            for _ in range(10_000):  # the stream is endless
                next(iterator)

        start = time.monotonic()
        _, error = call_with_deadline(drain)
        assert error is not None, "an endless stream with a dead worker ended"
        assert not isinstance(error, StopIteration)
        assert time.monotonic() - start < DEADLINE_S
        # Named by grain_cells (WorkerDiedError), or Grain's own message if
        # Grain saw the death before the iterator's watch did.
        assert isinstance(error, grain_cells.errors.WorkerDiedError) or (
            "terminated unexpectedly" in str(error)
        ), error
        if isinstance(error, grain_cells.errors.WorkerDiedError):
            message = str(error)
            assert f"worker pid {victim} was killed by SIGKILL" in message, message
            assert "out-of-memory" in message and "restore" in message, message
    finally:
        helpers.close_iterator(iterator)
        iterator = None  # drop the last reference
        remove_segments_of(victim)
    assert wait_until(lambda: not (worker_pids() - before)), "workers left behind"


@pytest.mark.slow
def test_killed_worker_keeps_failing(csr_paths, helpers):
    """After the error, no minibatch of the surviving worker slips through."""
    before, iterator, victim = kill_a_worker(csr_paths, helpers, num_epochs=1)
    try:
        outcomes = []

        def drain():
            while len(outcomes) < 200:
                try:
                    next(iterator)
                    outcomes.append("minibatch")
                except StopIteration:
                    outcomes.append("end")
                    return
                except Exception as e:
                    outcomes.append(f"{type(e).__name__}: {e}")
                    if sum(o != "minibatch" for o in outcomes) > 5:
                        return

        call_with_deadline(drain)
        errors = [i for i, o in enumerate(outcomes) if o != "minibatch"]
        assert errors, "the stream went on without the dead worker's share"
        first = errors[0]
        if outcomes[first] == "end":
            # The victim had handed over its whole share before the kill:
            # then, and only then, may the epoch end, with nothing missing.
            assert 3 + first == helpers.N_CELLS // CONFIG["batch_size"], outcomes
            return
        assert outcomes[first].startswith("WorkerDiedError: ") or (
            "terminated unexpectedly" in outcomes[first]
        ), outcomes[first]
        after = outcomes[first + 1 :]
        assert len(after) == 5
        for o in after:
            assert o.startswith("RuntimeError: the data iterator failed earlier"), o
    finally:
        helpers.close_iterator(iterator)
        iterator = None  # drop the last reference
        remove_segments_of(victim)
    assert wait_until(lambda: not (worker_pids() - before)), "workers left behind"


@pytest.mark.slow
def test_error_in_worker_raises(csr_paths, helpers):
    before = worker_pids()
    output = PaddedSparseOutput(width=3, truncate="error")
    *_, loader = helpers.build(csr_paths, worker_count=2, output=output, **CONFIG)
    iterator = iter(loader)
    _, error = call_with_deadline(lambda: helpers.take(iterator))
    assert isinstance(error, ValueError), repr(error)
    assert "PaddedSparseOutput(width=3)" in str(error)
    helpers.close_iterator(iterator)
    iterator = None  # drop the last reference
    assert wait_until(lambda: not (worker_pids() - before)), "workers left behind"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["close", "drop"])
def test_close_soon_after_start(csr_paths, helpers, monkeypatch, how):
    """Closing or dropping an iterator one minibatch per worker in must not fail.

    On close Grain sets the workers' stop event and drains their queues; a
    worker that sees the event drains the same queue itself and exits, which
    unlinks all of its ring's segments. A handle that the trainer takes off the
    queue before that but unpickles after it names a segment that is gone
    (this raised FileNotFoundError from close() and from garbage collection
    before 56d4dd6). Here the trainer unpickles a handle only once its segment
    is unlinked, which makes that order certain; unaided it happened in about
    half the closes on 2 cores.
    """
    before = worker_pids()
    *_, loader = helpers.build(csr_paths, worker_count=2, **CONFIG)
    holder = [iter(loader)]
    helpers.take(holder[0], 2)
    receive = transport._receive

    waited = set()

    def slow_receive(ring, slot, segment, size, layout, pid, *leases):
        # A trainer slower than the worker's exit (which unlinks its segments),
        # once per worker.
        if pid not in waited:
            waited.add(pid)
            wait_until(lambda: not os.path.exists("/dev/shm" + segment), 3)
        return receive(ring, slot, segment, size, layout, pid, *leases)

    unraisable = []  # as text: an exception would keep the iterator alive
    monkeypatch.setattr(
        sys, "unraisablehook", lambda u: unraisable.append(repr(u.exc_value))
    )
    error = None
    transport._receive = slow_receive
    try:
        if how == "close":
            holder[0].close()
        else:
            holder.clear()
            gc.collect()
    except Exception as e:
        error = repr(e)
    finally:
        transport._receive = receive
        holder.clear()
        gc.collect()
        for pid in worker_pids() - before:  # workers the failed close left
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
            wait_until(lambda pid=pid: not alive(pid), 5)
            remove_segments_of(pid)
        gc.collect()
    assert error is None, error
    assert not unraisable, unraisable


@pytest.mark.slow
def test_close_unmaps(csr_paths, helpers):
    """close() "frees their shared memory at once" (CheckedIterator docstring)."""
    rings_before = mapped_rings()
    *_, loader = helpers.build(csr_paths, worker_count=2, **CONFIG)
    iterator = iter(loader)
    helpers.take(iterator, 12)
    mine = mapped_rings() - rings_before
    assert len(mine) == 2  # the trainer maps both workers' rings
    helpers.close_iterator(iterator)
    assert not (mapped_rings() & mine)  # at once, not at garbage collection
    iterator = None  # drop the last reference


@pytest.mark.slow
def test_drop_unmaps(csr_paths, helpers):
    rings_before = mapped_rings()
    *_, loader = helpers.build(csr_paths, worker_count=2, **CONFIG)
    iterator = iter(loader)
    helpers.take(iterator, 12)
    mine = mapped_rings() - rings_before
    assert len(mine) == 2
    del iterator  # not closed: garbage collection stops the workers
    assert wait_until(lambda: not worker_pids())
    assert wait_until(lambda: not (mapped_rings() & mine), 2), len(
        [t for t in fd_targets() if "/dev/shm/gcells_" in t]
    )


def shm_files() -> set[str]:
    return set(os.listdir("/dev/shm"))


def fd_targets() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def open_fds() -> int:
    """Open file descriptors, less slot-ring mappings (see test_drop_unmaps)."""
    return sum("/dev/shm/gcells_" not in t for t in fd_targets())


def our_pids() -> set[int]:
    """This process and its children (workers, resource tracker)."""
    return {os.getpid()} | {c.pid for c in psutil.Process().children(recursive=True)}


def shm_inodes_mapped_by(pids) -> set[int]:
    """Inodes of the /dev/shm files that processes `pids` map now.

    Inodes, not names: a POSIX semaphore is mapped under the temporary name
    it was created with (`sem.XXXXXX`, then linked as `sem.mp-...`).
    """
    inodes = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    if "/dev/shm/" in line:
                        inodes.add(int(line.split()[4]))
        except OSError:
            continue
    return inodes


class Seen:
    """Our workers and the /dev/shm files our processes mapped, sampled while
    the scenarios run.

    Other test runs share /dev/shm: their live segments and semaphores, and
    those a run killed by SIGKILL leaves behind (mapped by nobody), are not
    our leaks. A new file counts as ours only if this process tree was seen
    mapping it (Grain's queues' semaphores are mapped while workers run), or
    it is a slot ring of one of our workers (`gcells_<pid>_...`).
    """

    def __init__(self):
        self.pids: set[int] = set()
        self.inodes: set[int] = set()

    def observe(self) -> None:
        self.pids |= worker_pids()
        self.inodes |= shm_inodes_mapped_by(our_pids())

    def ours(self, name: str) -> bool:
        if name.startswith("gcells_"):
            return int(name.split("_")[1]) in self.pids
        try:
            return os.stat(f"/dev/shm/{name}").st_ino in self.inodes
        except OSError:  # gone meanwhile: not left behind
            return False


def leaked_shm(before: set[str], seen: Seen) -> set[str]:
    """New /dev/shm names that this process or its workers left."""
    return {n for n in shm_files() - before if seen.ours(n)}


def full_epoch(loader, helpers, seen):
    iterator = iter(loader)
    next(iterator)
    seen.observe()
    assert len(list(iterator)) > 0
    helpers.close_iterator(iterator)


def break_early_close(loader, helpers, seen):
    iterator = iter(loader)
    for i, _ in enumerate(iterator):
        seen.observe()
        if i == 4:
            break
    helpers.close_iterator(iterator)


def break_early_del(loader, helpers, seen):
    iterator = iter(loader)
    batches = [next(iterator) for _ in range(5)]  # kept until the iterator goes
    seen.observe()
    del iterator, batches


def many_iterators(loader, helpers, seen):
    # With workers, one (a start of 2 workers, ~1.5 s; 5 iterators took 10):
    # rings that piled up would already be more than `workers` mappings, the
    # scenarios before it left theirs. The 400-iterator run (no workers) is
    # tests/transport/test_leases.py's.
    for _ in range(1 if loader.dataset.worker_count else 50):
        iterator = iter(loader)
        next(iterator)
        seen.observe()
        del iterator  # not closed: garbage collection stops the workers


@pytest.mark.slow  # ~4 s; tests/transport/test_leases.py keeps the quick checks
@pytest.mark.parametrize("workers", [0, 2])
def test_no_leaks(csr_paths, helpers, workers):
    source, *_, loader = helpers.build(csr_paths, worker_count=workers, **CONFIG)
    # Warm up: the source's files opened here (without workers; a fetch of
    # several files opens none in the bound, a fetch of one does); the resource
    # tracker, multiprocessing's heap and the async unlink pool started (with).
    helpers.run(loader, 2)
    for start in source.cell_offsets[:-1].tolist():
        source.read([start])
    gc.collect()
    assert wait_until(lambda: not (worker_pids()))
    shm_before, fds_before, rings_before = shm_files(), open_fds(), mapped_rings()
    seen = Seen()
    for scenario in (full_epoch, break_early_close, break_early_del, many_iterators):
        scenario(loader, helpers, seen)
        assert not workers or len(seen.pids) >= 2
        gc.collect()
        assert wait_until(lambda: not worker_pids()), f"{scenario.__name__}: workers"
        assert wait_until(lambda: not leaked_shm(shm_before, seen)), (
            f"{scenario.__name__}: left {sorted(leaked_shm(shm_before, seen))[:5]} "
            "in /dev/shm"
        )
        assert wait_until(lambda: open_fds() <= fds_before), (
            f"{scenario.__name__}: {open_fds()} open file descriptors, "
            f"{fds_before} before"
        )
        # Mappings of closed iterators' rings do not pile up.
        assert len(mapped_rings() - rings_before) <= workers, scenario.__name__
