"""Helpers shared by the benchmark binaries: page-cache eviction, RSS, data."""

from __future__ import annotations

import os
import resource
import sys

from grain_cells import synthetic


def evict_page_cache(paths) -> None:
    """Drops the files' pages from the OS page cache (for cold-read figures)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(paths, chunk: int = 1 << 24) -> None:
    """Reads the files once so that every page is cached."""
    buf = bytearray(chunk)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def peak_rss_mb() -> float:
    """Peak resident set size of this process, in MiB."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024


def resolve_data(data: list[str] | None, n_cells: int, n_genes: int) -> list[str]:
    """The files to benchmark: `data`, or a cached synthetic Tahoe-like file."""
    if data:
        return list(data)
    print(
        f"no --data: using a synthetic Tahoe-shaped file of {n_cells} cells "
        f"x {n_genes} genes (made once, cached)",
        file=sys.stderr,
    )
    path = synthetic.cached_tahoe_like(n_cells, n_genes=n_genes, progress=True)
    return [str(path)]
