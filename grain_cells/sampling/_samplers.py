"""`BlockSampler`: every block once per epoch, shuffled (scDataset's block sampling).

Grain's `index_shuffle`, with NumPy from 4,096 positions and whole for small
epochs, checked against Grain: docs/reference/design.md#sampling-shuffle.
"""

from __future__ import annotations

import functools
import itertools
import math

import grain
import numpy as np
from grain import sharding

from grain_cells.sampling._stream import BlockStream

# Rounds of the Feistel network: Grain's own choice for its global shuffle.
_SHUFFLE_ROUNDS = 4
_LIST_POSITIONS = 1 << 16
_VECTOR_POSITIONS = 1 << 8  # from here, `numpy_index_shuffle` (equal at ~128)
_SMALL_EPOCH = 1 << 12  # blocks; up to here, an epoch's order whole (`_small_epoch`)


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
        super().__init__(num_blocks, seed, num_epochs, shard_options, readahead_cells)
        count = self.shard_options.shard_count
        self.epoch_length = self.num_blocks - self.num_blocks % count
        self._shuffle = bool(shuffle)

    @property
    def shuffle(self) -> bool:
        """Whether epochs are shuffled."""
        return self._shuffle

    def _block(self, epoch: int, offset: int) -> int:
        if not self._shuffle or self.num_blocks == 1:
            return offset
        seed = self._epoch_seed(epoch)
        if self.num_blocks <= _SMALL_EPOCH:
            return int(_small_epoch(self.num_blocks, seed)[offset])
        return _grain_shuffle(offset, self.num_blocks - 1, seed)

    def _blocks(self, epochs: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Vectorised from 4,096 positions of an epoch."""
        if not self._shuffle or self.num_blocks == 1 or offsets.size == 0:
            return offsets
        out = np.empty(offsets.size, np.int64)
        last = self.num_blocks - 1
        for epoch in np.unique(epochs).tolist():
            at = np.flatnonzero(epochs == epoch)
            seed = self._epoch_seed(epoch)
            if self.num_blocks <= _SMALL_EPOCH:
                out[at] = _small_epoch(self.num_blocks, seed)[offsets[at]]
                continue
            if at.size >= _VECTOR_POSITIONS:  # Grain's shuffle, with NumPy
                fast = numpy_index_shuffle(offsets[at], last, seed, _SHUFFLE_ROUNDS)
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


_MASK32 = 0xFFFFFFFF
_CHECKS = 16  # positions compared with Grain's function per permutation


@functools.lru_cache(maxsize=64)
def _round_keys(seed: int, rounds: int) -> tuple[int, ...]:
    """`std::seed_seq{seed}.generate(keys, keys + rounds)` (C++ [rand.util.seedseq])."""
    n, v = rounds, [seed & _MASK32]
    s = len(v)
    out = [0x8B8B8B8B] * n
    t = (n - 1) // 2
    for limit, value in ((7, 3), (39, 5), (68, 7), (623, 11)):
        t = value if n >= limit else t
    p = (n - t) // 2
    q = p + t
    m = max(s + 1, n)

    def mix(x):
        return (x ^ (x >> 27)) & _MASK32

    for k in range(m):
        r1 = 1664525 * mix(out[k % n] ^ out[(k + p) % n] ^ out[(k - 1) % n]) & _MASK32
        if k == 0:
            r2 = r1 + s
        elif k <= s:
            r2 = r1 + k % n + v[k - 1]
        else:
            r2 = r1 + k % n
        r2 &= _MASK32
        out[(k + p) % n] = (out[(k + p) % n] + r1) & _MASK32
        out[(k + q) % n] = (out[(k + q) % n] + r2) & _MASK32
        out[k % n] = r2
    for k in range(m, m + n):
        total = (out[k % n] + out[(k + p) % n] + out[(k - 1) % n]) & _MASK32
        r3 = 1566083941 * mix(total) & _MASK32
        r4 = (r3 - k % n) & _MASK32
        out[(k + p) % n] ^= r3
        out[(k + q) % n] ^= r4
        out[k % n] = r4
    return tuple(out)


def _encrypt(values: np.ndarray, keys, word: int) -> np.ndarray:
    mask = np.uint64((1 << word) - 1)
    w = np.uint64(word)

    def rotl(x, r):
        r = np.uint64(r)
        return ((x << r) | (x >> (w - r))) & mask

    def f(x):
        return (rotl(x, 1) & rotl(x, 8)) ^ rotl(x, 2)

    left = (values >> w) & mask
    right = values & mask
    for i in range(0, len(keys), 2):
        left ^= f(right)
        left ^= np.uint64(keys[i]) & mask
        right ^= f(left)
        right ^= np.uint64(keys[i + 1]) & mask
    return (left << w) | right


def _raw(offsets: np.ndarray, max_index: int, seed: int, rounds: int) -> np.ndarray:
    keys = _round_keys(seed, rounds)
    bits = math.ceil(math.log2(max_index))
    word = max(bits + bits % 2, 16) // 2
    out = _encrypt(offsets.astype(np.uint64), keys, word)
    limit = np.uint64(max_index)
    walking = np.flatnonzero(out > limit)
    while walking.size:  # cycle walking
        again = _encrypt(out[walking], keys, word)
        out[walking] = again
        walking = walking[again > limit]
    return out.astype(np.int64)


@functools.lru_cache(maxsize=256)
def _agrees(max_index: int, seed: int, rounds: int, whole: bool = False) -> bool:
    """Whether `_raw` (or `_whole`) gives Grain's answers on `_CHECKS` offsets."""
    probe = np.unique(np.linspace(0, max_index, _CHECKS).astype(np.int64))
    want = [
        grain.experimental.index_shuffle(int(o), max_index, seed, rounds)
        for o in probe.tolist()
    ]
    if whole:
        return _whole(max_index, seed, rounds)[probe].tolist() == want
    return _raw(probe, max_index, seed, rounds).tolist() == want


@functools.lru_cache(maxsize=4)
def _small_epoch(num_blocks: int, seed: int) -> np.ndarray:
    """`index_shuffle` of every offset of a small epoch (the last four kept):
    `_whole` where it agrees with Grain's function, else that function.
    """  # noqa: D205
    last = num_blocks - 1
    out = None
    if _agrees(last, 0, _SHUFFLE_ROUNDS, whole=True):
        out = _whole(last, seed, _SHUFFLE_ROUNDS)
    ends = [_grain_shuffle(0, last, seed), _grain_shuffle(last, last, seed)]
    if out is None or [out[0], out[last]] != ends:
        out = [_grain_shuffle(o, last, seed) for o in range(num_blocks)]
        out = np.array(out, np.int64)
    out.setflags(write=False)
    return out


def _grain_shuffle(offset: int, max_index: int, seed: int) -> int:
    return grain.experimental.index_shuffle(offset, max_index, seed, _SHUFFLE_ROUNDS)


def _whole(max_index: int, seed: int, rounds: int) -> np.ndarray:
    """`_raw` of every offset in `[0, max_index]` (a cipher word of 8 bits), by
    pointer doubling along the cipher's cycles (design notes).
    """  # noqa: D205
    keys = _round_keys(seed, rounds)
    word = 8
    if not 1 <= max_index < 1 << 2 * word:
        raise ValueError(f"max_index {max_index} is not a small epoch's")
    jump = _encrypt(np.arange(1 << 2 * word, dtype=np.uint64), keys, word)
    jump = jump.astype(np.int64)
    for _ in range(2 * word):
        head = jump[: max_index + 1]
        if head.max() <= max_index:
            break
        jump = np.where(jump <= max_index, jump, jump[jump])
    return jump[: max_index + 1].copy()


def numpy_index_shuffle(
    offsets, max_index: int, seed: int, rounds: int
) -> np.ndarray | None:
    """`index_shuffle` of each offset, or None where this differs from Grain's."""
    max_index, seed, rounds = int(max_index), int(seed), int(rounds)
    if not 1 <= max_index < 1 << 62 or rounds < 4 or rounds % 2:
        return None
    if not _agrees(max_index, seed, rounds):
        return None
    return _raw(np.asarray(offsets, np.int64).reshape(-1), max_index, seed, rounds)
