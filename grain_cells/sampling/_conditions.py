"""One condition per minibatch: every minibatch's cells share an obs value.

Design notes: docs/reference/design.md#sampling-conditions.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np
from grain import sharding

from grain_cells._util import counter_rng
from grain_cells._util.arguments import check_int
from grain_cells._util.ranges import expand_ranges
from grain_cells.sampling._stream import BlockStream

if TYPE_CHECKING:
    from grain_cells.source import BlockTable

_GROUP_WORD = 1 << 40
_DRAW_WORD = 1 << 41


def condition_blocks(source, column: str):
    """A view of `source` whose blocks never straddle a change of `column`.

    Args:
        source: An `AnnDataSource` (or a view) with `column` in its
            `obs_columns`.
        column: The condition column.

    Returns:
        A view (`source.view` of `condition_table`) over the same cells.
    """
    return source.view(condition_table(source.block_table, source.obs_values(column)))


def condition_table(table: BlockTable, values: np.ndarray) -> BlockTable:
    """`table`'s blocks, split wherever `values` (one per global row) changes."""
    _, starts, stops = table.ranges(np.arange(len(table)))
    lengths = stops - starts
    cells = expand_ranges(starts, lengths)
    first = np.zeros(cells.size, bool)
    first[np.cumsum(lengths) - lengths] = True
    change = np.ones(cells.size, bool)
    change[1:] = values[cells[1:]] != values[cells[:-1]]
    heads = np.flatnonzero(first | change)
    tails = np.append(heads[1:], cells.size) - 1
    return table.with_blocks(cells[heads], cells[tails] + 1)


