"""A worker process that dies must never hang the trainer (issue 25).

A worker SIGKILLed mid-epoch (the out-of-memory killer looks the same) is
reported within seconds in both spellings: `grain_cells.DataLoader` raises
`errors.WorkerDiedError` naming the worker, the signal and what to do; a
plain `grain.DataLoader(operations=fetch_operations(...))` raises Grain's
own `RuntimeError` (nothing of ours runs in the trainer there). Minibatches
the trainer holds from the dead worker stay readable. The trainer runs in a
subprocess with a timeout, so a regression fails instead of hanging.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal

import pytest
from processes import run_trainer, trainer_script

from grain_cells.transport._processes import WorkerWatch, death_error

TRAINER = """
def kill_one_and_go_on(paths):
    # grain_cells.DataLoader's WorkerDiedError is checked by
    # tests/pipeline/test_loader.py::test_killed_worker_raises; here the
    # card's plain grain.DataLoader, where none of our code runs in the
    # trainer: it must raise (Grain's error), never hang. Endless: the victim
    # always has work left, so the death must be reported (with one epoch of
    # a small file, it may have handed over its whole share before the kill:
    # a legitimate end).
    iterator = iter(two_workers(paths, loader=grain.DataLoader))
    held = [next(iterator) for _ in range(6)]  # leases of both workers
    victim = workers()[0]
    os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    out = {"victim": victim, "error": None}
    try:
        for _ in range(1000):
            held.append(next(iterator))
    except Exception as e:
        out.update(error=type(e).__name__, message=str(e))
    out["seconds"] = time.monotonic() - start
    out["held_ok"] = rows_right(held)
    getattr(iterator, "close", lambda: None)()
    return out


def main():
    print(json.dumps(kill_one_and_go_on(json.loads(sys.argv[1]))), flush=True)
"""


@pytest.mark.slow
def test_a_killed_worker_raises_in_the_plain_grain_spelling(csr_paths, tmp_path):
    done = run_trainer(
        trainer_script(tmp_path, TRAINER),
        csr_paths,
        hung="hung after a worker was killed",
    )
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == 1, done.stderr[-3000:]
    (plain,) = lines
    assert plain["error"] == "RuntimeError", plain
    for result in lines:
        assert result["seconds"] < 15, result  # Grain polls about once a second
        assert result["held_ok"], result


def _sleep() -> None:
    import time

    time.sleep(60)


def test_the_watch_names_a_dead_worker_and_how_it_ended():
    watch = WorkerWatch(worker_count=1)
    child = multiprocessing.get_context("fork").Process(target=_sleep)
    child.start()
    try:
        watch.look()
        assert watch.dead() == []
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert watch.dead() == [child]
        error = death_error(watch.dead(), 1, "fetch 3 of epoch 0")
        assert isinstance(error, RuntimeError)
        assert f"worker pid {child.pid} was killed by SIGKILL (exit code -9)" in str(
            error
        )
        assert "fetch 3 of epoch 0" in str(error)
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)


def test_a_child_of_before_is_not_a_worker():
    other = multiprocessing.get_context("fork").Process(target=_sleep)
    other.start()
    try:
        watch = WorkerWatch(worker_count=2)
        watch.look()
        other.kill()
        other.join(10)
        assert watch.dead() == []
    finally:
        other.join(10)
