"""A trainer SIGKILLed mid-stream: its workers exit, its shared memory goes.

The trainer runs in a subprocess (a script with the `__main__` guard, as a
user's would be), iterates a loader with two workers, and is SIGKILLed
together with one of its workers: the other worker must notice and exit
within seconds, unlinking its names; what the killed worker left is removed
by the next loader that starts.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from processes import alive, start_trainer, trainer_script, wait_until

from grain_cells.transport import _shm as shm_names

TRAINER = """
def main():
    iterator = iter(two_workers(json.loads(sys.argv[1])))
    for _ in range(12):
        next(iterator)
    print(json.dumps(workers()), flush=True)
    time.sleep(600)
"""


def names_of(pids) -> list[str]:
    return sorted(
        n
        for n in os.listdir(shm_names.SHM_DIR)
        if (found := shm_names.owner(n)) is not None and found[0] in pids
    )


@pytest.mark.slow
def test_sigkilled_trainer_takes_its_workers_and_memory(csr_paths, helpers, tmp_path):
    trainer = start_trainer(trainer_script(tmp_path, TRAINER), csr_paths)
    workers = []
    try:
        line = trainer.stdout.readline()
        assert line, trainer.stderr.read()[-3000:]
        workers = json.loads(line)
        assert len(workers) == 2
        # The trainer and one worker die at once; neither can clean up.
        victim, survivor = workers
        os.kill(trainer.pid, signal.SIGKILL)
        os.kill(victim, signal.SIGKILL)
        trainer.wait(10)
        start = time.monotonic()
        assert wait_until(lambda: not alive(survivor), 10), (
            "a worker outlived its trainer"
        )
        assert time.monotonic() - start < 10
        assert not names_of([survivor]), "the surviving worker left its names"
        # SIGKILL is delivered at once but a process may take a moment to exit
        # (unmapping its segments): the sweep below removes the names of
        # processes that have exited, so wait for the victim to have.
        assert wait_until(lambda: not alive(victim), 10), "the victim still runs"
        # A stale name of the dead trainer, as a crash mid-create would leave.
        stale = f"/{shm_names.STEM}{trainer.pid}_0badf00d_1"
        fd = os.open(shm_names.SHM_DIR + stale, os.O_CREAT | os.O_RDWR, 0o600)
        os.close(fd)
        # The next start removes everything of dead processes.
        *_, loader = helpers.build(csr_paths, worker_count=2)
        iterator = iter(loader)
        helpers.close_iterator(iterator)
        assert not names_of([victim, survivor, trainer.pid])
    finally:
        for pid in [trainer.pid, *workers]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for name in names_of([trainer.pid, *workers]):
            shm_names.unlink("/" + name)
        trainer.wait(10)
        trainer.stdout.close()
        trainer.stderr.close()


@pytest.mark.slow
def test_names_of_killed_workers_and_trainer_go_at_the_next_start(
    csr_paths, helpers, tmp_path
):
    """Both workers SIGKILLed, then the trainer: nobody could unlink the
    workers' names; the next loader that starts (even without workers)
    removes them."""
    trainer = start_trainer(trainer_script(tmp_path, TRAINER), csr_paths)
    workers = []
    try:
        line = trainer.stdout.readline()
        assert line, trainer.stderr.read()[-3000:]
        workers = json.loads(line)
        assert len(workers) == 2
        # A worker whose ring is lent out waits for a slot (up to 2 s: the
        # trainer hands ended leases back in groups) before it makes a new
        # segment, so its names may come a moment after the 12th minibatch.
        assert wait_until(lambda: names_of(workers), 15), (
            "the workers made no names (nothing tested)"
        )
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not any(alive(p) for p in workers), 10)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(10)
        *_, loader = helpers.build(csr_paths, worker_count=0)
        iterator = iter(loader)
        helpers.close_iterator(iterator)
        assert not names_of([*workers, trainer.pid])
    finally:
        for pid in [trainer.pid, *workers]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for name in names_of([trainer.pid, *workers]):
            shm_names.unlink("/" + name)
        trainer.wait(10)
        trainer.stdout.close()
        trainer.stderr.close()


def _objects_frozen_by_fetches(n: int) -> int:
    """How many objects `n` fetch starts moved to the GC's permanent generation.

    A difference, not the count itself: whatever the process froze before
    (an import, a site hook) is not this module's doing.
    """
    import gc

    from grain_cells.transport import _processes

    before = gc.get_freeze_count()
    was, _processes._in_worker = _processes._in_worker, True  # as worker_init sets
    try:
        for _ in range(n):
            _processes.fetch_starting()
    finally:
        _processes._in_worker = was
    return gc.get_freeze_count() - before


@pytest.mark.slow
def test_a_worker_freezes_its_startup_objects_at_its_second_fetch():
    """In a multiprocessing child, the second fetch's start moves the
    objects alive then to the GC's permanent generation (once); the first
    fetch does not, and the trainer's own process is never touched."""
    import multiprocessing

    # One spawned child (a second costs seconds of imports), fetch by fetch.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_objects_frozen_by_fetches, (1,)) == 0
        assert pool.apply(_objects_frozen_by_fetches, (1,)) > 1000
        assert pool.apply(_objects_frozen_by_fetches, (2,)) == 0  # once
    assert _objects_frozen_by_fetches(3) == 0
