"""Block samplers: scDataset's block sampling, and weighted draws of blocks.

`BlockSampler` visits every block once per epoch, shuffled;
`WeightedBlockSampler` draws blocks with replacement by weight (weighted and
class-balanced sampling; see its docstring and `grain_cells.weighting`). Both
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
(`AnnDataSource.will_need`), `readahead_cells` ahead, so that on a cold page
cache the disk works while the CPU shuffles and gathers. The stream's future
is a pure function of the position, so this costs no state worth saving; the
hints follow each worker's own positions (Grain gives a worker every N-th).
"""

from __future__ import annotations

import hashlib
import math
import sys

import grain
import numpy as np
from grain import sharding

from grain_cells import arguments, counter_rng

# Rounds of the Feistel network: Grain's own choice for its global shuffle.
_SHUFFLE_ROUNDS = 4


def _check_stream_args(num_epochs, seed, shard_options) -> sharding.ShardOptions:
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


class _ReadsAhead:
    """Read-ahead hints for a sampler whose stream is a function of position.

    Also holds what every sampler of blocks shares: its sizes, seed, sharding
    and length.

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


def _readahead_positions(source, readahead_cells: int) -> int:
    if readahead_cells < 0:
        raise ValueError(f"readahead_cells must be >= 0, got {readahead_cells}")
    if source is None or readahead_cells == 0:
        return 0
    return max(2, -(-readahead_cells // source.block_size))


class BlockSampler(_ReadsAhead):
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
            seed: Seed of the shuffle, in `[0, 2**31)`.
            num_epochs: Epochs in the stream, or None for an endless stream.
            shard_options: `grain.sharding.NoSharding()` (default),
                `ShardOptions(index, count)` or `ShardByJaxProcess()`.
            readahead_cells: With a source, hint the OS this many cells ahead
                of the stream; 0 turns read-ahead off.

        Raises:
            ValueError: An argument is out of range, or there are fewer blocks
                than shards.
        """
        self._source = None
        if not isinstance(num_blocks, (int, np.integer)):
            if hasattr(num_blocks, "will_need"):
                self._source = num_blocks
            num_blocks = len(num_blocks)
        self._readahead = _readahead_positions(self._source, readahead_cells)
        num_blocks = int(num_blocks)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        shard_options = _check_stream_args(num_epochs, seed, shard_options)
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
        self._reset_readahead()

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
        """`block_at` of many positions."""
        return np.array([self.block_at(p) for p in positions], np.int64)

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
        return np.array(
            [self.block_at(start + i) for i in range(self._epoch_length)], np.int64
        )

    def skipped_blocks(self, epoch: int) -> np.ndarray:
        """Blocks that epoch `epoch` skips so that shards stay equal."""
        if self._epoch_length == self._num_blocks:
            return np.zeros(0, np.int64)
        visited = np.zeros(self._num_blocks, bool)
        visited[self.epoch_order(epoch)] = True
        return np.flatnonzero(~visited)

    def __repr__(self) -> str:
        so = self._shard_options
        return (
            f"BlockSampler(num_blocks={self._num_blocks}, shuffle={self._shuffle}, "
            f"seed={self._seed}, num_epochs={self._num_epochs}, "
            f"shard_index={so.shard_index}, shard_count={so.shard_count})"
        )


