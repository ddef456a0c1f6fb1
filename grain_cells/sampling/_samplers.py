"""`BlockSampler`: every block once per epoch, shuffled (scDataset's block sampling).

Design notes: docs/reference/design.md#sampling-samplers.
"""

from __future__ import annotations

import itertools

import grain
import numpy as np
from grain import sharding

from grain_cells._util import arguments
from grain_cells.sampling import _shuffle
from grain_cells.sampling._stream import BlockStream, PositionHints, check_stream_args

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
        hints = PositionHints.for_source(num_blocks, readahead_cells)
        if hasattr(num_blocks, "__len__") and not isinstance(num_blocks, str):
            num_blocks = len(num_blocks)  # a source: its blocks
        num_blocks = arguments.check_int("num_blocks", num_blocks, minimum=1)
        shard_options = check_stream_args(num_epochs, seed, shard_options, num_blocks)
        count = shard_options.shard_count
        super().__init__(
            num_blocks=num_blocks,
            epoch_length=num_blocks - num_blocks % count,
            seed=seed,
            num_epochs=num_epochs,
            shard_options=shard_options,
            hints=hints,
        )
        self._shuffle = bool(shuffle)

    @property
    def shuffle(self) -> bool:
        """Whether epochs are shuffled."""
        return self._shuffle

    def block_at(self, position: int) -> int:
        """The block at a stream position (no bounds check on epochs)."""
        epoch, offset = divmod(int(position), self.epoch_length)
        if not self._shuffle or self.num_blocks == 1:
            return offset
        return grain.experimental.index_shuffle(
            offset,
            max_index=self.num_blocks - 1,
            seed=self._epoch_seed(epoch),
            rounds=_SHUFFLE_ROUNDS,
        )

    def blocks_at(self, positions) -> np.ndarray:
        """`block_at` of many (from 4,096 of an epoch, `_shuffle` with NumPy)."""
        positions = np.asarray(positions, np.int64).reshape(-1)
        epochs, offsets = np.divmod(positions, self.epoch_length)
        if not self._shuffle or self.num_blocks == 1 or positions.size == 0:
            return offsets
        out = np.empty(positions.size, np.int64)
        last = self.num_blocks - 1
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
        """`index_shuffle`'s 32-bit seed: `seed` and `epoch` mixed (memoised)."""
        cached = self.__dict__.get("_seed_memo")
        if cached is not None and cached[0] == epoch:
            return cached[1]
        mixed = np.random.SeedSequence([self.seed, epoch]).generate_state(1)
        value = int(mixed[0] & 0x7FFFFFFF)
        self.__dict__["_seed_memo"] = (epoch, value)
        return value

    def skipped_blocks(self, epoch: int) -> np.ndarray:
        """Blocks that epoch `epoch` skips so that shards stay equal."""
        if self.epoch_length == self.num_blocks:
            return np.zeros(0, np.int64)
        visited = np.zeros(self.num_blocks, bool)
        visited[self.epoch_order(epoch)] = True
        return np.flatnonzero(~visited)

    def fingerprint(self) -> dict:
        """What a checkpoint records: what decides the order, never the shard."""
        return {
            "class": type(self).__name__,
            "num_blocks": self.num_blocks,
            "shuffle": self._shuffle,
            "seed": self.seed,
            "num_epochs": self.num_epochs,
        }
