"""The one pipeline on Grain's dataset API (`CellDataset`).

Design notes: docs/reference/design.md#pipeline-dataset.
"""

from __future__ import annotations

import grain
from grain import sharding

from grain_cells._util import arguments, cores
from grain_cells.pipeline import _state_checks
from grain_cells.pipeline._fetch import SplitFetch
from grain_cells.pipeline._iterator import CellIterator
from grain_cells.pipeline._stage import (
    Position,
    advances_epochs,
    check_countable,
    plan_minibatches,
)
from grain_cells.sampling import BlockStream, ConditionBlockSampler, check_sampler_fits


class CellDataset(grain.IterDataset):
    """Shuffled minibatches of a source; `cell_dataset(...)` builds one.

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
        """Binds the pipeline's parts; starts nothing.

        Raises:
            ValueError: `split` was built on another source or view, or a
                `ConditionBlockSampler` is striped for a plain grain.DataLoader.
        """
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
        if advances_epochs(self.sampler):
            self._epoch = epoch + 1

    def __len__(self) -> int:
        """Minibatches of the epoch the next `iter()` starts, on this shard.

        Computed once per epoch, unread (`plan_minibatches`). Raises the
        `TypeError` of `check_countable`.
        """
        check_countable(self.sampler, self.split.config)
        if self._length[0] != self._epoch:
            plan = self.start(self._epoch).plan(
                self.sampler, self.split.config.blocks_per_fetch
            )
            count = plan_minibatches(self.split.config, self.source, plan)
            self._length = (self._epoch, count)
        return self._length[1]

    def start(self, epoch: int) -> Position:
        """The position at the start of this shard's epoch `epoch`."""
        shard = self.shard
        return Position(count=shard.shard_count, index=shard.shard_index, epoch=epoch)

    def mp_prefetch(self, options=None, worker_init_fn=None, sequential_slice=False):
        """A copy with `options`' workers and buffer (in fetches), not Grain's
        slicing; raises `ValueError` for `worker_init_fn` or `sequential_slice`.
        """  # noqa: D205
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
