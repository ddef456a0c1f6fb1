"""The one pipeline on Grain's dataset API: `CellDataset` and its `CellIterator`.

Design notes: docs/reference/design.md#pipeline-dataset and #pipeline-iterator.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import sys
import weakref

import grain
from grain import sharding

from grain_cells import transport
from grain_cells._util import arguments, cores
from grain_cells.errors import IteratorClosedError
from grain_cells.pipeline import _state_checks
from grain_cells.pipeline._fetch import SplitFetch
from grain_cells.pipeline._stage import (
    Position,
    ReadFetch,
    advances_epochs,
    check_countable,
    plan_minibatches,
)
from grain_cells.sampling import BlockStream, ConditionBlockSampler, check_sampler_fits

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

    Closable; once `next` has raised (a bad file, a dead worker), it raises again.
    """

    def __init__(self, ds, epoch: int = 0):
        super().__init__()
        self._ds = ds
        self._position = ds.start(epoch)
        self._inner = None
        self._batches = None
        self._taken = False
        self._failure: BaseException | None = None
        self._watch: transport.WorkerWatch | None = None  # its workers, once started
        transport.remove_stale()  # names of killed trainers and workers

    def _start(self) -> None:
        ds, pos = self._ds, self._position
        read = ReadFetch(ds.split, pos, ds.worker_count, ds.readahead_cells)
        chain = grain.MapDataset.range(pos.fetch, max(pos.fetch, pos.num_fetches()))
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
                    if pos.fetch >= pos.num_fetches():
                        raise StopIteration
                    if self._inner is None:
                        self._start()
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
                pos.minibatch = pos.skip(pos.fetch)
        except StopIteration:
            raise
        except Exception as e:
            dead = self._watch.dead() if self._watch is not None else []
            where = f"fetch {pos.fetch} of epoch {pos.epoch}"
            n = self._ds.worker_count
            error = transport.death_error(dead, n, where) if dead else e
            self._failure = error
            # Now: left to the collector, Grain's prefetch thread may close it.
            self._stop()
            if error is e:
                raise
            raise error from e

    def __len__(self) -> int:
        """Minibatches this iterator has yet to yield, on this shard."""
        if self._position.pieces:
            check_countable(self._ds.sampler, self._ds.split.config)
            raise TypeError(
                "this iterator resumes a state saved under another shard count; "
                "it has no len() until its next epoch (iter(loader))"
            )
        return max(0, self._ds.count(self._position) - self._position.step)

    def __bool__(self) -> bool:
        return True  # an iterator, not a container (`len` may raise)

    @property
    def epoch(self) -> int:
        """The epoch this iterator walks."""
        return self._position.epoch

    def start_prefetch(self) -> None:
        """Starts the workers now (orbax calls this after a restore)."""
        if self._failure is _CLOSED:
            raise self._refusal()
        pos = self._position
        if self._inner is None and pos.fetch < pos.num_fetches():
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
        """Stops the workers and frees their shared memory, for good."""
        if sys.is_finalizing():  # after atexit (a tqdm bar's generator, say):
            return  # the workers are gone; so are other modules
        if self._batches is not None:  # the state no longer needs the fetch
            self._position = self._settled()
            self._batches = None
        self._failure = _CLOSED
        self._stop()
        _RUNNING.discard(self)

    def __del__(self):
        try:  # noqa: SIM105 (`contextlib` may be gone at interpreter shutdown)
            self.close()
        except Exception:
            pass

    def __enter__(self) -> CellIterator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _settled(self) -> Position:
        """A copy of the position (past a fetch's end: the next one's start)."""
        pos = dataclasses.replace(self._position)
        if self._batches is not None and pos.minibatch >= len(self._batches):
            pos.fetch += 1
            pos.minibatch = pos.skip(pos.fetch)
        return pos

    def get_state(self) -> dict:
        """The position (JSON-ready) and the pipeline's stamp."""
        position = self._settled().to_json()
        return {_state_checks.STAMP: self._ds.stamp, "position": position}

    def set_state(self, state: dict) -> None:
        """Restores a state of this pipeline (see `_state_checks.restored`)."""
        if self._failure is _CLOSED:
            raise self._refusal()
        saved = _state_checks.restored(state, self._ds)
        self._stop()
        self._position = saved
        self._batches = None
        self._failure = None
        self._ds._resumed(saved.epoch)  # the dataset's own iterator


