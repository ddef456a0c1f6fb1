"""The one pipeline, on Grain's public dataset API.

Fetch numbers -> `ReadFetch` (read, shuffle, format a whole fetch) ->
`mp_prefetch` -> each fetch split into its minibatches in the trainer.

Design notes: docs/reference/design.md#pipeline-dataset.
"""

from __future__ import annotations

import grain
from grain import sharding

from grain_cells._util import arguments, cores
from grain_cells.outputs import TruncationReport
from grain_cells.pipeline import _state_checks
from grain_cells.pipeline._config import check_condition_sampler, check_same_source
from grain_cells.pipeline._extra import Layer
from grain_cells.pipeline._fetch import SplitFetch
from grain_cells.pipeline._iterator import READ_OPTIONS, CellIterator
from grain_cells.pipeline._resume import Position
from grain_cells.pipeline._stage import (
    advances_epochs,
    check_countable,
    plan_minibatches,
)
from grain_cells.sampling import BlockStream, check_sampler_fits

__all__ = ["READ_OPTIONS", "CellDataset", "CellIterator"]


class CellDataset(grain.IterDataset):
    """Shuffled minibatches of a source (see the design notes).

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
        cores.warn_if_oversubscribed(self.worker_count)
        self.worker_buffer_size = arguments.check_int(
            "worker_buffer_size", worker_buffer_size, minimum=1
        )
        if shard_options is None and isinstance(sampler, BlockStream):
            shard_options = sampler.shard_options
        self.shard = shard_options or sharding.NoSharding()
        self.readahead_cells = arguments.check_int(
            "readahead_cells", readahead_cells, minimum=0
        )
        self.after = tuple(after)
        self.stamp = _state_checks.stamp(source, sampler, split)
        self.truncation = truncation_report(split)  # warns once per loader
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
        walked once, vectorised (about 0.5 CPU-seconds per million blocks
        for a shuffled `BlockSampler`).

        Raises:
            TypeError: The stream is endless, or a `condition` makes the
                count depend on the data.
        """
        check_countable(self.sampler, self.split.config)
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

        Not Grain's slicing: a copy with `worker_count` (and `worker_buffer_size`,
        in fetches) from `options`.

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


def truncation_report(split: SplitFetch) -> TruncationReport:
    """A report on the padded outputs of `split`: X's and its extra matrices'."""
    outputs = {"": split.config.output}
    for name, reader in split.extra.items():
        if isinstance(reader.spec, Layer):
            outputs[f"{name}/"] = reader.spec.output
    return TruncationReport(outputs)
