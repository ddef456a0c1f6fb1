"""Staging folders of `preshuffle` into a bucket, removed once their owner is dead.

Named `grain-cells-preshuffle-<pid>-<start>-<random>` (owner's pid and start time), so a
run removes the folders of killed runs at its start. Design notes:
docs/reference/design.md#preshuffle-staging.
"""

from __future__ import annotations

import os
import pathlib
import re
import secrets
import shutil
import tempfile

PREFIX = "grain-cells-preshuffle-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-[0-9a-f]+")


def _stat(pid: int) -> list[bytes] | None:
    """`/proc/<pid>/stat` after "pid (comm)": state is [0], starttime [19]."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (None: none, or no `/proc`)."""
    fields = _stat(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def _alive(pid: int, start: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    fields = _stat(pid)
    if fields is None:
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
    """Removes the staging folders under `parent` whose owner is dead; returns them."""
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
