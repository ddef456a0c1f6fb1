"""The compiled token kernels over slices of a minibatch's rows in threads.

Design notes: docs/reference/design.md#tokens-threads.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import multiprocessing
from collections.abc import Callable

import numpy as np

from grain_cells._util import cores, fork

MAX_AUTO = 4  # threads that `"auto"` uses at most
MIN_ROWS = 16  # rows per thread below which a hand-off costs more than it saves

# A forked child starts its own threads: the pool's belong to the parent.
_pool = fork.ProcessCache()


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


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    return _pool.get_or_make(
        "tokens",
        lambda: concurrent.futures.ThreadPoolExecutor(
            max_workers=64, thread_name_prefix="grain_cells-tokens"
        ),
    )


def encode_rows(
    call: Callable[[np.ndarray, int, int], tuple],
    rows: np.ndarray,
    n_out: int,
    threads: int,
) -> tuple:
    """`call(rows_part, a, b)` over slices of the `n_out` output rows, in threads.

    `call` encodes `rows_part` into output rows `[a, b)` and returns per-row arrays;
    returns them concatenated.
    """
    n = min(threads, n_out // MIN_ROWS)
    if n <= 1:
        return call(rows, 0, n_out)
    bounds = [n_out * k // n for k in range(n + 1)]
    parts = [(rows[a : min(b, rows.size)], a, b) for a, b in itertools.pairwise(bounds)]
    pool = _executor()
    futures = [pool.submit(call, *part) for part in parts[1:]]
    try:
        results = [call(*parts[0])]
    finally:  # never leave a thread writing into arrays we hand back
        concurrent.futures.wait(futures)
    results += [f.result() for f in futures]
    return tuple(np.concatenate(arrays) for arrays in zip(*results, strict=True))
