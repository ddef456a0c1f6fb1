"""The fetch stage: fetch `n` of a process -> its blocks -> its minibatches.

Design notes: docs/reference/design.md#pipeline-stage and #pipeline-resume.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import grain
import numpy as np

from grain_cells.sampling import BlockStream
from grain_cells.transport import fetch_starting, in_worker, send_all

# Most fetches the stage hints ahead (see `ReadFetch.__init__`).
MAX_AHEAD_FETCHES = 64


@dataclasses.dataclass(eq=False)
class Position:
    """Where an iterator is in the fetch stream of shard `index` of `count`.

    Its fetches hold sampler positions from `origin` on, after `pieces` (a
    restore under another shard count: `(positions, skip)`, piece `k` to shard
    `k % count`, `skip` minibatches already emitted); `epoch` reads `epoch *
    len(sampler)` further down the stream. `fetch`, `minibatch` and `step`
    (minibatches yielded) move as it yields; `to_json()` is the saved state.
    """

    sampler: Any
    blocks_per_fetch: int
    origin: int = 0
    count: int = 1
    index: int = 0
    pieces: Any = ()
    fetch: int = 0
    minibatch: int = 0
    step: int = 0
    epoch: int = 0

    def __post_init__(self):
        self.pieces = tuple((tuple(map(int, p)), int(k)) for p, k in self.pieces)
        self.length = len(self.sampler)
        self.shift = self.epoch * self.length if self.epoch else 0
        self.own = self.pieces[self.index :: self.count]

    def to_json(self) -> dict:
        """The saved fields, JSON-ready."""
        d = {k: getattr(self, k) for k in _SAVED}
        d["pieces"] = [[list(p), k] for p, k in self.pieces]
        return d

    def num_fetches(self) -> int:
        """Fetches of this shard (huge for an endless stream)."""
        positions = -(-(self.length - self.origin - self.index) // self.count)
        return len(self.own) + -(-max(0, positions) // self.blocks_per_fetch)

    def positions(self, n: int) -> np.ndarray:
        """Sampler positions of this shard's fetch `n`."""
        if n < len(self.own):
            return np.asarray(self.own[n][0], np.int64)
        g = n - len(self.own)
        i = np.arange(g * self.blocks_per_fetch, (g + 1) * self.blocks_per_fetch)
        p = self.origin + i * self.count + self.index
        return p[p < self.length]

    def skip(self, n: int) -> int:
        """Minibatches of fetch `n` emitted before (by the shard it came from)."""
        return self.own[n][1] if n < len(self.own) else 0

    def keys(self, positions: np.ndarray) -> np.ndarray:
        """Record keys (block ids) at sampler positions (of this epoch)."""
        if isinstance(self.sampler, BlockStream):  # vectorised
            positions = np.asarray(positions, np.int64) + self.shift
            return np.asarray(self.sampler.blocks_at(positions), np.int64).reshape(-1)
        return np.array(
            [self.sampler[int(p) + self.shift].record_key for p in positions], np.int64
        )


_SAVED = ("origin", "count", "index", "pieces", "fetch", "minibatch", "step", "epoch")


def advances_epochs(sampler) -> bool:
    """Whether each `iter()` starts a new epoch (grain_cells' finite streams)."""
    return isinstance(sampler, BlockStream) and sampler.num_epochs is not None


def fetch_blocks(source, keys: np.ndarray) -> np.ndarray:
    """A fetch as `SplitFetch` takes it: rows of (block, file, start, stop)."""
    files, starts, stops = source.block_ranges(keys)
    return np.stack([keys, files, starts, stops], axis=1).astype(np.int64)


