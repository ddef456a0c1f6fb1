"""Where each file's entry lies in the cache folder: one JSON per file and stat.

A build writes one entry per file (`grain_cells.io._meta_cache`): its
metadata and, beside it in the same JSON, its byte layouts for a process's
first open (`grain_cells.io._layout_cache`). One file per file, not two: a
file created and renamed in the cache costs a build more CPU than anything
it reads of a thin file on a busy disk (issue 33).

Design notes: docs/reference/design.md#io-meta-cache.
"""

from __future__ import annotations

import hashlib
import json
import os

from grain_cells._util.cache_files import cache_root
from grain_cells.storage import FileStat

# v2: entries carry byte layouts (first opens); v3: in the entry itself.
VERSION = "file-meta-v3"
STAT_FIELDS = ("dev", "ino", "size", "mtime_ns", "ctime_ns")


def cache_dir() -> str:
    """The folder of entries: never the folder of the data."""
    return os.path.join(cache_root(), "file-meta")


def entry_name(path: str, element: str, genes_from, stat: FileStat) -> str:
    """The entry's file name: a digest of the version, file, element, key, stat."""
    fields = [getattr(stat, f) for f in STAT_FIELDS]
    parts = [VERSION, path, element, genes_from, fields]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:40] + ".json"


__all__ = ["STAT_FIELDS", "VERSION", "cache_dir", "entry_name"]
