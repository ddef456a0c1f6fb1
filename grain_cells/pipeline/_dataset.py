"""The one pipeline, on Grain's public dataset API.

`cell_dataset(source, ...)` and `grain_cells.DataLoader` both build::

    MapDataset.range(n0, fetches)     # this shard's fetch numbers (FetchPlan)
      .map(ReadFetch)                 # read + shuffle + format a whole fetch
      .to_iter_dataset(READ_OPTIONS)
      .mp_prefetch(N workers)         # worker i runs fetches n0+i, n0+i+N, ...
    -> split each fetch into its minibatches (in the trainer; no copy)

Each worker emits one element per fetch, and Grain's `mp_prefetch`
interleaves its workers round-robin, one element each, so fetches arrive in
the order of their numbers whatever the worker count: the minibatch sequence
is a function of (data, seed, batch and fetch configuration, shard) only, and
the same with 0, 2 or 3 workers (tested).

The iterator's state is ours (`grain_cells.pipeline._resume.Position` plus a stamp of
the configuration): restoring rebuilds the Grain chain from the saved fetch,
under any worker count, and under another shard count (see `resume`).

**Memory per worker**: the fetch being read (its read buffer, about
`batch_size * fetch_factor` cells, and its formatted minibatches), plus
`worker_buffer_size` finished fetches waiting in the worker's queue, one
slot of its shared-memory ring per minibatch; in the trainer, the fetch being
handed out.
"""

from __future__ import annotations

import contextlib

import grain
from grain import sharding

from grain_cells._util import arguments
from grain_cells.pipeline import _state_checks as state_checks
from grain_cells.pipeline._config import make_split
from grain_cells.pipeline._fetch import SplitFetch
from grain_cells.pipeline._resume import Position, hand_over
from grain_cells.pipeline._stage import ReadFetch
from grain_cells.sampling._conditions import ConditionBlockSampler
from grain_cells.sampling._samplers import BlockSampler, check_sampler_fits
from grain_cells.source._source import AnnDataSource
from grain_cells.transport import _ring as transport
from grain_cells.transport import _send, _shm_names
from grain_cells.transport import _worker as worker_process
from grain_cells.transport._main_guard import check_main_guard

# Records are fetch numbers that cost nothing to read: no reader threads.
READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


class CellDataset(grain.IterDataset):
    """Shuffled minibatches of a source (see the module docstring).

    Use `cell_dataset(...)` or `grain_cells.DataLoader` to build one.
    """

    def __init__(
        self,
        source,
        sampler,
        split: SplitFetch,
        *,
        worker_count: int = 0,
        worker_buffer_size: int = 1,
        shard_options: sharding.ShardOptions | None = None,
        readahead_cells: int = 16384,
        after=(),
    ):
        """Binds the pipeline's parts; starts nothing."""
        super().__init__()
        check_sampler_fits(sampler, source)
        check_same_source(split, source)
        check_condition_sampler(sampler)
        self.source = source
        self.sampler = sampler
        self.split = split
        self.worker_count = arguments.check_int("worker_count", worker_count, minimum=0)
        self.worker_buffer_size = arguments.check_int(
            "worker_buffer_size", worker_buffer_size, minimum=1
        )
        shard = shard_options or getattr(sampler, "shard_options", None)
        self.shard = shard or sharding.NoSharding()
        self.readahead_cells = int(readahead_cells)
        self.after = tuple(after)
        self.stamp = state_checks.stamp(source, sampler, split)

    def __str__(self) -> str:
        return f"CellDataset({self.split!r}, workers={self.worker_count})"

    def __iter__(self) -> CellIterator:
        return CellIterator(self)

    def mp_prefetch(self, options=None, worker_init_fn=None, sequential_slice=False):
        """This pipeline with `options.num_workers` workers (same minibatches).

        Grain's `mp_prefetch` would slice the dataset over workers; here the
        workers are part of the pipeline (they read and format whole
        fetches), so this returns a copy with `worker_count` (and
        `worker_buffer_size`, in fetches) from `options`.

        Raises:
            ValueError: `worker_init_fn` or `sequential_slice` is given.
        """
        if worker_init_fn is not None or sequential_slice:
            raise ValueError(
                "CellDataset.mp_prefetch takes options only (worker_init_fn and "
                "sequential_slice are not supported)"
            )
        options = options or grain.MultiprocessingOptions(num_workers=10)
        return CellDataset(
            self.source,
            self.sampler,
            self.split,
            worker_count=options.num_workers,
            worker_buffer_size=max(1, options.per_worker_buffer_size),
            shard_options=self.shard,
            readahead_cells=self.readahead_cells,
            after=self.after,
        )


