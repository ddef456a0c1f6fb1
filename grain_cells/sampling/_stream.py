"""The base of grain_cells' block samplers (`BlockStream`) and their checks.

A sampler of blocks is a Grain sampler whose stream is a pure function of
(seed, epoch, position): `block_at(position)`, vectorised as
`blocks_at(positions)`. `BlockSampler`, `WeightedBlockSampler` and
`ConditionBlockSampler` derive from `BlockStream`.
"""

from __future__ import annotations

import sys

import grain
import numpy as np
from grain import sharding

from grain_cells._util import arguments


def check_stream_args(num_epochs, seed, shard_options) -> sharding.ShardOptions:
    """Validates the arguments every sampler takes; returns the shard options."""
    if num_epochs is not None:
        arguments.check_int("num_epochs", num_epochs, minimum=1)
    arguments.check_seed(seed)
    shard_options = shard_options or sharding.NoSharding()
    count = shard_options.shard_count
    if not 0 <= shard_options.shard_index < count:
        raise ValueError(
            f"shard_index must lie in [0, {count}), got {shard_options.shard_index}"
        )
    return shard_options


def check_sampler_fits(sampler, data_source) -> None:
    """Refuses a sampler that walks more blocks than the source has.

    Grain's `DataLoader` takes record keys modulo `len(data_source)`, so a
    longer sampler would silently repeat blocks.

    Raises:
        ValueError: `sampler.num_blocks > len(data_source)`.
    """
    num_blocks = getattr(sampler, "num_blocks", None)
    try:
        available = len(data_source)
    except TypeError:
        return
    if num_blocks is not None and num_blocks > available:
        raise ValueError(
            f"the sampler walks num_blocks={num_blocks} blocks but the data "
            f"source has {available} (len(data_source)); Grain would wrap the "
            "extra record keys around and repeat blocks. Build the sampler "
            "from this source: BlockSampler(len(source), ...) or "
            "BlockSampler(source, ...)."
        )


class BlockStream:
    """The shared part of block samplers: sizes, seed, sharding, read-ahead.

    Read-ahead hints suit a stream that is a function of position.

    The hints serve a plain `grain.DataLoader`, which calls `__getitem__`
    position by position (and gives a worker every N-th: the stride is
    guessed from the calls). `grain_cells.DataLoader` and `cell_dataset` ask
    `blocks_at` instead, and their fetch stage does its own read-ahead.

    A subclass sets `_source` (None: no hints), `_readahead` (positions per
    window, 0: off) and `_num_epochs`, and defines `block_at(position)` and
    `blocks_at(positions)`; Grain's `__getitem__` is shared.
    """

    _source = None
    _readahead = 0
    _num_epochs: int | None = 1
    _num_blocks: int
    _epoch_length: int
    _seed: int
    _shard_options: sharding.ShardOptions

    @property
    def num_blocks(self) -> int:
        """Blocks of the source."""
        return self._num_blocks

    @property
    def epoch_length(self) -> int:
        """Positions per epoch over all shards (a multiple of the shard count)."""
        return self._epoch_length

    @property
    def shard_options(self) -> sharding.ShardOptions:
        """The sharding the sampler sizes epochs for."""
        return self._shard_options

    @property
    def seed(self) -> int:
        """Seed of the stream's randomness."""
        return self._seed

    @property
    def num_epochs(self) -> int | None:
        """Epochs in the stream (None: endless)."""
        return self._num_epochs

    def __len__(self) -> int:
        if self._num_epochs is None:
            return sys.maxsize
        return self._num_epochs * self._epoch_length

    def __getitem__(self, index: int) -> grain.RecordMetadata:
        index = int(index)
        if index < 0 or (self._num_epochs is not None and index >= len(self)):
            raise IndexError(
                f"position {index} is past the end of the stream ({len(self)} "
                "positions)"
            )
        if self._readahead:
            self._read_ahead(index)
        return grain.RecordMetadata(index=index, record_key=self.block_at(index))

    def _reset_readahead(self) -> None:
        self._last_index: int | None = None
        self._stride = 1
        self._hinted_until = -1

    def __getstate__(self):
        state = self.__dict__.copy()
        for key in ("_last_index", "_stride", "_hinted_until"):
            state.pop(key, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset_readahead()

    def _read_ahead(self, index: int) -> None:
        """Hints the blocks of this stream's next positions."""
        last = self._last_index
        self._last_index = index
        if last is not None and index > last:
            self._stride = index - last
        elif last is not None:  # restored or restarted: start over
            self._hinted_until = -1
        stride = self._stride
        window = self._readahead * stride
        if self._hinted_until > index + window // 2:
            return
        first = max(self._hinted_until, index + stride)
        end = index + window
        if self._num_epochs is not None:
            end = min(end, len(self))
        if first >= end:
            return
        positions = range(first, end, stride)
        self._source.will_need(self.blocks_at(positions))
        self._hinted_until = positions[-1] + stride

    def blocks_at(self, positions) -> np.ndarray:
        """The blocks at many stream positions (no bounds check on epochs)."""
        raise NotImplementedError


def readahead_positions(source, readahead_cells: int) -> int:
    """Positions per read-ahead window (0: off)."""
    if readahead_cells < 0:
        raise ValueError(f"readahead_cells must be >= 0, got {readahead_cells}")
    if source is None or readahead_cells == 0:
        return 0
    return max(2, -(-readahead_cells // source.block_size))
