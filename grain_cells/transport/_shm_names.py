"""Names of shared-memory objects (`gcells_<pid>_t<start>_<token>_<what>`).

The creator's pid and start time tell which names outlived it (`remove_stale`).
Design notes: docs/reference/design.md#transport-shm-names.
"""

from __future__ import annotations

import contextlib
import os
import secrets

from grain_cells._util.pids import alive as alive
from grain_cells._util.pids import gone, start_time

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory names
STEM = "gcells_"
_own_start: tuple[int, int | None] | None = None  # (pid, start) of this process


def new_prefix() -> str:
    """A fresh name prefix owned by this process: `/gcells_<pid>_t<start>_<token>`."""
    global _own_start
    pid = os.getpid()
    if _own_start is None or _own_start[0] != pid:  # a forked child: its own
        _own_start = (pid, start_time(pid))
    start = _own_start[1]
    stamp = "" if start is None else f"t{start}_"
    return f"/{STEM}{pid}_{stamp}{secrets.token_hex(4)}"


def owner(name: str) -> tuple[int, int | None] | None:
    """(pid, start time or None) of a `gcells_...` name, or None."""
    name = name.lstrip("/")
    if not name.startswith(STEM):
        return None
    parts = name[len(STEM) :].split("_", 2)
    if not parts[0].isdigit():
        return None
    start = None
    if len(parts) > 1 and parts[1][:1] == "t" and parts[1][1:].isdigit():
        start = int(parts[1][1:])
    return int(parts[0]), start


def owner_pid(name: str) -> int | None:
    """The pid in a `gcells_<pid>_...` name (with or without its `/`)."""
    found = owner(name)
    return None if found is None else found[0]


def path_of(name: str) -> str:
    """The file in `SHM_DIR` that `shm_open(name)` opens (Linux)."""
    return os.path.join(SHM_DIR, name.lstrip("/"))


def unlink(name: str) -> None:
    """Unlinks a shared-memory name; a name already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path_of(name))


def unlink_prefix(prefix: str) -> None:
    """Unlinks every name that starts with `prefix` + `_`."""
    stem = prefix.lstrip("/") + "_"
    for entry in _entries():
        if entry.startswith(stem):
            unlink("/" + entry)


def remove_stale() -> list[str]:
    """Removes the names of gone grain_cells processes; returns them (no `/`)."""
    removed, verdict = [], {}
    for entry in _entries():
        if (made_by := owner(entry)) is None:
            continue
        if made_by not in verdict:
            verdict[made_by] = gone(*made_by)
        if verdict[made_by]:
            unlink("/" + entry)
            removed.append(entry)
    return removed


def _entries() -> list[str]:
    if not os.path.isdir(SHM_DIR):
        return []
    return [e for e in os.listdir(SHM_DIR) if e.startswith(STEM)]
