"""Block samplers: scDataset's block sampling, and weighted draws of blocks.

`BlockSampler` visits every block once per epoch, shuffled;
`WeightedBlockSampler` (in `grain_cells.sampling._weighted`) draws blocks with
replacement by weight (weighted and class-balanced sampling; see its
docstring and `grain_cells.blocks._weighting`). Both
are Grain samplers whose stream is a pure function of (seed, epoch,
position), and both read ahead. What follows describes `BlockSampler`.

The sampler walks the blocks (records) of an `AnnDataSource`, epoch after
epoch. With `shuffle=True` each epoch visits the blocks in a new order, a pure
function of `(seed, epoch, position)` computed by Grain's index shuffle (a
Feistel permutation: no table in memory), so an iterator's state is just a
position.

**Sharding.** Grain's `DataLoader` gives shard `s` of `S` the sampler
positions `s, s + S, s + 2S, ...`. So that every shard gets the same number of
blocks in every epoch (no data-parallel replica waits at an epoch's end), an
epoch is `num_blocks - num_blocks % S` positions long: the last
`num_blocks % S` blocks of each epoch's order are skipped in that epoch (with
shuffling, different blocks each epoch; without, always the last ones). With
one shard nothing is skipped. `skipped_blocks(epoch)` names them.

**Read-ahead.** Given the `AnnDataSource` itself (rather than its length),
the sampler also tells the OS which blocks its stream will need next
(`AnnDataSource.advise`), `readahead_cells` ahead, so that on a cold page
cache the disk works while the CPU shuffles and gathers. The stream's future
is a pure function of the position, so this costs no state worth saving; the
hints follow each worker's own positions (Grain gives a worker every N-th).
"""

from __future__ import annotations

import itertools

import grain
import numpy as np
from grain import sharding

from grain_cells._util import arguments
from grain_cells.sampling import _shuffle
from grain_cells.sampling._readahead import PositionHints
from grain_cells.sampling._stream import (
    BlockStream,
    check_sampler_fits,
    check_stream_args,
)

__all__ = ["BlockSampler", "BlockStream", "check_sampler_fits"]

# Rounds of the Feistel network: Grain's own choice for its global shuffle.
_SHUFFLE_ROUNDS = 4
_LIST_POSITIONS = 1 << 16
_VECTOR_POSITIONS = 1 << 12  # from here, `_shuffle` (checked against Grain)


