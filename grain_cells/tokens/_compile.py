"""The first use of a compiled token kernel: announced, compiled once (file lock).

Design notes: docs/reference/design.md#tokens-compile.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import threading
import time

from grain_cells._util.cache_files import file_lock

_log = logging.getLogger("grain_cells")
_LOCK_NAME = "grain_cells_token_kernels.lock"
_first_use = threading.Lock()


def announced(kernel):
    """`kernel` (a numba dispatcher), announcing and locking its first compile."""
    ready = False

    @functools.wraps(kernel.py_func)
    def call(*args):
        nonlocal ready
        if not ready:
            with _first_use:
                if not ready:
                    result = _first_call(kernel, args)
                    ready = True
                    return result
        return kernel(*args)

    call.dispatcher = kernel
    return call


def cache_folder(kernel) -> str | None:
    stats = getattr(kernel, "stats", None)
    return getattr(stats, "cache_path", None)


def is_cached(kernel) -> bool:
    """Whether numba's cache folder holds an index of `kernel`."""
    folder = cache_folder(kernel)
    if not folder:
        return False
    name = kernel.py_func.__name__
    return bool(glob.glob(os.path.join(glob.escape(folder), f"*.{name}-*.nbi")))


def _first_call(kernel, args):
    if is_cached(kernel):
        return kernel(*args)  # loads from the cache (or compiles a new type)
    folder = cache_folder(kernel)
    lock = os.path.join(folder, _LOCK_NAME) if folder else None
    with file_lock(lock):  # waits while another process compiles
        if is_cached(kernel):
            return kernel(*args)  # it did: load its code
        _log.warning(
            "compiling token kernels (once: about 10 s; cached in %s for later "
            "runs and processes)",
            folder,
        )
        start = time.perf_counter()
        result = kernel(*args)
        _log.warning("token kernels compiled in %.1f s", time.perf_counter() - start)
    return result
