"""Validation of a restored iterator state, field by field.

A `grain_cells.DataLoader` state holds Grain's own state under `"grain"`.
Grain restores whatever numbers it is given: an in-fetch index past the
fetch's end, a negative position or a string where a count belongs would
resume at the wrong place (or fail deep inside Grain, in a worker). Before a
state reaches Grain, `check_state` checks every field it knows the meaning
of and raises `CheckpointMismatchError` naming the field, its value and the
valid range.

The states checked are those of a pipeline ending in the batched fetch
(`fetch_operations`): Grain's FlatMap state, `{"parent": {"next_index": p},
"next_index_in_buffer": k}`, where `p` is the position (in the worker's
stream of block records) of the current fetch's first block and `k` the
minibatches of that fetch already emitted; with workers, one such state per
worker inside Grain's multiprocess state. `k` is checked against the exact
number of minibatches of the fetch at `p` (worker `w` of `N` reads records
`w, w + N, ...` of its shard, Grain's slicing). Fields of other pipelines'
states are checked for type and sign only.
"""

from __future__ import annotations

import math

import numpy as np

from grain_cells.errors import CheckpointMismatchError


def _fail(field: str, value, valid: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"iterator state field {field} = {value!r} is invalid: expected "
        f"{valid}. The state was edited or corrupted; restore another "
        "checkpoint or start the data iterator afresh."
    )


def _int(state: dict, key: str, field: str, low: int, high: int | None) -> int:
    """`state[key]` checked to be an int in `[low, high]` (`high` None: no cap)."""
    valid = f"an int in [{low}, {'inf' if high is None else high}]"
    value = state.get(key) if isinstance(state, dict) else None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(field, value, valid)
    if value < low or (high is not None and value > high):
        raise _fail(field, value, valid)
    return value


class _Fetches:
    """Counts the minibatches of a worker's fetch, from the pipeline's parts."""

    def __init__(self, sampler, data_source, split, worker_count, shard_options):
        self.sampler = sampler
        self.source = data_source
        self.config = split.config
        # As Grain's DataLoader: its own shard options, else the sampler's.
        options = shard_options or getattr(sampler, "shard_options", None)
        self.shard_count = options.shard_count if options is not None else 1
        self.shard_index = options.shard_index if options is not None else 0
        self.workers = max(worker_count, 1)
        self.records = len(sampler) // self.shard_count  # Grain's shard length

    def worker_records(self, worker: int) -> int:
        """Records (block positions) in worker `worker`'s stream."""
        return max(0, -(-(self.records - worker) // self.workers))

    def minibatches(self, worker: int, first: int) -> int:
        """Minibatches of the fetch whose first record is `first` of `worker`."""
        g = self.config.blocks_per_fetch
        last = min(first + g, self.worker_records(worker))
        if last <= first:
            return 0
        local = worker + self.workers * np.arange(first, last, dtype=np.int64)
        positions = local * self.shard_count + self.shard_index
        keys = [self.sampler[int(p)].record_key for p in positions]
        _, starts, stops = self.source.block_ranges(keys)
        cells = int((stops - starts).sum())
        m = self.config.batch_size
        if self.config.remainder == "drop":
            return cells // m
        return math.ceil(cells / m)


def _check_flat_map(state, field: str, fetches: _Fetches | None, worker: int):
    """One worker's (or the only) FlatMap state."""
    if not isinstance(state, dict):
        raise _fail(field, state, "a dict with 'parent' and 'next_index_in_buffer'")
    parent = state.get("parent")
    high = fetches.worker_records(worker) if fetches is not None else None
    first = _int(parent, "next_index", f"{field}.parent.next_index", 0, high)
    count = fetches.minibatches(worker, first) if fetches is not None else None
    if fetches is not None:
        count = count if count else fetches.config.max_minibatches
    _int(state, "next_index_in_buffer", f"{field}.next_index_in_buffer", 0, count)


def _check_generic(value, field: str) -> None:
    """Ints must be non-negative (a 'last_*' index may be -1); recurse."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_generic(v, f"{field}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_generic(v, f"{field}[{i}]")
    elif isinstance(value, bool) or value is None or isinstance(value, str):
        return
    elif isinstance(value, int):
        low = -1 if field.rsplit(".", 1)[-1].startswith("last_") else 0
        if value < low:
            raise _fail(field, value, f"an int >= {low}")
    elif isinstance(value, float):
        raise _fail(field, value, "an int")


def check_state(
    state, *, sampler, data_source, operations, worker_count, shard_options=None
) -> None:
    """Checks every field of Grain's part of a restored state.

    Args:
        state: The `"grain"` part of the state (parsed JSON).
        sampler: The loader's sampler.
        data_source: The loader's source.
        operations: The loader's operations.
        worker_count: The loader's worker count.
        shard_options: The shard options given to the loader, if any (else
            the sampler's apply).

    Raises:
        CheckpointMismatchError: A field is missing, of the wrong type or out
            of range; the message names the field, its value and the range.
    """
    if not isinstance(state, dict):
        raise _fail("grain", state, "a dict (Grain's iterator state)")
    split = next((op for op in operations if hasattr(op, "cell_order")), None)
    fetches = None
    if split is not None and hasattr(data_source, "block_ranges"):
        fetches = _Fetches(sampler, data_source, split, worker_count, shard_options)
    if worker_count == 0:
        if "next_index_in_buffer" in state:
            _check_flat_map(state, "grain", fetches, 0)
        else:
            _check_generic(state, "grain")
        return
    if "iterators_in_use_states" not in state:
        _check_generic(state, "grain")
        return
    n = worker_count
    workers = state["iterators_in_use_states"]
    if not isinstance(workers, list) or len(workers) != n:
        raise _fail(
            "grain.iterators_in_use_states", workers, f"a list of {n} worker states"
        )
    for w, worker_state in enumerate(workers):
        field = f"grain.iterators_in_use_states[{w}]"
        if isinstance(worker_state, dict) and "next_index_in_buffer" in worker_state:
            _check_flat_map(worker_state, field, fetches, w)
        else:  # None once the datasets are used up
            _check_generic(worker_state, field)
    # Grain's interleave over the workers' datasets.
    _int(state, "next_index_in_datasets", "grain.next_index_in_datasets", 0, n)
    if "next_index_in_cycle" in state:
        _int(state, "next_index_in_cycle", "grain.next_index_in_cycle", 0, n - 1)
    in_use = state.get("iterators_in_use_indices")
    if not isinstance(in_use, list) or len(in_use) != n:
        raise _fail("grain.iterators_in_use_indices", in_use, f"a list of {n} ints")
    for i in range(n):
        _int({"v": in_use[i]}, "v", f"grain.iterators_in_use_indices[{i}]", 0, n - 1)
    exhausted = state.get("exhausted")
    if (
        not isinstance(exhausted, list)
        or len(exhausted) != n
        or any(v not in (0, 1) for v in exhausted)
    ):
        raise _fail("grain.exhausted", exhausted, f"a list of {n} values 0 or 1")
    for key, value in state.items():
        if key not in (
            "iterators_in_use_states",
            "next_index_in_datasets",
            "next_index_in_cycle",
            "iterators_in_use_indices",
            "exhausted",
        ):
            _check_generic(value, f"grain.{key}")