class CellIterator(grain.DatasetIterator):
    """Iterator of a `CellDataset`; its state is a position and a stamp.

    Closable: `close()` (or leaving a `with` block) stops the workers. Once
    `next` has raised (a worker died, a file went bad), every later call
    raises again rather than going on without the failed fetch.
    """

    def __init__(self, ds: CellDataset):
        """Positions the iterator at the start of its shard's stream."""
        super().__init__()
        self._ds = ds
        self._g = ds.split.config.blocks_per_fetch
        shard = ds.shard
        self._position = Position(count=shard.shard_count, index=shard.shard_index)
        self._plan = self._position.plan(ds.sampler, self._g)
        self._inner = None
        self._batches = None
        self._failure: BaseException | None = None
        if ds.worker_count:
            _shm_names.remove_stale()  # of trainers and workers that were killed

    # -- iteration --------------------------------------------------------

    def _start(self) -> None:
        ds, n = self._ds, self._position.fetch
        read = ReadFetch(ds.split, self._plan, ds.worker_count, ds.readahead_cells)
        chain = grain.MapDataset.range(n, max(n, self._plan.num_fetches()))
        chain = chain.map(read).to_iter_dataset(READ_OPTIONS)
        if ds.worker_count:
            # The pipeline owns the worker side: guard, flags, and what each
            # worker sets up (`_send.worker_init`).
            check_main_guard(f"a grain_cells pipeline (worker_count={ds.worker_count})")
            worker_process.allow_unparsed_flags()
            chain = chain.mp_prefetch(
                grain.MultiprocessingOptions(
                    num_workers=ds.worker_count,
                    per_worker_buffer_size=ds.worker_buffer_size,
                ),
                worker_init_fn=_send.worker_init,
            )
        self._inner = iter(chain)

    def _next_fetch(self) -> None:
        if self._inner is None:
            self._start()
        # A fetch's minibatches: lazy in this process, a list from a worker.
        self._batches = next(self._inner)

    def __next__(self) -> dict:
        if self._failure is not None:
            raise RuntimeError(
                "the data iterator failed earlier and cannot continue; restore "
                "it from a checkpoint or start a new one"
            ) from self._failure
        try:
            pos = self._position
            while True:
                if self._batches is None:
                    if pos.fetch >= self._plan.num_fetches():
                        raise StopIteration
                    self._next_fetch()
                if pos.minibatch < len(self._batches):
                    batch = self._batches[pos.minibatch]
                    pos.minibatch += 1
                    pos.step += 1
                    for op in self._ds.after:
                        batch = op.map(batch)
                    return batch
                self._batches = None
                pos.fetch += 1
                pos.minibatch = self._plan.skip(pos.fetch)
        except StopIteration:
            raise
        except Exception as e:
            self._failure = e
            raise

    def start_prefetch(self) -> None:
        """Starts the workers now (orbax calls this after a restore)."""
        if self._inner is None and self._position.fetch < self._plan.num_fetches():
            self._start()

    def close(self) -> None:
        """Stops the workers; the iterator cannot be used afterwards."""
        inner, self._inner = self._inner, None
        if inner is not None:
            with contextlib.suppress(Exception):
                inner.close()
        transport.release_dead_rings()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> CellIterator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- state ------------------------------------------------------------

    def get_state(self) -> dict:
        """The position (JSON-ready) and the pipeline's stamp."""
        pos = Position(**vars(self._position))
        if self._batches is not None and pos.minibatch >= len(self._batches):
            pos.fetch += 1
            pos.minibatch = self._plan.skip(pos.fetch)
        return {state_checks.STAMP: self._ds.stamp, "position": pos.to_json()}

    def set_state(self, state: dict) -> None:
        """Restores a state saved by this pipeline under any worker count.

        Raises:
            CheckpointMismatchError: The state is of another pipeline (sampler,
                source data or configuration, operations), a field is out of
                range, or the shard count changed in a way the state cannot
                follow (see `grain_cells.pipeline._resume`).
            errors.SourceChangedError: A file changed since the source was
                built.
        """
        ds = self._ds
        saved = state_checks.check_state(
            state, ds.stamp, ds.sampler, ds.source, ds.split
        )
        verify = getattr(ds.source, "verify_files", None)
        if verify is not None:
            verify("when an iterator state was restored")
        shard = ds.shard
        if (saved.count, saved.index) != (shard.shard_count, shard.shard_index):
            state_checks.check_hand_over(saved, ds.split)
            saved = hand_over(
                saved,
                ds.sampler,
                ds.source,
                ds.split.config,
                shard.shard_count,
                shard.shard_index,
            )
        self.close()
        self._position = saved
        self._plan = saved.plan(ds.sampler, self._g)
        self._batches = None
        self._failure = None