class ConditionBlockSampler(BlockStream):
    """Blocks in groups of one condition, one group per fetch; see the module.

    Example:
        >>> view = condition_blocks(source, "drug")
        >>> sampler = ConditionBlockSampler(view, "drug", blocks_per_fetch=64,
        ...                                 worker_count=2, seed=0)
        >>> ops = fetch_operations(view, batch_size=64, fetch_factor=16,
        ...                        condition="drug")
    """

    def __init__(
        self,
        source,
        column: str,
        *,
        blocks_per_fetch: int,
        worker_count: int = 0,
        seed: int = 0,
        num_epochs: int | None = 1,
        shard_options: sharding.ShardOptions | None = None,
        weights: dict | None = None,
        epoch_groups: int | None = None,
        readahead_cells: int = 16384,
    ):
        """Creates the sampler.

        Args:
            source: The `AnnDataSource` (view) the loader reads, with `column`
                in its obs columns; best made by `condition_blocks`.
            column: The condition column.
            blocks_per_fetch: Blocks per fetch (`batch_size * fetch_factor /
                block_size`, `FetchConfig.blocks_per_fetch`).
            worker_count: 0 for `grain_cells.DataLoader` and `cell_dataset`
                (any worker count); a plain `grain.DataLoader`'s worker count
                (it stripes records over workers).
            seed: Seed in `[0, 2**63)`.
            num_epochs: Epochs, or None for an endless stream.
            shard_options: This process's shard.
            weights: Optional `{condition value: weight}`: draw conditions by
                weight, with replacement (see the design notes).
            epoch_groups: Slots per epoch with `weights` (default: the number
                of groups).
            readahead_cells: Hint the OS this many cells ahead (0: off).

        Raises:
            ValueError: An argument is out of range, or no weight is positive.
        """
        super().__init__(source, seed, num_epochs, shard_options, readahead_cells)
        num_blocks = self.num_blocks
        self._column = column
        self._g = check_int("blocks_per_fetch", blocks_per_fetch, minimum=1)
        self._worker_count = check_int("worker_count", worker_count, minimum=0)
        count = self.shard_options.shard_count
        self._lanes = count * max(1, self._worker_count)
        _, starts, _ = source.block_ranges(np.arange(num_blocks))
        codes = source.obs_values(column)[starts]
        labels = source.categories[column]
        conditions, self._block_condition = np.unique(codes, return_inverse=True)
        self._names = conditions if labels is None else np.asarray(labels)[conditions]
        self._weights = None
        self.epoch_length = num_blocks - num_blocks % count
        if weights is not None:
            w = np.array(
                [float(weights.get(n, weights.get(str(n), 0.0))) for n in self._names]
            )
            if (w < 0).any() or not (w > 0).any():
                raise ValueError(
                    f"weights must be >= 0 with one positive, got {weights!r} "
                    f"for conditions {self._names.tolist()}"
                )
            self._weights = w
            self._cdf = np.cumsum(w) / w.sum()
            self._static = self._groups((int(seed),))
            first = np.array([self._block_condition[g[0]] for g in self._static])
            self._by_condition = [np.flatnonzero(first == c) for c in range(w.size)]
            slots = epoch_groups or len(self._static)
            self.epoch_length = -(-slots * self._g // count) * count
        self._memo: tuple[int, np.ndarray] | None = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_memo"] = None
        return state

    @property
    def worker_count(self) -> int:
        """The worker striping the groups follow (0: consecutive positions)."""
        return self._worker_count

    @property
    def conditions(self) -> np.ndarray:
        """The condition values (labels for categorical columns)."""
        return self._names

    def _groups(self, words: tuple) -> list[np.ndarray]:
        """Each condition's blocks, shuffled by `words`, cut into groups of G."""
        blocks = np.arange(self._block_condition.size, dtype=np.int64)
        rank = counter_rng.hash64(*words, blocks)
        order = np.lexsort((rank, self._block_condition))
        cond = self._block_condition[order]
        bounds = np.flatnonzero(np.diff(cond)) + 1
        groups = []
        for run in np.split(order, bounds):
            groups += np.split(run, np.arange(self._g, run.size, self._g))
        return groups

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The blocks of epoch `epoch` in group order (before striping)."""
        if self._memo is not None and self._memo[0] == epoch:
            return self._memo[1]
        groups = self._groups((self.seed, epoch))
        # Slots of G blocks stay aligned with fetches: whole groups are slots;
        # the short groups (a condition's last) are packed together into
        # slots, one after another; the slots are shuffled, and a short last
        # slot goes last.
        rank = counter_rng.hash64(
            self.seed, epoch, _GROUP_WORD + np.arange(len(groups))
        )
        short = [groups[i] for i in np.argsort(rank) if groups[i].size < self._g]
        slots = [g for g in groups if g.size == self._g]
        if short:
            packed = np.concatenate(short)
            slots += np.split(packed, np.arange(self._g, packed.size, self._g))
        last = [slots.pop()] if slots and slots[-1].size < self._g else []
        order = np.argsort(
            counter_rng.hash64(
                self.seed, epoch, 2 * _GROUP_WORD + np.arange(len(slots))
            )
        )
        groups = [slots[i] for i in order] + last
        flat = np.concatenate(groups)[: self.epoch_length]
        self._memo = (epoch, flat)
        return flat

    def _slot_position(self, offset: int) -> int:
        """Where position `offset` of an epoch reads in the group sequence."""
        chunk = self._lanes * self._g
        full = self.epoch_length - self.epoch_length % chunk
        if offset >= full:
            return offset
        base, o = divmod(offset, chunk)
        lane, k = o % self._lanes, o // self._lanes
        return base * chunk + lane * self._g + k  # the lane's fetch in this chunk

    def _block(self, epoch: int, offset: int) -> int:
        slot = self._slot_position(offset)
        if self._weights is None:
            return int(self.epoch_order(epoch)[slot])
        s, t = divmod(slot, self._g)
        group = self._drawn_group(epoch, s)
        return int(group[t % group.size])

    def _drawn_group(self, epoch: int, slot: int) -> np.ndarray:
        w = self._weights
        u = counter_rng.uniform_int(self.seed, epoch, _DRAW_WORD + slot)
        c = min(int(np.searchsorted(self._cdf, u, side="right")), w.size - 1)
        while w[c] == 0:  # rounding at the top edge
            c -= 1
        ids = self._by_condition[c]
        v = counter_rng.uniform_int(self.seed, epoch, 2 * _DRAW_WORD + slot)
        return self._static[ids[int(v * ids.size)]]

    def fingerprint(self) -> dict:
        """What a checkpoint records: what decides the order, never the shard."""
        weights = epoch_length = None
        if self._weights is not None:
            digest = hashlib.sha256(self._weights.tobytes()).hexdigest()[:16]
            weights, epoch_length = f"sha256:{digest}", self.epoch_length
        return {
            "class": type(self).__name__,
            "num_blocks": self.num_blocks,
            "column": self._column,
            "blocks_per_fetch": self._g,
            "worker_count": self._worker_count,
            "seed": self.seed,
            "num_epochs": self.num_epochs,
            "weights": weights,
            "epoch_length": epoch_length,
        }

    def __repr__(self) -> str:
        items = {**self.fingerprint(), "column": repr(self._column)}
        tail = {k: items.pop(k) for k in ("weights", "epoch_length")}
        return self._repr(items, tail if tail["weights"] is not None else None)
