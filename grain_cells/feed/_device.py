"""`device_iterator`: a loader's minibatches as device arrays, copied ahead."""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence

import grain
import jax
import numpy as np

from grain_cells._util.arguments import check_int
from grain_cells.feed._arrays import Placement, default_sharding


@dataclasses.dataclass
class _Item:
    device: dict  # the minibatch's device arrays
    state: object  # the source's state once this minibatch was taken
    agreed: jax.Array | None  # any process has data (equal_steps), else None
    padding: bool


class DeviceIterator:
    """Minibatches as `jax.Array`s, `prefetch` transfers ahead of the step.

    Made by `device_iterator` (see there for the arguments). Yields dicts of global
    `jax.Array`s, each entry's leading axis split by the sharding over every device of
    every JAX process, in the first minibatch's shapes.

    **Double buffering.** `next()` starts the copy of the next host minibatch before
    it returns the one copied at the previous call, so minibatch `i + 1` is on its
    way while the step runs on `i` (`prefetch=1`).

    **State.** `get_state()` is the loader's state after the last minibatch
    *returned* (not the prefetched ones), as JSON bytes (what orbax's Grain handler
    and `grain_cells.checkpoint` write); `set_state()` drops the prefetched
    minibatches and sets the loader. So
    `grain_cells.checkpoint.IteratorSave(device_iterator)` resumes exactly.

    **Equal steps.** With `equal_steps=True` on several JAX processes, a process
    whose loader has run out yields *padding minibatches* (`mask` False, `row_ids`
    -1, every other entry 0) until every loader has, so all stop together and a step
    with collectives never waits for a process that has left. The processes agree
    through one tiny collective per minibatch; `padding_steps` counts this process's
    padding minibatches.

    Closable (`close()` or a `with` block): closes the loader's iterator.

    Example:
        >>> with device_iterator(iter(loader), equal_steps=True) as batches:
        ...     for batch in batches:
        ...         correct += eval_step(params, batch)
    """

    def __init__(self, source, placement: Placement, prefetch: int, equal_steps: bool):
        self._source = source
        self._placement = placement
        self._depth = prefetch + 1
        self._agree = equal_steps and jax.process_count() > 1
        self._queue: collections.deque[_Item] = collections.deque()
        self._tracks_state = callable(getattr(source, "get_state", None))
        self._state = None  # the source's state after the last returned item
        self._pulled_state = None
        self._exhausted = False
        self._finished = False
        self._closed = False
        self.padding_steps = 0

    def __iter__(self) -> DeviceIterator:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self._closed:
            raise RuntimeError("this DeviceIterator was closed; make a new one")
        if self._finished:
            raise StopIteration
        while len(self._queue) < self._depth and self._pull():
            pass
        if not self._queue:
            self._finished = True
            raise StopIteration
        item = self._queue.popleft()
        if item.agreed is not None and not bool(item.agreed):
            # Every process has run out: all stop at this same step.
            self._queue.clear()
            self._finished = True
            raise StopIteration
        self._state = item.state
        self.padding_steps += item.padding
        return item.device

    def _pull(self) -> bool:
        """Takes one minibatch (or a padding one) and starts its copy."""
        if self._tracks_state and not self._queue and self._state is None:
            self._state = self._source.get_state()  # before anything is taken
        batch = None
        if not self._exhausted:
            try:
                batch = next(self._source)
            except StopIteration:
                self._exhausted = True
        if batch is None:
            if not self._agree:
                return False
            if self._placement.spec is None:
                raise ValueError(
                    f"process {jax.process_index()} of {jax.process_count()}: its "
                    "loader yielded no minibatch at all, so the feed cannot make "
                    "padding minibatches of the right shapes for equal_steps; "
                    "give every process at least one minibatch (a smaller batch "
                    "or fewer processes)"
                )
            device = self._placement.put(self._placement.padding())
            agreed = self._placement.any_process(False)
            state = self._pulled_state if self._tracks_state else None
            self._queue.append(_Item(device, state, agreed, True))
            return True
        self._placement.check(batch)
        device = self._placement.put(batch)
        if self._tracks_state:
            self._pulled_state = self._source.get_state()
        agreed = self._placement.any_process(True) if self._agree else None
        self._queue.append(_Item(device, self._pulled_state, agreed, False))
        return True

    def get_state(self) -> bytes:
        """The loader's state after the last minibatch returned, JSON bytes.

        Raises:
            TypeError: The wrapped iterator has no `get_state`.
        """
        if not self._tracks_state:
            raise TypeError(
                f"the wrapped {type(self._source).__name__} has no get_state(); "
                "wrap a loader's iterator (grain_cells.DataLoader, "
                "grain.DataLoader, a Grain dataset iterator) to checkpoint it"
            )
        state = self._state
        if state is None:  # nothing taken since the start or set_state
            state = self._source.get_state()
        if isinstance(state, bytes):
            return state
        if isinstance(state, str):
            return state.encode()
        return json.dumps(state, indent=1).encode()

    def set_state(self, state: bytes | str | Mapping) -> None:
        """Drops the prefetched minibatches and restores the loader's state.

        Args:
            state: What `get_state()` returned (JSON bytes or text, or the
                parsed dict).
        """
        if not callable(getattr(self._source, "set_state", None)):
            raise TypeError(
                f"the wrapped {type(self._source).__name__} has no set_state()"
            )
        if isinstance(self._source, grain.DatasetIterator):
            if isinstance(state, (bytes, str)):
                state = json.loads(state)
        elif isinstance(state, Mapping):
            state = json.dumps(state, indent=1).encode()
        elif isinstance(state, str):
            state = state.encode()
        self._queue.clear()
        self._source.set_state(state)
        self._state = self._pulled_state = None
        self._exhausted = self._finished = False

    def start_prefetch(self) -> None:
        """Starts the loader's workers now (orbax calls this after a restore)."""
        start = getattr(self._source, "start_prefetch", None)
        if start is not None:
            start()

    def close(self) -> None:
        """Drops the prefetched minibatches and closes the loader's iterator."""
        self._closed = True
        self._queue.clear()
        close = getattr(self._source, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> DeviceIterator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def device_iterator(
    batches: Iterable[Mapping[str, np.ndarray]],
    sharding: jax.sharding.Sharding | None = None,
    *,
    keys: Sequence[str] | None = None,
    prefetch: int = 1,
    equal_steps: bool = False,
    densify: int | None = None,
    pinned_staging: bool = False,
) -> DeviceIterator:
    """Feeds a loader's minibatches to the devices, one copy ahead of the step.

    Args:
        batches: The loader's iterator (`iter(loader)`) or the loader itself;
            its `get_state`/`set_state`/`start_prefetch`/`close` are passed
            through.
        sharding: Where each entry goes, splitting only the leading (batch)
            axis; the global batch is the processes' minibatches in process
            order. Default: the batch over every device of every process
            (`NamedSharding(Mesh(jax.devices(), ("data",)), P("data"))`).
        keys: The entries to send (e.g. `("values", "indices", "mask",
            "obs/cell_type")`); default every entry of the first minibatch.
            Entries stay NumPy dtypes, except that without `jax_enable_x64`
            JAX stores 64-bit ones (`row_ids`) as 32-bit.
        prefetch: Minibatches copied ahead of the one returned (1: double
            buffering; 0: copy at `next()`).
        equal_steps: On several JAX processes, give those whose loader ends
            first padding minibatches until all have ended (see
            `DeviceIterator`): for unequal shards and a step with collectives.
        densify: The number of genes: replace `values` and `indices`
            (`PaddedSparseOutput`) by dense `X` `[batch, densify]`, built on
            the devices (`grain_cells.densify`) right after the copy.
        pinned_staging: Copy through page-locked host memory first (whether
            that is faster is measured per host: `benchmarks/gpu_host/run.sh`).

    Returns:
        A `DeviceIterator` (nothing is read before the first `next()`).

    Raises:
        ValueError: `prefetch` is negative, or (at the first `next()`) an
            entry of `keys` is missing or ragged (CSR output).

    Example:
        >>> loader = grain_cells.DataLoader(...,
        ...     operations=grain_cells.fetch_operations(
        ...         source, batch_size=256,
        ...         output=grain_cells.PaddedSparseOutput(512)))
        >>> batches = device_iterator(iter(loader), densify=source.num_genes,
        ...                           keys=("values", "indices", "mask"))
        >>> batch = next(batches)   # {"X": [256, genes], "mask": [256]}
    """
    prefetch = check_int("prefetch", prefetch, minimum=0)
    if densify is not None:
        densify = check_int("densify", densify, minimum=1)
    if keys is not None:
        if isinstance(keys, str):
            raise TypeError(f"keys must be a sequence of entry names, got {keys!r}")
        keys = tuple(keys)
    if sharding is None:
        sharding = default_sharding()
    elif not isinstance(sharding, jax.sharding.Sharding):
        raise TypeError(
            f"sharding must be a jax.sharding.Sharding, got {type(sharding).__name__}"
        )
    source = batches if hasattr(batches, "__next__") else iter(batches)
    placement = Placement(sharding, keys, densify, bool(pinned_staging))
    return DeviceIterator(source, placement, prefetch, bool(equal_steps))
