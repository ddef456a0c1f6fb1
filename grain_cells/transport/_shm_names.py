"""Names of grain_cells' shared-memory objects, and removing stale ones.

Every object a process creates for the slot-ring transport (segments and the
FIFO that hands slots back) is named `gcells_<pid>_<token>_<what>` in
`/dev/shm`, where `<pid>` is the creating process. A process that was killed
(SIGKILL, the OOM killer) cannot unlink its names; because they carry its pid,
any later start can tell which names belong to processes that no longer exist
and remove them (`remove_stale`).
"""

from __future__ import annotations

import contextlib
import os
import secrets

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory names
STEM = "gcells_"


def new_prefix() -> str:
    """A fresh name prefix owned by this process: `/gcells_<pid>_<token>`."""
    return f"/{STEM}{os.getpid()}_{secrets.token_hex(4)}"


def owner_pid(name: str) -> int | None:
    """The pid in a `gcells_<pid>_...` name (with or without its `/`)."""
    name = name.lstrip("/")
    if not name.startswith(STEM):
        return None
    pid = name[len(STEM) :].split("_", 1)[0]
    return int(pid) if pid.isdigit() else None


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (zombies count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited: its names are stale (Linux only)
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def path_of(name: str) -> str:
    """The file in `SHM_DIR` of the shared-memory name `/gcells_...`.

    On Linux, `shm_open(name)` opens exactly this file, so segments are made,
    opened and unlinked with `os.open`, `mmap` and `os.unlink`.
    """
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
    """Removes the names of grain_cells processes that no longer exist.

    Returns:
        The names removed (without the leading `/`).
    """
    removed, verdict = [], {}
    for entry in _entries():
        pid = owner_pid(entry)
        if pid is None:
            continue
        if pid not in verdict:
            verdict[pid] = alive(pid)
        if not verdict[pid]:
            unlink("/" + entry)
            removed.append(entry)
    return removed


def _entries() -> list[str]:
    if not os.path.isdir(SHM_DIR):
        return []
    return [e for e in os.listdir(SHM_DIR) if e.startswith(STEM)]