def cell_dataset(
    source: AnnDataSource,
    *,
    batch_size: int,
    fetch_factor: int | None = None,
    output=None,
    shuffle: bool = True,
    seed: int = 0,
    num_epochs: int | None = 1,
    shard_options: sharding.ShardOptions | None = None,
    remainder: str = "pad",
    readahead_cells: int = 16384,
    sampler=None,
    extra: dict | None = None,
    numeric_obs: str = "native",
    condition: str | None = None,
    worker_count: int = 0,
    worker_buffer_size: int = 1,
) -> CellDataset:
    """Shuffled minibatches of `source` as a Grain `IterDataset`.

    Args:
        source: The cells.
        batch_size: Cells per minibatch.
        fetch_factor: Minibatches per fetch; None as in `fetch_operations`.
        output: `CsrOutput()` (default), `PaddedSparseOutput(...)` or
            `DenseOutput()`.
        shuffle: Shuffle blocks per epoch and cells inside each fetch.
        seed: Seed of both shuffles.
        num_epochs: Epochs, or None for an endless stream.
        shard_options: This process's shard (e.g. `ShardByJaxProcess()`).
        remainder: `"pad"` or `"drop"` for a fetch's short last minibatch.
        readahead_cells: How far ahead the fetch stage asks the OS for blocks.
        sampler: A sampler over `source`'s blocks to use instead of a
            `BlockSampler` built from the arguments above (e.g. a
            `WeightedBlockSampler`); `shuffle`, `seed` (of the block order),
            `num_epochs` and `shard_options` then come from it.
        extra: More matrices per minibatch (`grain_cells.Layer`,
            `grain_cells.Obsm`), as in `fetch_operations`.
        numeric_obs: `"native"` or `"float32"`, as in `fetch_operations`.
        condition: One condition per minibatch, as in `fetch_operations`
            (pair with `grain_cells.ConditionBlockSampler(...,
            worker_count=0)`: fetches are consecutive positions of the shard).
        worker_count: Worker processes that read and format fetches (0: in
            this process). The minibatches are the same for every count.
        worker_buffer_size: Finished fetches each worker may hold ahead.

    Returns:
        A `CellDataset` (an `IterDataset`) of minibatch dicts (see
        `grain_cells.outputs`). Do not add `.mp_prefetch` to it: pass
        `worker_count` (Grain refuses to slice it anyway).

    Example:
        >>> ds = cell_dataset(source, batch_size=64, num_epochs=None,
        ...                   worker_count=2)
        >>> it = iter(ds); batch = next(it); state = it.get_state()
    """
    if sampler is None:
        sampler = BlockSampler(
            len(source),
            shuffle=shuffle,
            seed=seed,
            num_epochs=num_epochs,
            shard_options=shard_options,
            readahead_cells=0,
        )
    split = make_split(
        source,
        batch_size=batch_size,
        fetch_factor=fetch_factor,
        output=output,
        shuffle=shuffle,
        seed=seed,
        remainder=remainder,
        extra=extra,
        numeric_obs=numeric_obs,
        condition=condition,
    )
    return CellDataset(
        source,
        sampler,
        split,
        worker_count=worker_count,
        worker_buffer_size=worker_buffer_size,
        shard_options=shard_options,
        readahead_cells=readahead_cells,
    )


def check_same_source(split: SplitFetch, data_source) -> None:
    """Refuses fetch operations built on another source or view.

    The fetch transform reads through its own source; blocks of another view
    (a split, a selection) or of other files would be read from the wrong
    rows without a word.

    Raises:
        ValueError: `split.source` is not `data_source` (nor an equal one).
    """
    made = split.source
    if made is data_source or repr(made) == repr(data_source):
        return
    raise ValueError(
        "the fetch operations were built on another source than data_source: "
        f"fetch_operations(...) reads {made!r}, but data_source is "
        f"{data_source!r}. Build the sampler and fetch_operations from the "
        "source (or split view) passed as data_source."
    )


def check_condition_sampler(sampler) -> None:
    """Refuses a `ConditionBlockSampler` striped for a plain grain.DataLoader.

    Raises:
        ValueError: The sampler's `worker_count` is not 0.
    """
    if isinstance(sampler, ConditionBlockSampler) and sampler.worker_count:
        raise ValueError(
            f"ConditionBlockSampler(worker_count={sampler.worker_count}) stripes "
            "its groups for a plain grain.DataLoader's workers; "
            "grain_cells.DataLoader and cell_dataset form each fetch from "
            "consecutive positions whatever their worker_count, so build the "
            "sampler with worker_count=0 (its fetches then hold one condition "
            "each)"
        )
