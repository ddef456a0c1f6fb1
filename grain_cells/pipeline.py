"""The same pipeline on Grain's dataset API (`MapDataset` / `IterDataset`).

`cell_dataset(source, ...)` builds::

    MapDataset.range(positions)          # the BlockSampler's stream (one shard)
      .map(position -> Block)            # BlockSampler + AnnDataSource
      .batch(blocks_per_fetch)           # one fetch = consecutive positions
      .to_iter_dataset(READ_OPTIONS)
    FlatMapIterDataset(SplitFetch)       # read, shuffle, split into minibatches

and returns the `IterDataset`, ready for `.mp_prefetch(...)`, further
transformations, and `get_state`/`set_state` checkpointing (through
`grain.checkpoint.CheckpointSave` like any Grain iterator).

Unlike the `DataLoader`, fetches here are formed before the stream is split
over worker processes (`mp_prefetch` hands each worker whole fetches), so
which cells share a fetch, and hence the set of minibatches, does not depend
on the worker count; their interleaving does.
"""

from __future__ import annotations

import grain
from grain import sharding

from grain_cells.fetch import _GroupBlocks, fetch_operations
from grain_cells.loader import READ_OPTIONS
from grain_cells.sampler import BlockSampler, check_sampler_fits
from grain_cells.source import AnnDataSource


class _BlockAt:
    """Position of this shard's stream -> the Block there (picklable)."""

    def __init__(self, source: AnnDataSource, sampler: BlockSampler):
        self.source = source
        self.sampler = sampler
        shard = sampler.shard_options
        self.count = shard.shard_count
        self.index = shard.shard_index

    def __call__(self, position: int):
        record = self.sampler[int(position) * self.count + self.index]
        return self.source[record.record_key]


def cell_dataset(
    source: AnnDataSource,
    *,
    batch_size: int,
    fetch_factor: int = 16,
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
) -> grain.IterDataset:
    """Shuffled minibatches of `source` as a Grain `IterDataset`.

    Args:
        source: The cells.
        batch_size: Cells per minibatch.
        fetch_factor: Minibatches per fetch.
        output: `CsrOutput()` (default), `PaddedSparseOutput(...)` or
            `DenseOutput()`.
        shuffle: Shuffle blocks per epoch and cells inside each fetch.
        seed: Seed of both shuffles.
        num_epochs: Epochs, or None for an endless stream.
        shard_options: This process's shard (e.g. `ShardByJaxProcess()`).
        remainder: `"pad"` or `"drop"` for a fetch's short last minibatch.
        readahead_cells: How far ahead the sampler asks the OS for blocks.
        sampler: A sampler over `source`'s blocks to use instead of a
            `BlockSampler` built from the arguments above (e.g. a
            `WeightedBlockSampler`); `shuffle`, `seed` (of the block order),
            `num_epochs`, `shard_options` and `readahead_cells` then come
            from it.
        extra: More matrices per minibatch (`grain_cells.Layer`,
            `grain_cells.Obsm`), as in `fetch_operations`.
        numeric_obs: `"native"` or `"float32"`, as in `fetch_operations`.
        condition: One condition per minibatch, as in `fetch_operations`
            (pair with `grain_cells.ConditionBlockSampler(...,
            worker_count=0)`: fetches form before `mp_prefetch` splits them).

    Returns:
        An `IterDataset` of minibatch dicts (see `grain_cells.outputs`).

    Example:
        >>> ds = cell_dataset(source, batch_size=64, num_epochs=None)
        >>> ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
        >>> it = iter(ds); batch = next(it); state = it.get_state()
    """
    if sampler is None:
        sampler = BlockSampler(
            source,
            shuffle=shuffle,
            seed=seed,
            num_epochs=num_epochs,
            shard_options=shard_options,
            readahead_cells=readahead_cells,
        )
    check_sampler_fits(sampler, source)
    batch_op, split = fetch_operations(
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
    count = sampler.shard_options.shard_count
    positions = len(sampler) // count  # sys.maxsize // count when endless
    blocks = grain.MapDataset.range(positions).map(_BlockAt(source, sampler))
    fetches = blocks.batch(
        batch_op.batch_size, drop_remainder=False, batch_fn=_GroupBlocks()
    )
    return grain.experimental.FlatMapIterDataset(
        fetches.to_iter_dataset(READ_OPTIONS), split
    )
