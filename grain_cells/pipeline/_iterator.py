"""`CellIterator`: the iterator of a `CellDataset`, its workers and its state.

Design notes: docs/reference/design.md#pipeline-iterator.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import weakref

import grain

from grain_cells import transport
from grain_cells.errors import IteratorClosedError
from grain_cells.pipeline import _state_checks
from grain_cells.pipeline._stage import (
    Position,
    ReadFetch,
    check_countable,
    plan_minibatches,
)

# Records are fetch numbers that cost nothing to read: no reader threads.
READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
# `CellIterator._failure` once closed: `next` tests one attribute for both.
_CLOSED = IteratorClosedError("closed")
# Iterators whose workers run: closed at exit, while every module still works.
_RUNNING: weakref.WeakSet = weakref.WeakSet()


def _close_running() -> None:
    for iterator in list(_RUNNING):
        iterator.close()


class CellIterator(grain.DatasetIterator):
    """Iterator of a `CellDataset`; its state is a position and a stamp.

    Closable (see "Closing" in `CellDataset`). Once `next` has raised (a file
    went bad; a worker died: `errors.WorkerDiedError` within about a second,
    the other workers stopped), every later call raises again.
    """

    def __init__(self, ds, epoch: int = 0):
        super().__init__()
        self._ds = ds
        self._g = ds.split.config.blocks_per_fetch
        self._position = ds.start(epoch)
        self._plan = self._position.plan(ds.sampler, self._g)
        self._inner = None
        self._batches = None
        self._taken = False
        self._failure: BaseException | None = None
        self._watch: transport.WorkerWatch | None = None  # its workers, once started
        self._total: tuple | None = None  # (plan, its minibatches) for len()
        transport.remove_stale()  # names of killed trainers and workers

    def _start(self) -> None:
        ds, n = self._ds, self._position.fetch
        read = ReadFetch(ds.split, self._plan, ds.worker_count, ds.readahead_cells)
        chain = grain.MapDataset.range(n, max(n, self._plan.num_fetches()))
        chain = chain.map(read).to_iter_dataset(READ_OPTIONS)
        if ds.worker_count:
            transport.check_main_guard(
                f"a grain_cells pipeline (worker_count={ds.worker_count})"
            )
            transport.allow_unparsed_flags()
            self._watch = transport.WorkerWatch(ds.worker_count)
            chain = chain.mp_prefetch(
                grain.MultiprocessingOptions(
                    num_workers=ds.worker_count,
                    per_worker_buffer_size=ds.worker_buffer_size,
                ),
                worker_init_fn=transport.worker_init,
            )
            atexit.unregister(_close_running)  # registered once
            atexit.register(_close_running)
            _RUNNING.add(self)
        self._inner = iter(chain)

    def __next__(self) -> dict:
        if self._failure is not None:  # failed earlier, or closed
            raise self._refusal()
        try:
            pos = self._position
            while True:
                if self._batches is None:
                    if pos.fetch >= self._plan.num_fetches():
                        raise StopIteration
                    if self._inner is None:
                        self._start()
                    # Lazy in this process; from a worker, a list of leases
                    # of its slots, handed out item by item.
                    self._batches = next(self._inner)
                    self._taken = isinstance(self._batches, list)
                    if self._watch is not None:
                        self._watch.look()  # the workers Grain has started
                if pos.minibatch < len(self._batches):
                    batch = self._batches[pos.minibatch]
                    if self._taken:  # the user alone decides when it dies
                        self._batches[pos.minibatch] = None
                    pos.minibatch += 1
                    pos.step += 1
                    if self._ds.truncation:  # warns once, here in the trainer
                        self._ds.truncation.observe(batch)
                    for op in self._ds.after:
                        batch = op.map(batch)
                    return batch
                self._batches = None
                pos.fetch += 1
                pos.minibatch = self._plan.skip(pos.fetch)
        except StopIteration:
            raise
        except Exception as e:
            dead = self._watch.dead() if self._watch is not None else []
            where = f"fetch {pos.fetch} of epoch {pos.epoch}"
            n = self._ds.worker_count
            error = transport.death_error(dead, n, where) if dead else e
            self._failure = error
            # Stop the workers now: Grain's chain, left to the cyclic
            # collector, may be closed from its own prefetch thread.
            self._stop()
            if error is e:
                raise
            raise error from e

    def __len__(self) -> int:
        """Minibatches this iterator has yet to yield, on this shard (so
        `tqdm(iter(loader))` shows the right total). A `TypeError` where
        `check_countable` raises one, or after a restore under another shard
        count.
        """  # noqa: D205
        ds = self._ds
        check_countable(ds.sampler, ds.split.config)
        if self._position.pieces:
            raise TypeError(
                "this iterator resumes a state saved under another shard count; "
                "it has no len() until its next epoch (iter(loader))"
            )
        if self._total is None or self._total[0] is not self._plan:
            count = plan_minibatches(ds.split.config, ds.source, self._plan)
            self._total = (self._plan, count)
        return max(0, self._total[1] - self._position.step)

    def __bool__(self) -> bool:
        return True  # an iterator, not a container (`len` may raise)

    @property
    def epoch(self) -> int:
        """The epoch this iterator walks (see "Epochs" in `CellDataset`)."""
        return self._position.epoch

    def start_prefetch(self) -> None:
        """Starts the workers now (orbax calls this after a restore)."""
        if self._failure is _CLOSED:
            raise self._refusal()
        if self._inner is None and self._position.fetch < self._plan.num_fetches():
            self._start()

    def _refusal(self) -> RuntimeError:
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
        inner, self._inner = self._inner, None
        if inner is not None:
            # A worker that cannot stop (SIGSTOPped) is killed after a grace.
            watch = self._watch
            grace = watch.killing_after() if watch else contextlib.nullcontext()
            with grace, contextlib.suppress(Exception):
                inner.close()
        if self._taken:  # the rest of a worker's fetch: its slots' leases
            self._batches = None
        transport.release_dead_rings()
        if self._watch is not None:  # names of workers that were killed
            transport.remove_stale()

    def close(self) -> None:
        """Stops the workers and frees their shared memory, for good (see
        "Closing" in `CellDataset`); closing twice is harmless.
        """  # noqa: D205
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

    def _settled(self) -> Position:
        """A copy of the position; past a fetch's end, the next fetch's start."""
        pos = Position(**vars(self._position))
        if self._batches is not None and pos.minibatch >= len(self._batches):
            pos.fetch += 1
            pos.minibatch = self._plan.skip(pos.fetch)
        return pos

    def get_state(self) -> dict:
        """The position (JSON-ready) and the pipeline's stamp."""
        position = self._settled().to_json()
        return {_state_checks.STAMP: self._ds.stamp, "position": position}

    def set_state(self, state: dict) -> None:
        """Restores a state saved by this pipeline under any worker count.

        Raises `CheckpointMismatchError` (see `_state_checks.restored`),
        `errors.SourceChangedError` or `IteratorClosedError`.
        """
        if self._failure is _CLOSED:
            raise self._refusal()
        saved = _state_checks.restored(state, self._ds)
        self._stop()
        self._position = saved
        self._plan = saved.plan(self._ds.sampler, self._g)
        self._batches = None
        self._failure = None
        self._ds._resumed(saved.epoch)  # the dataset's own iterator
