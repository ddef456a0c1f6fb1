"""Shared-memory names carry the creating process's pid and start time.

A pid is reused; the pair is not. A name left by a killed process whose pid
now belongs to another process must still be removed as stale, and names of
live processes (in either the current or the older pid-only form) kept.
"""

from __future__ import annotations

import os

import pytest

from grain_cells.transport import _shm as shm_names


@pytest.fixture
def made():
    names = []

    def make(name: str) -> str:
        fd = os.open(shm_names.path_of(name), os.O_CREAT | os.O_RDWR, 0o600)
        os.close(fd)
        names.append(name)
        return name.lstrip("/")

    yield make
    for name in names:
        shm_names.unlink(name)


def test_a_prefix_names_this_process_and_its_start():
    pid = os.getpid()
    start = shm_names.start_time(pid)
    assert start is not None and start > 0
    prefix = shm_names.new_prefix()
    assert prefix.startswith(f"/gcells_{pid}_t{start}_")
    assert shm_names.owner(prefix + "_ring") == (pid, start)
    assert shm_names.owner(prefix + "_3")[0] == pid
    assert shm_names.owner("/gcells_12_deadbeef_1") == (12, None)  # older form
    assert shm_names.owner("/gcells_12_12345678_1") == (12, None)  # a hex token
    assert shm_names.owner("/other_12_t5_x") is None


def test_a_reused_pid_does_not_keep_a_dead_process_names(made):
    pid = os.getpid()
    start = shm_names.start_time(pid)
    mine = made(f"{shm_names.new_prefix()}_1")
    reused = made(f"/gcells_{pid}_t{start - 1}_0badf00d_1")  # an earlier process
    old_form = made(f"/gcells_{pid}_0badf00d_2")  # pid-only: alive, kept
    removed = shm_names.remove_stale()
    assert reused in removed
    assert mine not in removed and old_form not in removed
    left = set(os.listdir(shm_names.SHM_DIR))
    assert mine in left and old_form in left and reused not in left
