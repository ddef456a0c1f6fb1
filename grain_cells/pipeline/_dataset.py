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

**Minibatches from workers are leases**: their arrays are views of the
worker's shared-memory slot (no copy in the trainer), and the slot returns
to the worker when the last array of the minibatch dies. A trainer that keeps
more minibatches than the ring lends (about three fetches' worth per worker)
gets private copies for the rest, so keeping minibatches never stalls the
workers (`grain_cells.transport._lease`).
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import weakref

import grain
from grain import sharding

from grain_cells._util import arguments
from grain_cells.errors import IteratorClosedError
from grain_cells.pipeline import _state_checks as state_checks
from grain_cells.pipeline._config import check_condition_sampler, check_same_source
from grain_cells.pipeline._fetch import SplitFetch
from grain_cells.pipeline._resume import Position, hand_over
from grain_cells.pipeline._stage import ReadFetch, advances_epochs, plan_minibatches
from grain_cells.sampling._samplers import check_sampler_fits
from grain_cells.transport import _ring as transport
from grain_cells.transport import _send, _shm_names
from grain_cells.transport import _worker as worker_process
from grain_cells.transport._main_guard import check_main_guard

# Records are fetch numbers that cost nothing to read: no reader threads.
READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
# `CellIterator._failure` once closed: `next` tests one attribute for both.
_CLOSED = IteratorClosedError("closed")
# Iterators whose workers run: closed at exit, while every module still works.
_RUNNING: weakref.WeakSet = weakref.WeakSet()


def _close_running() -> None:
    for iterator in list(_RUNNING):
        iterator.close()


class CellDataset(grain.IterDataset):
    """Shuffled minibatches of a source (see the module docstring).

    Use `cell_dataset(...)`, `grain_cells.DataLoader` or
    `grain_cells.loader(...)` to build one.

    **Epochs**, the same for `cell_dataset`, `grain_cells.DataLoader` and
    `grain_cells.loader` (which wrap this dataset). With a finite stream (a
    grain_cells sampler with `num_epochs=E`, 1 by default) each `iter()` starts
    the next epoch, as a torch `DataLoader` does, in a new order: epoch `e`
    walks the sampler's stream from position `e * len(sampler)` on, i.e. the
    sampler's epochs `e*E .. e*E + E - 1`, a pure function of (seed, epoch);
    the in-fetch shuffle follows the blocks. `epoch` is the epoch the next
    `iter()` starts, `set_epoch(e)` sets it (as torch's
    `DistributedSampler.set_epoch`: make every epoch explicit with it when a
    loop may start iterators it does not finish). The epoch is part of the
    iterator's state: restoring a state resumes in its epoch, and the next
    `iter()` starts the epoch after it. `len()` is the minibatches of the
    epoch the next `iter()` starts, on this shard (with `remainder="drop"`,
    less the dropped ones); a `TypeError` for an endless stream or with a
    `condition`. An endless stream (`num_epochs=None`) reshuffles each
    sampler epoch inside one iterator, and every `iter()` starts at its
    beginning; so does a sampler that is not grain_cells' (a plain Grain
    sampler). A plain `grain.DataLoader(sampler=BlockSampler(...),
    operations=fetch_operations(...))` is Grain's own loader: each `iter()`
    starts over at the sampler's first position (the same order), and its
    epochs are the sampler's `num_epochs` within one iterator.

    **Closing.** `close()` (or leaving a `with` block) stops the workers and
    frees their shared memory at once; `next()` then raises
    `errors.IteratorClosedError` (as does `set_state`); `get_state()` still
    tells where it stopped.
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
        self.readahead_cells = arguments.check_int(
            "readahead_cells", readahead_cells, minimum=0
        )
        self.after = tuple(after)
        self.stamp = state_checks.stamp(source, sampler, split)
        self._epoch = 0
        self._length = (-1, 0)  # (epoch, its len())

    def __str__(self) -> str:
        return f"CellDataset({self.split!r}, workers={self.worker_count})"

    def __iter__(self) -> CellIterator:
        iterator = CellIterator(self, self._epoch)
        if advances_epochs(self.sampler):
            self._epoch += 1
        return iterator

    @property
    def epoch(self) -> int:
        """The epoch the next `iter()` starts (see "Epochs" above)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Makes the next `iter()` start epoch `epoch` (see "Epochs" above).

        Raises:
            ValueError: `epoch` is negative, or not 0 where every `iter()`
                starts at the beginning (endless stream, a user's sampler).
        """
        epoch = arguments.check_int("epoch", epoch, minimum=0)
        if epoch and not advances_epochs(self.sampler):
            raise ValueError(
                f"set_epoch({epoch}): {self.sampler!r} is an endless stream or "
                "not a grain_cells sampler, so every iter() starts at its "
                "beginning and its epochs run inside one iterator; give the "
                "sampler num_epochs to count epochs by iter()"
            )
        self._epoch = epoch

    def _resumed(self, epoch: int) -> None:
        """A restored iterator is in `epoch`: the next `iter()` starts the next."""
        if advances_epochs(self.sampler):
            self._epoch = epoch + 1

    def __len__(self) -> int:
        """Minibatches of the epoch the next `iter()` starts, on this shard.

        Computed once per epoch, without reading cells: arithmetic when all
        blocks hold equal cell counts; otherwise the epoch's block order is
        walked once (about 5 CPU-seconds per million blocks for a shuffled
        `BlockSampler`).

        Raises:
            TypeError: The stream is endless, or a `condition` makes the
                count depend on the data.
        """
        if len(self.sampler) >= sys.maxsize:
            raise TypeError(
                "an endless stream (num_epochs=None) has no len(); count "
                "steps yourself, or give the sampler num_epochs"
            )
        if self.split.config.condition is not None:
            raise TypeError(
                f"with condition={self.split.config.condition!r} the "
                "minibatches per epoch depend on the cells' values, so there "
                "is no len() before the epoch is read"
            )
        if self._length[0] != self._epoch:  # computed once per epoch
            shard = self.shard
            start = Position(
                count=shard.shard_count, index=shard.shard_index, epoch=self._epoch
            )
            plan = start.plan(self.sampler, self.split.config.blocks_per_fetch)
            count = plan_minibatches(self.split.config, self.source, plan)
            self._length = (self._epoch, count)
        return self._length[1]

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

    Closable: `close()` (or leaving a `with` block) stops the workers and
    frees their shared memory; `next` then raises `IteratorClosedError`.
    Once `next` has raised (a worker died, a file went bad), every later call
    raises again rather than going on without the failed fetch.
    """

    def __init__(self, ds: CellDataset, epoch: int = 0):
        """Positions the iterator at the start of its shard's epoch `epoch`."""
        super().__init__()
        self._ds = ds
        self._g = ds.split.config.blocks_per_fetch
        shard = ds.shard
        self._position = Position(
            count=shard.shard_count, index=shard.shard_index, epoch=epoch
        )
        self._plan = self._position.plan(ds.sampler, self._g)
        self._inner = None
        self._batches = None
        self._taken = False  # whether `_batches` is a list handed out item by item
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
            atexit.unregister(_close_running)  # registered once
            atexit.register(_close_running)
            _RUNNING.add(self)
        self._inner = iter(chain)

    def _next_fetch(self) -> None:
        if self._inner is None:
            self._start()
        # A fetch's minibatches: lazy in this process, a list from a worker
        # (one element per fetch through Grain's queue; its arrays are leases
        # of the worker's slots, `grain_cells.transport._lease`).
        self._batches = next(self._inner)
        self._taken = isinstance(self._batches, list)

    def __next__(self) -> dict:
        if self._failure is not None:  # failed earlier, or closed
            raise self._refusal()
        try:
            pos = self._position
            while True:
                if self._batches is None:
                    if pos.fetch >= self._plan.num_fetches():
                        raise StopIteration
                    self._next_fetch()
                if pos.minibatch < len(self._batches):
                    batch = self._batches[pos.minibatch]
                    if self._taken:  # the user alone decides when it dies
                        self._batches[pos.minibatch] = None
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

    @property
    def epoch(self) -> int:
        """The epoch this iterator walks (see "Epochs" in `CellDataset`)."""
        return self._position.epoch

    def start_prefetch(self) -> None:
        """Starts the workers now (orbax calls this after a restore).

        Raises:
            IteratorClosedError: The iterator was closed.
        """
        if self._failure is _CLOSED:
            raise self._refusal()
        if self._inner is None and self._position.fetch < self._plan.num_fetches():
            self._start()

    def _refusal(self) -> RuntimeError:
        """What `next` raises once the iterator failed or was closed."""
        if self._failure is _CLOSED:
            return IteratorClosedError(
                "this data iterator was closed (close(), or the end of its "
                "with block): its workers and shared memory are gone. Start a "
                "new one with iter(loader), or restore a saved state into one"
            )
        error = RuntimeError(
            "the data iterator failed earlier and cannot continue; restore "
            "it from a checkpoint or start a new one"
        )
        error.__cause__ = self._failure
        return error

    def _stop(self) -> None:
        """Stops the workers (if any) and unmaps their rings."""
        inner, self._inner = self._inner, None
        if inner is not None:
            with contextlib.suppress(Exception):
                inner.close()
        if self._taken:  # the rest of a worker's fetch: its slots' leases
            self._batches = None
        transport.release_dead_rings()

    def close(self) -> None:
        """Stops the workers and frees their shared memory, for good.

        `next`, `set_state` and `start_prefetch` raise
        `errors.IteratorClosedError` afterwards; `get_state` still returns
        where the iterator stopped. Closing twice is harmless.
        """
        if sys.is_finalizing():  # after atexit (a tqdm bar's generator, say):
            return  # the workers are gone; so are other modules
        if self._batches is not None:  # the state no longer needs the fetch
            self._position = self._settled()
            self._batches = None
        self._failure = _CLOSED
        self._stop()
        _RUNNING.discard(self)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> CellIterator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- state ------------------------------------------------------------

    def _settled(self) -> Position:
        """A copy of the position; past a fetch's end, the next fetch's start."""
        pos = Position(**vars(self._position))
        if self._batches is not None and pos.minibatch >= len(self._batches):
            pos.fetch += 1
            pos.minibatch = self._plan.skip(pos.fetch)
        return pos

    def get_state(self) -> dict:
        """The position (JSON-ready, with the epoch) and the pipeline's stamp."""
        position = self._settled().to_json()
        return {state_checks.STAMP: self._ds.stamp, "position": position}

    def set_state(self, state: dict) -> None:
        """Restores a state saved by this pipeline under any worker count.

        Raises:
            CheckpointMismatchError: The state is of another pipeline (sampler,
                source data or configuration, operations), a field is out of
                range, or the shard count changed in a way the state cannot
                follow (see `grain_cells.pipeline._resume`).
            errors.SourceChangedError: A file changed since the source was
                built.
            IteratorClosedError: The iterator was closed.
        """
        if self._failure is _CLOSED:
            raise self._refusal()
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
        self._stop()
        self._position = saved
        self._plan = saved.plan(ds.sampler, self._g)
        self._batches = None
        self._failure = None
        ds._resumed(saved.epoch)  # the dataset's own iterator
