"""Staging folders of `preshuffle` into a bucket: named by their owner, and
removed at the next start when that owner is dead.

A run into a bucket writes each part under a staging folder on local disk
(`grain_cells.preshuffle._output`), which it removes when it ends. A run that
is killed (SIGKILL, the OOM killer, a lost node) cannot: its folder and the
part inside it (about 13 GB per million Tahoe-sized cells) would stay under
`staging_dir` forever. So a staging folder is named
`grain-cells-preshuffle-<pid>-<start>-<random>`, where `<pid>` is the
process that made it and `<start>` that process's start time (clock ticks
since boot, `/proc/<pid>/stat` field 22; 0 where there is no `/proc`), and
every run starts by removing the folders in its `staging_dir` whose owner
no longer exists: no process with that pid, a zombie, or a process with
that pid but another start time (the pid was reused). Shared-memory names
of dead workers are collected the same way (`grain_cells.transport._shm_names`,
by pid).

Design notes: docs/reference/design.md#preshuffle-staging.
"""  # noqa: D205

from __future__ import annotations

import os
import pathlib
import re
import secrets
import shutil
import tempfile

PREFIX = "grain-cells-preshuffle-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-[0-9a-f]+")


def start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (None: no such process
    or no `/proc`)."""  # noqa: D205, D209
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After "pid (comm)": state is field 3, starttime field 22.
    return int(fields[19]) if len(fields) > 19 else None


def _alive(pid: int, start: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return True  # no /proc: the pid alone says it lives
    if fields[0] == b"Z":  # a zombie has exited
        return False
    return start == 0 or int(fields[19]) == start


def make(parent: str | os.PathLike | None) -> pathlib.Path:
    """Creates this process's staging folder under `parent` (None: `TMPDIR`)."""
    parent = pathlib.Path(tempfile.gettempdir() if parent is None else parent)
    parent.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    start = start_time(pid) or 0
    while True:
        path = parent / f"{PREFIX}{pid}-{start}-{secrets.token_hex(4)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path


def remove_stale(parent: str | os.PathLike | None) -> list[pathlib.Path]:
    """Removes the staging folders under `parent` whose owner is dead.

    Returns:
        The folders removed.
    """
    parent = pathlib.Path(tempfile.gettempdir() if parent is None else parent)
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for path in entries:
        match = _NAME.fullmatch(path.name)
        if match is None or not path.is_dir() or path.is_symlink():
            continue
        pid, start = int(match[1]), int(match[2])
        if pid == os.getpid() or _alive(pid, start):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