class CellDataset(grain.IterDataset):
    """Shuffled minibatches of a source; `cell_dataset(...)` builds one.

    Epochs, `len()` and `close()` are every spelling's: "Epochs and iterators"
    in docs/guides/loading.md.
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
        """Binds the parts (starts nothing); `ValueError` for a `split` of another
        source, or a `ConditionBlockSampler` striped for workers.
        """  # noqa: D205
        super().__init__()
        check_sampler_fits(sampler, source)
        made = split.source
        if made is not source and repr(made) != repr(source):
            raise ValueError(
                "the fetch operations were built on another source than "
                f"data_source: fetch_operations(...) reads {made!r}, but "
                f"data_source is {source!r}. Build the sampler and "
                "fetch_operations from the source (or split view) passed as "
                "data_source."
            )
        if isinstance(sampler, ConditionBlockSampler) and sampler.worker_count:
            raise ValueError(
                f"ConditionBlockSampler(worker_count={sampler.worker_count}) "
                "stripes its groups for a plain grain.DataLoader's workers; "
                "grain_cells.DataLoader and cell_dataset form each fetch from "
                "consecutive positions whatever their worker_count, so build "
                "the sampler with worker_count=0 (its fetches then hold one "
                "condition each)"
            )
        self.source = source
        self.sampler = sampler
        self.split = split
        for name, value, low in [
            ("worker_count", worker_count, 0),
            ("worker_buffer_size", worker_buffer_size, 1),
            ("readahead_cells", readahead_cells, 0),
        ]:
            setattr(self, name, arguments.check_int(name, value, minimum=low))
        cores.warn_if_oversubscribed(self.worker_count)
        if shard_options is None and isinstance(sampler, BlockStream):
            shard_options = sampler.shard_options
        self.shard = shard_options or sharding.NoSharding()
        self.after = tuple(after)
        self.stamp = _state_checks.stamp(source, sampler, split)
        self.truncation = split.truncation_report()  # warns once per loader
        self._epoch = 0
        self._length = (None, 0)  # (a plan's key, its minibatches)

    def __str__(self) -> str:
        return f"CellDataset({self.split!r}, workers={self.worker_count})"

    def __iter__(self) -> CellIterator:
        iterator = CellIterator(self, self._epoch)
        if advances_epochs(self.sampler):
            self._epoch += 1
        return iterator

    @property
    def epoch(self) -> int:
        """The epoch the next `iter()` starts."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Makes the next `iter()` start epoch `epoch`.

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
        if advances_epochs(self.sampler):
            self._epoch = epoch + 1

    def __len__(self) -> int:
        """Minibatches of the epoch the next `iter()` starts, on this shard.

        Raises:
            TypeError: The stream is endless (`num_epochs=None`), or a
                `condition` makes the count depend on the data.
        """
        return self.count(self.start(self._epoch))

    def count(self, plan) -> int:
        """Minibatches a plan without pieces yields, unread (the last one's cached);
        `TypeError` where no count exists before reading.
        """  # noqa: D205
        check_countable(self.sampler, self.split.config)
        key = (plan.origin, plan.count, plan.index, plan.shift)
        if self._length[0] != key:
            self._length = (key, plan_minibatches(self.split.config, self.source, plan))
        return self._length[1]

    def start(self, epoch: int) -> Position:
        """The position at the start of this shard's epoch `epoch`."""
        g, shard = self.split.config.blocks_per_fetch, self.shard
        where = dict(count=shard.shard_count, index=shard.shard_index, epoch=epoch)
        return Position(self.sampler, g, **where)

    def mp_prefetch(self, options=None, worker_init_fn=None, sequential_slice=False):
        """A copy with `options`' workers and buffer (in fetches)."""
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
