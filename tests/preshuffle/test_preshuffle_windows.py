"""preshuffle's background writer: blocking waits, errors raised where called."""

from __future__ import annotations

import threading
import time

import pytest

from grain_cells.preshuffle._writer import WritePipeline


def test_jobs_run_in_order_and_slots_come_back():
    written = []
    with WritePipeline(2) as pipeline:
        for i in range(6):
            slot = pipeline.free_slot()
            pipeline.submit(slot, lambda i=i: written.append(i), lambda: None)
    assert written == list(range(6))


def test_a_waiting_caller_wakes_at_a_failed_write():
    release = threading.Event()

    def fail():
        release.wait()
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"), WritePipeline(1) as pipeline:
        pipeline.submit(pipeline.free_slot(), fail, lambda: None)
        threading.Timer(0.05, release.set).start()
        started = time.perf_counter()
        pipeline.free_slot()  # blocks: the only slot is being written
    assert time.perf_counter() - started < 5


def test_jobs_after_a_failure_are_skipped_and_the_error_is_raised_on_exit():
    ran = []

    def fail():
        raise ValueError("bad window")

    with pytest.raises(ValueError, match="bad window"), WritePipeline(2) as pipeline:
        pipeline.submit(pipeline.free_slot(), fail, lambda: None)
        pipeline.submit(pipeline.free_slot(), lambda: ran.append(1), lambda: None)
    assert ran == []


def test_an_error_in_the_caller_is_not_masked():
    def fail():
        raise ValueError("writer")

    with pytest.raises(KeyError), WritePipeline(1) as pipeline:
        pipeline.submit(pipeline.free_slot(), fail, lambda: None)
        raise KeyError("caller")
