"""Whether the process that left something behind (a name, a folder) still runs.

A pid is reused, a (pid, start time) pair is not while the machine runs; start
times come from `/proc` (Linux), elsewhere the pid alone is asked.
"""

from __future__ import annotations

import os


def _stat(pid: int) -> list[bytes] | None:
    """`/proc/<pid>/stat` after "pid (comm)": state [0], start time [19] (proc(5))."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """A process's start time in clock ticks after boot, or None."""
    fields = _stat(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def gone(pid: int, start: int | None = None) -> bool:
    """Whether `pid` (started at `start`, None: unknown) has exited; zombies have."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists, another user's
    fields = _stat(pid)
    if fields is None:  # no /proc: the pid alone says it lives
        return False
    started = int(fields[19]) if len(fields) > 19 else start
    return fields[0] == b"Z" or (start is not None and started != start)


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (not a zombie)."""
    return not gone(pid)
