"""A build's per-file work, overlapped: versions in threads, cold opens in processes.

`file_metas` gives each path's `FileMeta` in order: its cached entry when the
file (an object: its version) is unchanged, else from opening it.

Design notes: docs/reference/design.md#io-build.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import multiprocessing
from collections.abc import Iterator, Sequence

from grain_cells import formats
from grain_cells._util import cores
from grain_cells._util.main_guard import main_thread_site
from grain_cells.io._meta_cache import FileMeta, MetaCache, inspect_file
from grain_cells.storage.remote import is_url

# Objects' versions asked at once, and paths per window of the build.
VERSION_THREADS = 32
WINDOW = 1024
# A window's uncached files are opened in processes when there are at least
# this many objects (each costs round trips) or local files (3-6 CPU-ms each,
# against ~1.5 s of imports per process); at most this many processes, and
# two per core.
MIN_PROCESS_OPENS = 32
MIN_LOCAL_OPENS = 512
MAX_PROCESSES = 16


def file_metas(
    paths: Sequence[str], cache: MetaCache, obs_names, options: dict
) -> Iterator[FileMeta]:
    """Each path's `FileMeta`, in order; a file opened is stored in `cache`."""
    args = (cache.element, obs_names, cache.genes_from, options)
    threads = pool = None
    try:
        for k in range(0, len(paths), WINDOW):
            window = paths[k : k + WINDOW]
            if any(map(is_url, window)):
                threads = threads or concurrent.futures.ThreadPoolExecutor(
                    VERSION_THREADS
                )
                versions = list(threads.map(lambda p: _version(p, options), window))
            else:
                versions = [None] * len(window)
            found = [
                cache.lookup(p, obs_names, v)
                for p, v in zip(window, versions, strict=True)
            ]
            opens = _to_open(window, found)
            done = iter(())
            remote = any(is_url(window[j]) for j in opens)
            if opens and (pool := pool or _pool(len(opens), remote)):
                todo = [(window[j], *args, versions[j]) for j in opens]
                done = zip(opens, pool.map(_open_and_store, todo), strict=True)
            try:
                for j, meta in done:  # a stored entry is read here: arrays once
                    found[j] = meta or cache.lookup(window[j], obs_names, versions[j])
            except concurrent.futures.process.BrokenProcessPool as e:
                names = ", ".join(window[j] for j in opens[:3])
                raise RuntimeError(
                    f"a process opening {len(opens)} files for the build died "
                    f"({e}); the files began with {names}. Its exit is not "
                    "an error of the file's: look for the kernel's out-of-memory "
                    "killer, or build again."
                ) from None
            for j, meta in enumerate(found):
                if meta is None:
                    meta = inspect_file(window[j], *args, versions[j])
                    cache.store(meta)
                yield meta
    finally:  # a build that stopped early does not wait for the rest
        for executor in (threads, pool):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)


def _to_open(window, found) -> list[int]:
    """Which of a window's uncached files to open in processes (positions)."""
    misses = [j for j, meta in enumerate(found) if meta is None]
    remote = [j for j in misses if is_url(window[j])]
    local = [j for j in misses if not is_url(window[j])]
    many_local = len(local) >= MIN_LOCAL_OPENS and cores.available() >= 2
    return sorted(
        (remote if len(remote) >= MIN_PROCESS_OPENS else [])
        + (local if many_local else [])
    )


def _version(path: str, options: dict):
    """An object's version now (None: not a URL, or the open will say why)."""
    if not is_url(path):
        return None
    try:
        return formats.for_path(path).stat_path(path, options)
    except Exception:
        return None


def _pool(n: int, remote: bool) -> concurrent.futures.ProcessPoolExecutor | None:
    """Spawned processes for `n` opens (`remote`: two per core, else one), or
    None (they would run a script again).
    """  # noqa: D205
    if multiprocessing.current_process().daemon or main_thread_site() is not None:
        return None
    workers = min(MAX_PROCESSES, (2 if remote else 1) * cores.available(), n)
    context = multiprocessing.get_context("spawn")
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=context)


def _open_and_store(args) -> FileMeta | None:
    """In a build's process: opens one file and stores its entry (None: stored)."""
    path, element, obs_names, genes_from, options, version = args
    meta = inspect_file(path, element, obs_names, genes_from, options, version)
    return None if MetaCache(element, genes_from).store(meta) else meta