class BlockSampler(BlockStream):
    """Samples blocks of contiguous cells, shuffled per epoch.

    Implements Grain's `Sampler` protocol: `__getitem__(position)` returns the
    `RecordMetadata` of the block at that position of the stream, `__len__`
    is the stream length, it pickles, and its `repr` is stable (Grain compares
    it when restoring an iterator).

    Pass the shard options here, not to the `DataLoader`: the `DataLoader`
    picks them up from the sampler, and the sampler needs them to size epochs.

    Example:
        >>> source = grain_cells.AnnDataSource(paths, block_size=16)
        >>> sampler = BlockSampler(len(source), seed=0, num_epochs=None,
        ...                        shard_options=grain.sharding.ShardByJaxProcess())
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_epochs: int | None = 1,
        shard_options: sharding.ShardOptions | None = None,
        readahead_cells: int = 16384,
    ):
        """Creates the sampler.

        Args:
            num_blocks: Number of blocks (`len(source)`), or the
                `AnnDataSource` itself to also read ahead.
            shuffle: Visit blocks in a new random order each epoch.
            seed: Seed of the shuffle, in `[0, 2**63)`.
            num_epochs: Epochs in the stream, or None for an endless stream.
            shard_options: `grain.sharding.NoSharding()` (default),
                `ShardOptions(index, count)` or `ShardByJaxProcess()`.
            readahead_cells: With a source, hint the OS this many cells ahead
                of the stream; 0 turns read-ahead off.

        Raises:
            ValueError: An argument is out of range, or there are fewer blocks
                than shards.
        """
        arguments.check_int("readahead_cells", readahead_cells, minimum=0)
        self._hints = PositionHints.for_source(num_blocks, readahead_cells)
        if hasattr(num_blocks, "__len__") and not isinstance(num_blocks, str):
            num_blocks = len(num_blocks)  # a source: its blocks
        num_blocks = arguments.check_int("num_blocks", num_blocks, minimum=1)
        shard_options = check_stream_args(num_epochs, seed, shard_options)
        count = shard_options.shard_count
        if num_blocks < count:
            raise ValueError(
                f"{num_blocks} blocks cannot be split over {count} shards; use a "
                "smaller block_size or fewer shards"
            )
        self._num_blocks = num_blocks
        self._shuffle = bool(shuffle)
        self._seed = int(seed)
        self._num_epochs = None if num_epochs is None else int(num_epochs)
        # Read by grain.DataLoader when it is given no shard_options.
        self._shard_options = shard_options
        self._epoch_length = num_blocks - num_blocks % count

    @property
    def shuffle(self) -> bool:
        """Whether epochs are shuffled."""
        return self._shuffle

    def block_at(self, position: int) -> int:
        """The block at a stream position (no bounds check on epochs)."""
        epoch, offset = divmod(int(position), self._epoch_length)
        if not self._shuffle or self._num_blocks == 1:
            return offset
        return grain.experimental.index_shuffle(
            offset,
            max_index=self._num_blocks - 1,
            seed=self._epoch_seed(epoch),
            rounds=_SHUFFLE_ROUNDS,
        )

    def blocks_at(self, positions) -> np.ndarray:
        """`block_at` of many positions: from 4,096 positions of an epoch,
        Grain's shuffle computed with NumPy (`grain_cells.sampling._shuffle`,
        checked against Grain's own function), else one call per position.
        """  # noqa: D205
        positions = np.asarray(positions, np.int64).reshape(-1)
        epochs, offsets = np.divmod(positions, self._epoch_length)
        if not self._shuffle or self._num_blocks == 1 or positions.size == 0:
            return offsets
        out = np.empty(positions.size, np.int64)
        last = self._num_blocks - 1
        for epoch in np.unique(epochs).tolist():
            at = np.flatnonzero(epochs == epoch)
            seed = self._epoch_seed(epoch)
            if at.size >= _VECTOR_POSITIONS:  # Grain's shuffle, with NumPy
                fast = _shuffle.shuffle(offsets[at], last, seed, _SHUFFLE_ROUNDS)
                if fast is not None:
                    out[at] = fast
                    continue
            for a in range(0, at.size, _LIST_POSITIONS):  # lists of Python ints
                part = at[a : a + _LIST_POSITIONS]
                out[part] = list(
                    map(
                        grain.experimental.index_shuffle,
                        offsets[part].tolist(),
                        itertools.repeat(last),
                        itertools.repeat(seed),
                        itertools.repeat(_SHUFFLE_ROUNDS),
                    )
                )
        return out

    def _epoch_seed(self, epoch: int) -> int:
        # index_shuffle takes a 32-bit seed; mix seed and epoch into one.
        cached = self.__dict__.get("_seed_memo")
        if cached is not None and cached[0] == epoch:
            return cached[1]
        mixed = np.random.SeedSequence([self._seed, epoch]).generate_state(1)
        value = int(mixed[0] & 0x7FFFFFFF)
        self.__dict__["_seed_memo"] = (epoch, value)
        return value

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All blocks in the order epoch `epoch` visits them (all shards)."""
        start = epoch * self._epoch_length
        return self.blocks_at(np.arange(start, start + self._epoch_length))

    def skipped_blocks(self, epoch: int) -> np.ndarray:
        """Blocks that epoch `epoch` skips so that shards stay equal."""
        if self._epoch_length == self._num_blocks:
            return np.zeros(0, np.int64)
        visited = np.zeros(self._num_blocks, bool)
        visited[self.epoch_order(epoch)] = True
        return np.flatnonzero(~visited)

    def fingerprint(self) -> dict:
        """What a checkpoint records of this sampler: what decides its order.

        Class, block count, shuffle, seed and epochs. Never the shard: a
        state restores under another shard (see
        `grain_cells.pipeline._resume`).
        """
        return {
            "class": type(self).__name__,
            "num_blocks": self._num_blocks,
            "shuffle": self._shuffle,
            "seed": self._seed,
            "num_epochs": self._num_epochs,
        }

    def __repr__(self) -> str:
        so = self._shard_options
        return (
            f"BlockSampler(num_blocks={self._num_blocks}, shuffle={self._shuffle}, "
            f"seed={self._seed}, num_epochs={self._num_epochs}, "
            f"shard_index={so.shard_index}, shard_count={so.shard_count})"
        )
