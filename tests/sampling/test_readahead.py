"""Read-ahead hints of a sampler under Grain's read threads.

Grain's `DataLoader` calls `sampler[position]` from its read threads (16 by
default) at once and a little out of order. The hints must cost about one
window per worker, not one per thread or per late position: each window is
`blocks_at` over thousands of positions (about a CPU-second), and a worker
that computed 16 of them before its first minibatch looked hung on a loaded
machine (the plain-grain spelling of tests/transport/test_dead_worker.py).
"""

from __future__ import annotations

import itertools
import json
import threading

import numpy as np
import pytest
from processes import run_trainer, trainer_script

import grain_cells


def _hinting(csr_paths, readahead_cells=40):
    """A sampler over 5-cell blocks whose `blocks_at` calls are recorded."""
    source = grain_cells.AnnDataSource(csr_paths, block_size=5)
    hinted: list[int] = []
    source.advise = lambda keys: hinted.extend(np.asarray(keys).tolist())
    sampler = grain_cells.BlockSampler(
        source, seed=0, num_epochs=None, readahead_cells=readahead_cells
    )
    return sampler, hinted


def test_late_positions_do_not_start_the_window_over(csr_paths):
    sampler, hinted = _hinting(csr_paths)  # a window of 8 positions
    # Worker 0 of 2, its read threads finishing each pair the other way round.
    order = [p for a in range(0, 200, 4) for p in (a + 2, a)]
    keys = [sampler[p].record_key for p in order]
    np.testing.assert_array_equal(keys, sampler.blocks_at(order))
    # About each position once (plus the first window's odd positions, hinted
    # before the stride was known), not a window per late position.
    assert len(hinted) <= len(order) + 3 * 8, len(hinted)
    # What the stream reads after its first position (2) was hinted.
    assert set(sampler.blocks_at(range(4, 200, 2)).tolist()) <= set(hinted)


def test_a_far_earlier_position_starts_the_window_over(csr_paths):
    sampler, hinted = _hinting(csr_paths)
    for p in range(0, 100, 2):
        sampler[p]
    hinted.clear()
    sampler[10]  # restored to an earlier position
    assert set(sampler.blocks_at(range(12, 26, 2)).tolist()) <= set(hinted)


def test_hints_reach_one_epoch_ahead_at_most(csr_paths):
    sampler, hinted = _hinting(csr_paths, readahead_cells=16384)  # 3277 positions
    for p in range(0, 400, 2):
        sampler[p]
    # Each block once an epoch: a longer window hints the same blocks again.
    assert len(hinted) <= 400 + 2 * sampler.epoch_length, len(hinted)
    assert set(hinted) == set(range(sampler.epoch_length))


def test_one_read_thread_hints_at_a_time(csr_paths):
    sampler, _ = _hinting(csr_paths)
    entered, go_on = threading.Event(), threading.Event()
    calls = []
    original = sampler.blocks_at

    def blocks_at(positions):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            entered.set()
            go_on.wait(30)
        return original(positions)

    sampler.blocks_at = blocks_at
    first = threading.Thread(target=sampler.__getitem__, args=(0,), name="first")
    first.start()
    try:
        assert entered.wait(30)
        # Other read threads, while the first one hints: they go on.
        others = [sampler[p].record_key for p in (2, 4, 6)]
        assert calls == ["first"]
        np.testing.assert_array_equal(others, original([2, 4, 6]))
    finally:
        go_on.set()
        first.join(30)


TRAINER = """
from grain_cells.sampling import _samplers

# In the trainer and (re-imported as __mp_main__) in each spawned worker:
# a slow hint holds every read thread that also computes one, so they all
# overlap whatever the machine's load; each call's positions are logged.
LOG = os.environ["HINT_LOG"]


def blocks_at(self, positions):
    positions = np.asarray(positions)
    with open(LOG, "a") as f:
        f.write(f"{os.getpid()} {positions[0]} {positions[-1]} {positions.size}\\n")
    time.sleep(0.5)
    return np.zeros(len(positions), np.int64)


_samplers.BlockSampler.blocks_at = blocks_at


def main():
    iterator = iter(two_workers(json.loads(sys.argv[1]), loader=grain.DataLoader))
    held = [next(iterator) for _ in range(6)]
    print(json.dumps({"held_ok": rows_right(held)}), flush=True)
    os._exit(0)  # the workers exit with their parent
"""


@pytest.mark.slow
def test_a_plain_grain_worker_hints_about_one_window(csr_paths, tmp_path):
    log = tmp_path / "hints.log"
    done = run_trainer(
        trainer_script(tmp_path, TRAINER),
        csr_paths,
        env={"HINT_LOG": str(log)},
        hung="hung before its first minibatches",
    )
    assert done.stdout.strip(), done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"held_ok": True}
    hints = {}  # worker: (first position, last, count) of each hint, in order
    for line in log.read_text().splitlines():
        pid, *call = map(int, line.split())
        hints.setdefault(pid, []).append(tuple(call))
    assert len(hints) == 2, hints
    # 16 read threads each computing a window (or starting over) is what
    # hung. However far the workers read before the trainer exits (more
    # under load), each position is hinted once, a window or half a window
    # (29 positions of 58) per call, never a few positions at a time.
    for calls in hints.values():
        for (_, last, _), (first, _, _) in itertools.pairwise(calls):
            assert first > last, calls
        assert min(n for *_, n in calls) >= 10, calls
