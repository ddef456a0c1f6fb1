"""The base of grain_cells' block samplers (`BlockStream`) and their checks."""

from __future__ import annotations

import sys

import grain
import numpy as np
from grain import sharding

from grain_cells._util import arguments
from grain_cells.sampling._readahead import PositionHints


def check_stream_args(num_epochs, seed, shard_options) -> sharding.ShardOptions:
    """Validates the arguments every sampler takes; returns the shard options."""
    if num_epochs is not None:
        arguments.check_int("num_epochs", num_epochs, minimum=1)
    arguments.check_seed(seed)
    if shard_options is not None and not isinstance(
        shard_options, sharding.ShardOptions
    ):
        raise arguments.ArgumentTypeError(
            "shard_options must be a grain.sharding.ShardOptions (e.g. "
            f"ShardByJaxProcess()) or None, got shard_options={shard_options!r}"
        )
    shard_options = shard_options or sharding.NoSharding()
    count = shard_options.shard_count
    if not 0 <= shard_options.shard_index < count:
        raise ValueError(
            f"shard_index must lie in [0, {count}), got {shard_options.shard_index}"
        )
    return shard_options


def check_sampler_fits(sampler, data_source) -> None:
    """Refuses a sampler that walks another number of blocks than the source has.

    Grain's `DataLoader` takes record keys modulo `len(data_source)`: a longer sampler
    would silently repeat blocks, a shorter one read only the first.

    Raises:
        TypeError: `sampler` is not a sampler (no `__getitem__` and `__len__`).
        ValueError: `sampler.num_blocks != len(data_source)`.
    """
    if not (hasattr(sampler, "__getitem__") and hasattr(sampler, "__len__")):
        raise arguments.ArgumentTypeError(
            "sampler must be a Grain sampler over the source's blocks (e.g. "
            "grain_cells.BlockSampler(source)), with __getitem__ and __len__; "
            f"got sampler={sampler!r} ({type(sampler).__name__})"
        )
    num_blocks = getattr(sampler, "num_blocks", None)
    try:
        available = len(data_source)
    except TypeError:
        return
    if num_blocks is not None and num_blocks != available:
        raise ValueError(
            f"the sampler walks num_blocks={num_blocks} blocks but the data "
            f"source has {available} (len(data_source)): it was built on "
            "another source or view, and Grain would "
            + (
                "wrap the extra record keys around and repeat blocks"
                if num_blocks > available
                else "read only the source's first blocks"
            )
            + ". Build the sampler from this source: BlockSampler(len(source), "
            "...) or BlockSampler(source, ...)."
        )


class BlockStream:
    """The shared part of block samplers: sizes, seed, sharding, read-ahead.

    A subclass passes its sizes to `__init__` and defines `block_at(position)`,
    `blocks_at(positions)` and `fingerprint()`; Grain's `__getitem__`, `__len__`,
    the properties and a `repr` of the fingerprint and shard are shared.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        epoch_length: int,
        seed: int,
        num_epochs: int | None,
        shard_options: sharding.ShardOptions,
        hints: PositionHints | None = None,
    ):
        """Holds the sizes the subclass checked; `hints`: read-ahead, or None."""
        self._num_blocks = int(num_blocks)
        self._epoch_length = int(epoch_length)
        self._seed = int(seed)
        self._num_epochs = None if num_epochs is None else int(num_epochs)
        self._shard_options = shard_options
        self._hints = hints

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
        if self._hints is not None:
            self._hints.seen(index, self)
        return grain.RecordMetadata(index=index, record_key=self.block_at(index))

    def block_at(self, position: int) -> int:
        """The block at a stream position (no bounds check on epochs)."""
        raise NotImplementedError

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The blocks of epoch `epoch`, in stream order (all shards)."""
        start = int(epoch) * self.epoch_length
        return self.blocks_at(np.arange(start, start + self.epoch_length))

    def blocks_at(self, positions) -> np.ndarray:
        """The blocks at many stream positions (no bounds check on epochs)."""
        raise NotImplementedError

    def fingerprint(self) -> dict:
        """What a checkpoint records (JSON): the class and its order, not the shard."""
        raise NotImplementedError

    def __repr__(self) -> str:
        so = self.shard_options
        items = {**self.fingerprint(), "shard_index": so.shard_index}
        items["shard_count"] = so.shard_count
        name = items.pop("class")
        return f"{name}(" + ", ".join(f"{k}={v}" for k, v in items.items()) + ")"