def _minibatches(config, cells):
    """Minibatches of fetches of `cells` cells (an int or an array; no condition)."""
    if config.remainder == "drop":
        return cells // config.batch_size
    return -(-cells // config.batch_size)


def count_minibatches(config, source, keys: np.ndarray) -> int:
    """Minibatches a fetch of these blocks yields, unread (no condition)."""
    cells = 0
    if keys.size:
        _, starts, stops = source.block_ranges(keys)
        cells = int((stops - starts).sum())
    return _minibatches(config, cells)


def check_countable(sampler, config) -> None:
    """Raises the `TypeError` of `len()` where no count exists before reading."""
    if len(sampler) >= sys.maxsize:
        raise TypeError(
            "an endless stream (num_epochs=None) has no len(); count "
            "steps yourself, or give the sampler num_epochs"
        )
    if config.condition is not None:
        raise TypeError(
            f"with condition={config.condition!r} the minibatches per epoch "
            "depend on the cells' values, so there is no len() before the "
            "epoch is read"
        )


def plan_minibatches(config, source, plan: Position) -> int:
    """Minibatches a plan without pieces yields (a loader's `len`), unread.

    One vectorised walk of the block keys where blocks differ in length.
    """
    per_fetch = plan.blocks_per_fetch
    positions = -(-(plan.length - plan.origin - plan.index) // plan.count)
    _, starts, stops = source.block_ranges(np.arange(len(source)))
    sizes = (stops - starts).astype(np.int64)
    chunk = per_fetch * max(1, (1 << 20) // per_fetch)  # positions per pass
    total = 0
    for first in range(0, max(0, positions), chunk):
        steps = np.arange(first, min(first + chunk, positions), dtype=np.int64)
        if sizes.min() == sizes.max():
            cells = np.full(steps.size, sizes[0], np.int64)
        else:
            cells = sizes[plan.keys(plan.origin + steps * plan.count + plan.index)]
        fetched = np.add.reduceat(cells, np.arange(0, steps.size, per_fetch))
        total += int(_minibatches(config, fetched).sum())
    return total


class ReadFetch(grain.transforms.Map):
    """Fetch number -> its lazy `Minibatches`, or in a worker a list of slot
    handles (Grain `Map`). `stride`: fetches between this process's own.
    """  # noqa: D205

    def __init__(self, split, plan: Position, stride: int = 1, readahead_cells=0):
        self.split = split
        self.plan = plan
        self.stride = max(1, int(stride))
        per_fetch = plan.blocks_per_fetch * split.config.block_size
        ahead = -(-int(readahead_cells) // per_fetch) if readahead_cells else 0
        # Capped: many tiny fetches' keys delayed every iterator's first batch.
        self.ahead = min(ahead, MAX_AHEAD_FETCHES)
        self._hinted = -1
        self._keys: dict[int, np.ndarray] = {}  # of fetches hinted, not yet read

    def _keys_of(self, n: int) -> np.ndarray:
        keys = self._keys.pop(n, None)
        if keys is None:
            keys = self.plan.keys(self.plan.positions(n))
        return keys

    def __repr__(self) -> str:
        return f"ReadFetch({self.split!r})"

    def map(self, n):
        n = int(n)
        fetch_starting()
        batches = self.split.read(fetch_blocks(self.split.source, self._keys_of(n)))
        self._read_ahead(n)
        if not in_worker():
            return batches
        # Each minibatch is written into a slot as soon as it is formatted.
        return send_all(batches.format, len(batches))

    def _read_ahead(self, n: int) -> None:
        # A warm source hints nothing: no keys worked out (5-9% of a fetch).
        if not self.ahead or not self.split.source.hints_wanted:
            return
        # `ahead` fetches of the whole stream, this process hinting its own.
        window = max(self.ahead, self.stride)
        last = min(n + window, self.plan.num_fetches() - 1)
        first = max(n + self.stride, self._hinted + self.stride)
        if first > last or self._hinted > n + window // 2:
            return
        wanted = range(first, last + 1, self.stride)
        for m in list(self._keys):
            if m <= n:  # hinted but never read here (a seek, another order)
                self._keys.pop(m, None)
        keys = [self._keys_of(m) for m in wanted]
        self._keys.update(zip(wanted, keys, strict=True))
        if keys:
            self.split.source.advise(np.concatenate(keys))
            self._hinted = wanted[-1]


def _cursor(plan: Position, counts, step: int) -> tuple[int, int]:
    """(fetch, minibatch) of `plan`'s shard after `step` minibatches."""
    n, left, total = 0, step, plan.num_fetches()
    while n < total:
        emitted = counts(plan.positions(n)) - plan.skip(n)
        if left < emitted:
            return n, plan.skip(n) + left
        left -= emitted
        n += 1
    return total, 0


def hand_over(saved: Position, source, config, new_count: int, new_index: int):
    """The position of shard `new_index` of `new_count` that resumes `saved`
    (taken at the same step as every other shard's), at its plan's start.
    """  # noqa: D205

    def counts(positions):
        return count_minibatches(config, source, saved.keys(positions))

    old = [dataclasses.replace(saved, index=r) for r in range(saved.count)]
    cursors = [_cursor(plan, counts, saved.step) for plan in old]
    # The furthest plan fetch any old shard has begun (-1: none); one at the
    # start of fetch n has begun only n - 1 (no piece at fetch boundaries).
    furthest = max(
        n - len(plan.own) - (j <= plan.skip(n))
        for plan, (n, j) in zip(old, cursors, strict=True)
    )
    furthest = max(furthest, -1)
    left_pieces, plan_pieces = [], []
    for r, (plan, (n, j)) in enumerate(zip(old, cursors, strict=True)):
        total, own = plan.num_fetches(), len(plan.own)
        for m in range(n, min(total - 1, own + furthest) + 1):
            positions = plan.positions(m)
            skip = j if m == n else plan.skip(m)
            if positions.size == 0 or skip >= counts(positions):
                continue
            piece = (positions.tolist(), int(skip))
            if m < own:
                left_pieces.append(piece)
            else:
                plan_pieces.append((m - own, r, piece))
    plan_pieces.sort(key=lambda t: t[:2])
    pieces = left_pieces + [p for *_, p in plan_pieces]
    origin = saved.origin + (furthest + 1) * saved.blocks_per_fetch * saved.count
    shard = dict(count=new_count, index=new_index, pieces=pieces, fetch=0, step=0)
    position = dataclasses.replace(saved, origin=origin, **shard)
    position.minibatch = position.skip(0)
    return position
