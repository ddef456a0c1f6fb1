"""Compiled token kernels run: first compile announced and locked, rows in threads.

Design notes: docs/reference/design.md#tokens-threads and #tokens-compile.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import glob
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from grain_cells._util import cores, fork
from grain_cells._util.cache_files import file_lock

MAX_AUTO = 4  # threads that `"auto"` uses at most
MIN_ROWS = 16  # rows per thread below which a hand-off costs more than it saves

_log = logging.getLogger("grain_cells")
_LOCK_NAME = "grain_cells_token_kernels.lock"
_first_use = threading.Lock()


def resolve_threads(threads: int | str) -> int:
    """Threads per minibatch for a `threads` argument (`"auto"` or >= 1)."""
    if threads == "auto":
        if multiprocessing.parent_process() is not None:  # a Grain worker
            return 1
        return max(1, min(MAX_AUTO, cores.available()))
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)):
        raise ValueError(
            f"threads must be 'auto' or a positive integer, got threads={threads!r}"
        )
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got threads={threads}")
    return int(threads)


def encode_rows(call: Callable, rows: np.ndarray, n_out: int, threads: int) -> tuple:
    """`call(rows_part, a, b)` per slice `[a, b)` of the output rows, in threads.

    `call` encodes `rows_part` into output rows `[a, b)`; its arrays concatenated.
    """
    n = min(threads, n_out // MIN_ROWS)
    if n <= 1:
        return call(rows, 0, n_out)
    bounds = [n_out * k // n for k in range(n + 1)]
    parts = [(rows[a : min(b, rows.size)], a, b) for a, b in itertools.pairwise(bounds)]
    pool = fork.thread_pool("grain_cells-tokens", 64)
    futures = [pool.submit(call, *part) for part in parts[1:]]
    try:
        results = [call(*parts[0])]
    finally:  # never leave a thread writing into arrays we hand back
        concurrent.futures.wait(futures)
    results += [f.result() for f in futures]
    return tuple(np.concatenate(arrays) for arrays in zip(*results, strict=True))


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


def is_cached(kernel) -> bool:
    """Whether numba's cache folder holds an index of `kernel`."""
    folder = getattr(getattr(kernel, "stats", None), "cache_path", None)
    name = glob.escape(folder or "") + f"/*.{kernel.py_func.__name__}-*.nbi"
    return bool(folder and glob.glob(name))


def _first_call(kernel, args):
    folder = getattr(getattr(kernel, "stats", None), "cache_path", None)
    lock = os.path.join(folder, _LOCK_NAME) if folder else None
    with contextlib.nullcontext() if is_cached(kernel) else file_lock(lock):
        if is_cached(kernel):  # loads it (or compiles a new type), or another did
            return kernel(*args)
        _log.warning(
            "compiling token kernels (once: about 10 s; cached in %s for later "
            "runs and processes)",
            folder,
        )
        start = time.perf_counter()
        result = kernel(*args)
        _log.warning("token kernels compiled in %.1f s", time.perf_counter() - start)
    return result
