"""`device_iterator` (see `grain_cells.feed`).

Design notes: docs/reference/design.md#feed-device.
"""

from __future__ import annotations

import collections
import itertools
import json
from collections.abc import Iterable, Mapping, Sequence

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grain_cells._util.arguments import check_int
from grain_cells.outputs import densify as densify_batch

_CSR_KEYS = ("data", "indptr")  # CsrOutput's entries change shape every minibatch


class DeviceIterator:
    """Minibatches as global `jax.Array`s, `prefetch` copies ahead of the step.

    Made by `device_iterator`; closable; its state (JSON bytes) resumes after
    the last minibatch *returned*. With `equal_steps=True`, a process whose
    loader ran out yields padding minibatches (`mask` False, `row_ids` -1,
    else 0) until all have; `padding_steps` counts them.

    Example:
        >>> with device_iterator(iter(loader), equal_steps=True) as batches:
        ...     for batch in batches:
        ...         correct += eval_step(params, batch)
    """

    def __init__(self, source, sharding, keys, densify, pinned, prefetch, equal_steps):
        self._source = source
        self._sharding, self._keys, self._densify = sharding, keys, densify
        self._pinned = pinned  # a pinned-host sharding to stage copies through
        self._spec: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
        self._depth = prefetch + 1
        self._multi = jax.process_count() > 1
        self._agree = equal_steps and self._multi
        self._flags = None  # `_any_process`' sharding and reduction
        self._queue: collections.deque[tuple] = collections.deque()
        self._tracks_state = callable(getattr(source, "get_state", None))
        self._state = None  # the source's state after the last returned item
        self._pulls = self._pulled()
        self._closed = False
        self.padding_steps = 0

    def __iter__(self) -> DeviceIterator:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self._closed:
            raise RuntimeError("this DeviceIterator was closed; make a new one")
        self._queue.extend(
            itertools.islice(self._pulls, self._depth - len(self._queue))
        )
        if not self._queue:
            raise StopIteration
        device, state, agreed, padding = self._queue.popleft()
        if agreed is not None and not bool(agreed):
            # Every process has run out: all stop at this same step.
            self._queue.clear()
            self._pulls = iter(())
            raise StopIteration
        self._state = state
        self.padding_steps += padding
        return device

    def _pulled(self):
        """(device arrays, state after them, has any process data, padding): each
        minibatch (then padding ones, with `equal_steps`), its copy started.
        """  # noqa: D205
        state = self._state = self._state_now()  # before anything is taken
        for batch in self._source:
            self._check(batch)
            device = self._put(batch)
            state = self._state_now()
            yield device, state, self._any_process(True) if self._agree else None, 0
        while self._agree:
            if self._spec is None:
                raise ValueError(
                    f"process {jax.process_index()} of {jax.process_count()}: its "
                    "loader yielded no minibatch at all, so the feed cannot make "
                    "padding minibatches of the right shapes for equal_steps; "
                    "give every process at least one minibatch (a smaller batch "
                    "or fewer processes)"
                )
            batch = {
                key: np.full(shape, -1 if key == "row_ids" else 0, dtype)
                for key, (shape, dtype) in self._spec.items()
            }
            yield self._put(batch), state, self._any_process(False), 1

    def _state_now(self):
        return self._source.get_state() if self._tracks_state else None

    def _check(self, batch: Mapping[str, np.ndarray]) -> None:
        """Learns the entries' shapes from the first minibatch; checks later ones."""
        if self._spec is not None:
            for key, (shape, dtype) in self._spec.items():
                value = batch.get(key)
                if value is None:
                    raise ValueError(_missing(key, batch))
                if value.shape != shape or value.dtype != dtype:
                    raise ValueError(
                        f"minibatch entry {key!r} is {value.dtype}"
                        f"{list(value.shape)}, but the first minibatch's was "
                        f"{dtype}{list(shape)}; a device feed needs static shapes "
                        "(a new shape compiles the step again). Use fixed-size "
                        "outputs (PaddedSparseOutput, DenseOutput, token outputs), "
                        "whose minibatches all have batch_size rows"
                    )
            return
        keys = self._keys if self._keys is not None else tuple(batch)
        ragged = [k for k in keys if k in _CSR_KEYS]
        if ragged:
            raise ValueError(
                f"minibatch entries {ragged} are CSR (CsrOutput), whose shapes "
                "change with every minibatch; a device feed needs static shapes. "
                "Use PaddedSparseOutput(width) (and densify=num_genes to get "
                "dense rows on the device), DenseOutput, or leave them out of keys"
            )
        spec = {}
        for key in keys:
            if key not in batch:
                raise ValueError(_missing(key, batch))
            value = np.asarray(batch[key])
            if value.ndim == 0:
                raise ValueError(
                    f"minibatch entry {key!r} is a scalar; the feed splits every "
                    "entry along its first (batch) axis: leave it out of keys"
                )
            spec[key] = (value.shape, value.dtype)
        for key in ("values", "indices") if self._densify is not None else ():
            if key not in spec:
                raise ValueError(
                    f"densify needs the padded-sparse entries 'values' and "
                    f"'indices' (PaddedSparseOutput), but {key!r} is not among "
                    f"the entries sent: {sorted(spec)}"
                )
        self._spec = spec

    def _put(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Starts the (asynchronous) copies of the entries sent: device arrays."""
        host = {k: batch[k] for k in self._spec}
        sharding = self._sharding if self._pinned is None else self._pinned
        if not self._multi:  # one call for every entry: the cheapest path
            out = jax.device_put(host, sharding)
        else:
            out = {
                k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
                for k, v in host.items()
            }
        if self._pinned is not None:
            out = jax.device_put(out, self._sharding)
        if self._densify is not None:
            out["X"] = self._densify(out.pop("values"), out.pop("indices"))
        return out

    def _any_process(self, has_data: bool) -> jax.Array:
        """A replicated scalar (a collective, in step order): has any process data?"""
        if self._flags is None:
            mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("all",))
            replicated = NamedSharding(mesh, P())
            reduce = jax.jit(lambda f: f.any(), out_shardings=replicated)
            self._flags = (NamedSharding(mesh, P("all")), reduce)
        sharded, reduce = self._flags
        local = np.full(jax.local_device_count(), has_data)
        return reduce(jax.make_array_from_process_local_data(sharded, local))

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
        state = self._state  # None: nothing taken since the start or set_state
        state = self._state_now() if state is None else state
        if isinstance(state, str | bytes):
            return state.encode() if isinstance(state, str) else state
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
            state = json.loads(state) if isinstance(state, bytes | str) else state
        elif isinstance(state, Mapping):
            state = json.dumps(state, indent=1).encode()
        elif isinstance(state, str):
            state = state.encode()
        self._queue.clear()
        self._source.set_state(state)
        self._state = None
        self._pulls = self._pulled()

    def start_prefetch(self) -> None:
        """Starts the loader's workers now (orbax calls this after a restore)."""
        getattr(self._source, "start_prefetch", lambda: None)()

    def close(self) -> None:
        """Drops the prefetched minibatches and closes the loader's iterator."""
        self._closed = True
        self._queue.clear()
        getattr(self._source, "close", lambda: None)()

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
        batches: The loader's iterator (`iter(loader)`) or the loader; its
            `get_state`/`set_state`/`start_prefetch`/`close` pass through.
        sharding: Where each entry goes, splitting the leading (batch) axis.
            Default: over every device of every process (in process order).
        keys: The entries to send (e.g. `("values", "indices", "mask")`);
            default every entry of the first minibatch.
        prefetch: Minibatches copied ahead of the one returned (1: double
            buffering; 0: copy at `next()`).
        equal_steps: Pad processes whose loader ends first until all have
            ended (see `DeviceIterator`): for unequal shards and collectives.
        densify: The number of genes: replace `values` and `indices`
            (`PaddedSparseOutput`) by dense `X` `[batch, densify]`, on device.
        pinned_staging: Copy through page-locked host memory first
            (`benchmarks/gpu_host/run.sh` measures whether that is faster).

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
    genes = None if densify is None else check_int("densify", densify, minimum=1)
    if keys is not None:
        if isinstance(keys, str):
            raise TypeError(f"keys must be a sequence of entry names, got {keys!r}")
        keys = tuple(keys)
    if sharding is None:
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
        sharding = NamedSharding(mesh, P("data"))
    elif not isinstance(sharding, jax.sharding.Sharding):
        raise TypeError(
            f"sharding must be a jax.sharding.Sharding, got {type(sharding).__name__}"
        )
    source = batches if hasattr(batches, "__next__") else iter(batches)
    densify_on_device = None
    if genes is not None:
        densify_on_device = jax.jit(
            lambda v, i: densify_batch(v, i, genes), out_shardings=sharding
        )
    pinned = sharding.with_memory_kind("pinned_host") if pinned_staging else None
    return DeviceIterator(
        source, sharding, keys, densify_on_device, pinned, prefetch, bool(equal_steps)
    )


def _missing(key: str, batch: Mapping) -> str:
    return (
        f"minibatch has no entry {key!r} (it has {sorted(batch)}); name only "
        "entries the loader's output format makes in keys"
    )