class WeightedBlockSampler(_ReadsAhead):
    """Draws blocks with replacement, each with probability proportional to
    its weight: weighted and class-balanced sampling.

    Implements Grain's `Sampler` protocol like `BlockSampler`. Position `p` of
    epoch `e` (offset `o = p - e * epoch_length`) draws block
    `searchsorted(cdf, u * total, side="right")` where `cdf` is the
    cumulative sum of the weights and `u = uniform(seed, e, o)` is a
    counter-based hash (`grain_cells.counter_rng`): every draw is a pure
    function of `(seed, epoch, position)`, O(log num_blocks) and without any
    per-epoch table, so Grain's iterator state (a position) restores the
    stream exactly, and the stream is the same on every platform.

    **Epoch.** An epoch is `epoch_length` draws, a number you choose
    (`epoch_blocks`, or `epoch_cells` converted with the expected cells per
    draw), rounded up to a multiple of the shard count so that every shard
    gets the same number of draws (shard `s` of `S` gets positions `s, s + S,
    ...`: disjoint positions, independent draws; a block may be drawn by
    several shards). Default: `num_blocks` draws.

    **Memory.** The cumulative weights: 8 bytes per block, pickled to every
    worker with the sampler.

    Weights come from `grain_cells.block_weights` (per-cell weights) or
    `grain_cells.balanced_block_weights` (class balance); see
    `grain_cells.weighting` for what weighting does to locality and diversity
    (blocks repeat, and a fetch may hold a block twice: its cells then come
    out twice).

    Example:
        >>> weights = grain_cells.balanced_block_weights(source, "cell_type")
        >>> sampler = WeightedBlockSampler(source, weights, epoch_cells=100_000,
        ...                                seed=0, num_epochs=None)
        >>> loader = grain_cells.DataLoader(
        ...     data_source=source, sampler=sampler,
        ...     operations=grain_cells.fetch_operations(source, batch_size=64))
    """  # noqa: D205

    def __init__(
        self,
        source,
        weights,
        *,
        epoch_blocks: int | None = None,
        epoch_cells: int | None = None,
        seed: int = 0,
        num_epochs: int | None = 1,
        shard_options: sharding.ShardOptions | None = None,
        readahead_cells: int = 16384,
    ):
        """Creates the sampler.

        Args:
            source: The `AnnDataSource` (or view) whose blocks are drawn, or
                just its number of blocks (then no read-ahead and no
                `epoch_cells`).
            weights: One non-negative finite weight per block, not all 0
                (normalised internally).
            epoch_blocks: Draws per epoch.
            epoch_cells: Cells per epoch, in expectation: `epoch_cells`
                divided by the expected cells per draw (exact when all blocks
                are full), rounded up. Exclusive with `epoch_blocks`.
            seed: Seed of the draws, in `[0, 2**31)`.
            num_epochs: Epochs in the stream, or None for an endless stream.
            shard_options: `grain.sharding.NoSharding()` (default),
                `ShardOptions(index, count)` or `ShardByJaxProcess()`.
            readahead_cells: With a source, hint the OS this many cells ahead
                of the stream; 0 turns read-ahead off.

        Raises:
            ValueError: An argument is out of range: weights of the wrong
                length, negative, non-finite or all 0; both or a non-positive
                epoch length; a bad seed, epoch count or shard.
        """
        self._source = None
        lengths = None
        if isinstance(source, (int, np.integer)):
            num_blocks = int(source)
        else:
            num_blocks = len(source)
            if hasattr(source, "block_ranges"):
                _, starts, stops = source.block_ranges(np.arange(num_blocks))
                lengths = stops - starts
            if hasattr(source, "will_need"):
                self._source = source
        self._readahead = _readahead_positions(self._source, readahead_cells)
        w = np.asarray(weights, np.float64)
        if w.shape != (num_blocks,):
            raise ValueError(
                f"weights needs one value per block ({num_blocks}), got shape {w.shape}"
            )
        if not np.isfinite(w).all() or (w < 0).any():
            bad = int(np.flatnonzero(~np.isfinite(w) | (w < 0))[0])
            raise ValueError(
                f"weights must be finite and >= 0; block {bad} has {w[bad]}"
            )
        if not (w > 0).any():
            raise ValueError("weights are all 0: no block can be drawn")
        shard_options = _check_stream_args(num_epochs, seed, shard_options)
        count = shard_options.shard_count
        if epoch_blocks is not None and epoch_cells is not None:
            raise ValueError(
                f"pass epoch_blocks or epoch_cells, not both (got epoch_blocks="
                f"{epoch_blocks}, epoch_cells={epoch_cells})"
            )
        for name, value in (
            ("epoch_blocks", epoch_blocks),
            ("epoch_cells", epoch_cells),
        ):
            if value is not None and (
                not isinstance(value, (int, np.integer)) or value < 1
            ):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self._cdf = np.cumsum(w)
        self._total = float(self._cdf[-1])
        self._last_drawable = int(np.flatnonzero(w > 0)[-1])
        if epoch_cells is not None:
            if lengths is None:
                raise ValueError(
                    "epoch_cells needs the source (block lengths), not a block "
                    "count; pass the AnnDataSource or use epoch_blocks"
                )
            per_draw = float(w @ lengths) / self._total
            draws = math.ceil(epoch_cells / per_draw)
        else:
            draws = num_blocks if epoch_blocks is None else int(epoch_blocks)
        self._epoch_length = -(-draws // count) * count
        self._num_blocks = num_blocks
        self._seed = int(seed)
        self._num_epochs = None if num_epochs is None else int(num_epochs)
        # Read by grain.DataLoader when it is given no shard_options.
        self._shard_options = shard_options
        self._weights_id = hashlib.sha256(w.astype("<f8").tobytes()).hexdigest()[:16]
        self._reset_readahead()

    @property
    def probabilities(self) -> np.ndarray:
        """Probability of each block per draw."""
        return np.diff(self._cdf, prepend=0.0) / self._total

    def block_at(self, position: int) -> int:
        """The block drawn at a stream position (no bounds check on epochs)."""
        epoch, offset = divmod(int(position), self._epoch_length)
        u = counter_rng.uniform_int(self._seed, epoch, offset)
        k = int(np.searchsorted(self._cdf, u * self._total, side="right"))
        return min(k, self._last_drawable)

    def blocks_at(self, positions) -> np.ndarray:
        """`block_at` of many positions, vectorised."""
        positions = np.asarray(positions, np.int64).reshape(-1)
        epochs, offsets = np.divmod(positions, self._epoch_length)
        u = counter_rng.uniform(self._seed, epochs, offsets)
        k = np.searchsorted(self._cdf, u * self._total, side="right")
        return np.minimum(k, self._last_drawable).astype(np.int64)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The blocks epoch `epoch` draws, in stream order (all shards)."""
        start = int(epoch) * self._epoch_length
        return self.blocks_at(np.arange(start, start + self._epoch_length))

    def __repr__(self) -> str:
        so = self._shard_options
        return (
            f"WeightedBlockSampler(num_blocks={self._num_blocks}, "
            f"weights=sha256:{self._weights_id}, "
            f"epoch_length={self._epoch_length}, seed={self._seed}, "
            f"num_epochs={self._num_epochs}, shard_index={so.shard_index}, "
            f"shard_count={so.shard_count})"
        )
