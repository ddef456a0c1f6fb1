"""Staging folders of `preshuffle` into a bucket, removed once their owner is dead.

Named `grain-cells-preshuffle-<pid>-<start>-<random>`; design notes:
docs/reference/design.md#preshuffle-staging.
"""

from __future__ import annotations

import os
import pathlib
import re
import secrets
import shutil
import tempfile

from grain_cells._util.pids import gone, start_time

PREFIX = "grain-cells-preshuffle-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-[0-9a-f]+")


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
        if pid == os.getpid() or not gone(pid, start or None):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
