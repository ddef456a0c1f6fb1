"""The base of the block samplers (`BlockStream`), its checks, and read-ahead.

A sampler on a source under a plain `grain.DataLoader` hints its own next
positions' blocks (`PositionHints`). Design notes:
docs/reference/design.md#sampling-readahead.
"""

from __future__ import annotations

import math
import os
import sys
import threading

import grain
import numpy as np
from grain import sharding

from grain_cells._util import arguments
from grain_cells.source import AnnDataSource


def check_sampler_fits(sampler, data_source) -> None:
    """Refuses a sampler that is no sampler, or over another number of blocks."""
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


class PositionHints:
    """Hints `source` about a stream's next positions (>= 2), `readahead_cells` ahead.

    Each process (a worker, a forked child) starts its own window.
    """

    def __init__(self, source: AnnDataSource, readahead_cells: int):
        self.source = source
        self.window = max(2, -(-int(readahead_cells) // source.block_size))
        self._reset()

    def _reset(self) -> None:
        self._last: int | None = None  # the furthest position seen
        self._stride = 0  # gcd of the steps forward (0: none yet)
        self._hinted_until = -1
        self._lock = threading.Lock()  # one hinting thread at a time
        self._pid = os.getpid()

    def __getstate__(self):
        return {"source": self.source, "window": self.window}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def seen(self, index: int, stream: BlockStream) -> None:
        """Called with each position handed out, from any thread; hints ahead."""
        if self._pid != os.getpid():
            self._reset()  # forked: the parent's lock may have been held
        if not self._lock.acquire(blocking=False):
            return  # another thread hints
        try:
            self._seen(index, stream)
        finally:
            self._lock.release()

    def _seen(self, index: int, stream: BlockStream) -> None:
        last = self._last
        if last is not None:
            # Any two positions of one worker are a multiple of the worker
            # count apart, late ones too: their gcd is the stride.
            self._stride = math.gcd(self._stride, abs(index - last))
        stride = self._stride or 1
        # Positions up to one epoch ahead: a longer span hints the same
        # blocks again (thousands of `index_shuffle` calls for a small file).
        window = min(self.window * stride, max(stream.epoch_length, stride))
        if last is None or index > last:
            self._last = index
        elif index + window < last:  # far behind: restored or restarted
            self._last = index
            self._hinted_until = -1
        if self._hinted_until > index + window // 2:
            return
        first = max(self._hinted_until, index + stride)
        end = index + window
        if stream.num_epochs is not None:
            end = min(end, len(stream))
        if first >= end:
            return
        positions = range(first, end, stride)
        self.source.advise(stream.blocks_at(positions))
        self._hinted_until = positions[-1] + stride


class BlockStream:
    """The shared part of block samplers: sizes, seed, sharding, read-ahead.

    A subclass sets `epoch_length` and defines `fingerprint` and the blocks at
    `(epoch, offset)`: `_block` for one, `_blocks` for arrays of them.
    """

    num_blocks: int
    """Blocks of the source."""
    epoch_length: int
    """Positions per epoch over all shards (a multiple of the shard count)."""
    seed: int
    """Seed of the stream's randomness."""
    num_epochs: int | None
    """Epochs in the stream (None: endless)."""
    readahead_cells: int
    """Cells hinted ahead of the stream (0: none); a pipeline's fetch stage too."""

    def __init__(
        self, source, seed, num_epochs, shard_options, readahead_cells, fit_shards=True
    ):
        """Checks what every sampler takes; the subclass sets `epoch_length` next.

        `source`: an `AnnDataSource` (hinted `readahead_cells` ahead) or a number
        of blocks; with `fit_shards`, at least as many blocks as shards.
        """
        num_blocks = source
        if hasattr(source, "__len__") and not isinstance(source, str):
            num_blocks = len(source)  # a source: its blocks
        num_blocks = arguments.check_int("num_blocks", num_blocks, minimum=1)
        self.readahead_cells = arguments.check_int(
            "readahead_cells", readahead_cells, minimum=0
        )
        hinted = isinstance(source, AnnDataSource) and readahead_cells > 0
        self._hints = PositionHints(source, readahead_cells) if hinted else None
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
        if fit_shards and num_blocks < count:
            raise ValueError(
                f"{num_blocks} blocks cannot be split over {count} shards; use a "
                "smaller block_size or fewer shards"
            )
        self.num_blocks = num_blocks
        self.seed = int(seed)
        self.num_epochs = None if num_epochs is None else int(num_epochs)
        self._shard_options = shard_options  # where a grain.DataLoader looks

    @property
    def shard_options(self) -> sharding.ShardOptions:
        """The sharding the sampler sizes epochs for."""
        return self._shard_options

    def __len__(self) -> int:
        if self.num_epochs is None:
            return sys.maxsize
        return self.num_epochs * self.epoch_length

    def __getitem__(self, index: int) -> grain.RecordMetadata:
        index = int(index)
        if index < 0 or (self.num_epochs is not None and index >= len(self)):
            raise IndexError(
                f"position {index} is past the end of the stream ({len(self)} "
                "positions)"
            )
        if self._hints is not None:
            self._hints.seen(index, self)
        block = self._block(*divmod(index, self.epoch_length))
        return grain.RecordMetadata(index=index, record_key=block)

    def block_at(self, position: int) -> int:
        """The block at a stream position (no bounds check on epochs)."""
        return self._block(*divmod(int(position), self.epoch_length))

    def blocks_at(self, positions) -> np.ndarray:
        """The blocks at many stream positions (no bounds check on epochs)."""
        positions = np.asarray(positions, np.int64).reshape(-1)
        return self._blocks(*np.divmod(positions, self.epoch_length))

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The blocks of epoch `epoch`, in stream order (all shards)."""
        start = int(epoch) * self.epoch_length
        return self.blocks_at(np.arange(start, start + self.epoch_length))

    def _block(self, epoch: int, offset: int) -> int:
        raise NotImplementedError

    def _blocks(self, epochs: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        pairs = zip(epochs.tolist(), offsets.tolist(), strict=True)
        return np.array([self._block(e, o) for e, o in pairs], np.int64)

    def fingerprint(self) -> dict:
        """What a checkpoint records (JSON): the class and its order, not the shard."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return self._repr(self.fingerprint())

    def _repr(self, items: dict, tail: dict | None = None) -> str:
        """`Class(items..., shard_index=, shard_count=, tail...)`."""
        so = self.shard_options
        items = {**items, "shard_index": so.shard_index, "shard_count": so.shard_count}
        name = items.pop("class")
        items.update(tail or {})
        return f"{name}(" + ", ".join(f"{k}={v}" for k, v in items.items()) + ")"
