"""Batched fetching (scDataset) as Grain operations.

`fetch_operations(source, batch_size=m, fetch_factor=f)` returns the two
operations that go after a `BlockSampler` in a `grain.DataLoader`:

1. `Batch(G)` groups `G = m * f / block_size` consecutive block records of
   each worker's stream into one *fetch*;
2. a `FlatMap` reads the fetch's blocks in one batched pass (one positional
   read per contiguous piece, into a reused buffer), shuffles its cells in
   memory, and emits the fetch as `ceil(cells / m)` minibatches of exactly
   `m` cells, each gathered once into its output format.

**Determinism.** The in-memory shuffle is seeded by `(seed, the fetch's block
ids in sampler order)`; a fetch is therefore re-created bit for bit when an
iterator is restored in its middle (Grain's FlatMap state is "the fetch's
parent state plus the index inside it").

**Which cells come out.** A fetch holds `G * block_size` cells, fewer when it
includes the short last block of a file or is a worker's last fetch of the
stream. Its last minibatch is then short: with `remainder="pad"` (default)
it is padded to `m` rows with `mask=False`, so every visited cell comes out
exactly once and shapes stay static; with `remainder="drop"` it is dropped
(those cells are not seen in that pass). Fetches may span an epoch boundary of
an endless stream, so an epoch's last cells share minibatches with the next
epoch's first ones rather than forming short minibatches.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import os
import warnings
import weakref

import grain
import numpy as np
import scipy.sparse as sp

from grain_cells import arguments, transport, worker_process
from grain_cells.main_guard import check_main_guard
from grain_cells.matrix import CsrRows, RowBuffer
from grain_cells.outputs import CsrOutput, DenseOutput, Output, PaddedSparseOutput
from grain_cells.source import AnnDataSource, FetchedRows


@dataclasses.dataclass(frozen=True)
class FetchConfig:
    """How a fetch is formed and split; its `repr` identifies a pipeline.

    Attributes:
        batch_size: Cells per minibatch (`m`).
        fetch_factor: Minibatches per fetch (`f`).
        block_size: Cells per block (from the source).
        shuffle: Shuffle cells inside a fetch.
        seed: Seed of that shuffle.
        remainder: `"pad"` or `"drop"` for a fetch's short last minibatch.
        output: The output format.
    """

    batch_size: int
    fetch_factor: int
    block_size: int
    shuffle: bool
    seed: int
    remainder: str
    output: Output

    @property
    def blocks_per_fetch(self) -> int:
        """Blocks read together (`G`)."""
        return max(1, self.batch_size * self.fetch_factor // self.block_size)

    @property
    def max_minibatches(self) -> int:
        """Most minibatches one fetch yields."""
        return math.ceil(self.blocks_per_fetch * self.block_size / self.batch_size)


def _group_blocks(blocks) -> np.ndarray:
    """Batch function: a fetch is an int64 array of (index, file, start, stop)."""
    return np.asarray(blocks, dtype=np.int64).reshape(-1, 4)


class _GroupBlocks:
    """Picklable batch function for `grain.transforms.Batch`."""

    def __call__(self, blocks):
        return _group_blocks(blocks)

    def __repr__(self) -> str:
        return "GroupBlocks()"


class SplitFetch(grain.experimental.FlatMapTransform):
    """Reads one fetch of blocks and splits it into shuffled minibatches."""

    def __init__(self, source: AnnDataSource, config: FetchConfig):
        """Binds the transform to its source and configuration."""
        self.source = source
        self.config = config
        self.max_fan_out = config.max_minibatches

    def __repr__(self) -> str:
        return f"SplitFetch({self.config!r})"

    def cell_order(self, blocks: np.ndarray, row_ids: np.ndarray) -> np.ndarray:
        """Positions into `row_ids` (sorted) of the fetch's cells, shuffled.

        A block that appears twice in one fetch (an endless stream's epoch
        boundary) contributes its cells twice.
        """
        starts, stops = blocks[:, 2], blocks[:, 3]
        lengths = stops - starts
        cells = np.arange(int(lengths.sum()), dtype=np.int64)
        cells += np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
        positions = np.searchsorted(row_ids, cells)
        if self.config.shuffle:
            rng = np.random.default_rng(
                np.concatenate([[self.config.seed], blocks[:, 0]]).astype(np.uint64)
            )
            positions = positions[rng.permutation(positions.size)]
        return positions

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_buffers", None)
        state.pop("_via_slots", None)
        state["_pickled_in"] = os.getpid()
        return state

    def __setstate__(self, state):
        pickled_in = state.pop("_pickled_in", None)
        self.__dict__.update(state)
        # Grain sends the pipeline to its worker processes pickled; unpickled
        # in such a child (not merely copied within one process), minibatches
        # go back to the parent pickled, so they travel as slot-ring handles
        # (see `transport`), and the worker exits with its parent.
        self._via_slots = (
            pickled_in != os.getpid() and worker_process.in_child_process()
        )
        if self._via_slots:
            worker_process.exit_with_parent()

    def _lend_buffer(self) -> tuple[RowBuffer, list]:
        """A read buffer no live fetch is using, and its owner cell.

        Fetches are formatted lazily from their buffer, and two iterators of
        one pipeline may be alive at once (or one restored while another
        runs), so a buffer is reused only once the fetch that filled it is gone.
        """
        pool = self.__dict__.setdefault("_buffers", [])
        for buffer, owner in pool:
            if owner[0] is None or owner[0]() is None:
                return buffer, owner
        entry = (RowBuffer(), [None])
        pool.append(entry)
        return entry

    def flat_map(self, blocks: np.ndarray) -> Minibatches:
        """Reads the fetch's blocks; returns its minibatches (built lazily)."""
        cfg = self.config
        unique = np.unique(blocks[:, 0], return_index=True)[1]
        read = blocks[np.sort(unique)]
        buffer, owner = self._lend_buffer()
        fetched = self.source.fetch_ranges(read[:, 2], read[:, 3], buffer)
        if fetched.csr is None and not isinstance(cfg.output, DenseOutput):
            fetched.csr = _dense_to_csr(fetched.dense)  # once per fetch
        order = self.cell_order(blocks, fetched.row_ids)
        n = order.size
        if cfg.remainder == "drop":
            n -= n % cfg.batch_size
        # In a worker process, outputs are pickled to the trainer: send them
        # through reusable shared-memory slots instead of fresh segments.
        via_slots = self.__dict__.get("_via_slots", False)
        batches = Minibatches(self, fetched, order[:n], via_slots)
        owner[0] = weakref.ref(batches)
        return batches

    def minibatch(self, fetched: FetchedRows, rows: np.ndarray) -> dict:
        """Formats one minibatch from rows of the fetch buffer."""
        cfg = self.config
        source = self.source
        m = cfg.batch_size
        n_real = rows.size
        if fetched.csr is None:  # dense file, dense output
            batch = cfg.output.format_dense(fetched.dense, rows, m)
        else:
            batch = cfg.output.format(fetched.csr, rows, n_real, m, source.num_genes)
        row_ids = np.full(m, -1, np.int64)
        row_ids[:n_real] = fetched.row_ids[rows]
        batch["row_ids"] = row_ids
        mask = np.zeros(m, bool)
        mask[:n_real] = True
        batch["mask"] = mask
        for name, values in fetched.obs.items():
            col = np.zeros(m, values.dtype if values.dtype.kind == "f" else np.int32)
            col[:n_real] = values[rows]
            batch[f"obs/{name}"] = col
        return batch


class Minibatches(collections.abc.Sequence):
    """The minibatches of one fetch, formatted when first asked for.

    Grain's FlatMap indexes the sequence in order, so only one minibatch is
    materialised at a time; the fetch buffer stays alive meanwhile.
    """

    def __init__(
        self,
        split: SplitFetch,
        fetched: FetchedRows,
        order: np.ndarray,
        via_slots: bool,
    ):
        self._split = split
        self._fetched = fetched
        self._order = order
        self._via_slots = via_slots

    def __len__(self) -> int:
        return -(-self._order.size // self._split.config.batch_size)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"minibatch {i} of a fetch of {len(self)}")
        i %= len(self)
        m = self._split.config.batch_size
        batch = self._split.minibatch(self._fetched, self._order[i * m : (i + 1) * m])
        if self._via_slots:
            # The fetch (materialised by Grain), the worker's queue (16 by
            # default) and what the trainer holds.
            return transport.worker_ring(2 * len(self) + 24).put(batch)
        return batch


def _dense_to_csr(dense: np.ndarray) -> CsrRows:
    m = sp.csr_matrix(dense)
    return CsrRows(m.data, m.indices, m.indptr.astype(np.int64), dense.shape[1])


def _warn_if_nothing_left(source: AnnDataSource, config: FetchConfig) -> None:
    """Warns when `remainder="drop"` leaves (almost) no minibatch per pass."""
    selected, blocks = source.num_selected_cells, len(source)
    per_fetch = min(config.blocks_per_fetch, blocks) * selected / blocks
    if per_fetch >= config.batch_size:
        return
    how = "no" if selected < config.batch_size else "almost no"
    warnings.warn(
        f"fetch_operations(batch_size={config.batch_size}, remainder='drop'): "
        f"a fetch holds about {per_fetch:.0f} cells ({len(source)} blocks of "
        f"{selected / blocks:.1f} cells on average, {selected} cells in all), "
        f"fewer than one minibatch, and drop discards them: a pass over the "
        f"source yields {how} minibatches. Use remainder='pad', a smaller "
        "batch_size or a larger fetch_factor.",
        stacklevel=3,
    )


def fetch_operations(
    source: AnnDataSource,
    *,
    batch_size: int,
    fetch_factor: int = 16,
    output: Output | None = None,
    shuffle: bool = True,
    seed: int = 0,
    remainder: str = "pad",
) -> list:
    """The operations that turn block records into shuffled minibatches.

    Args:
        source: The source the sampler walks.
        batch_size: Cells per minibatch (`m`).
        fetch_factor: Minibatches per fetch (`f`): `m * f / block_size` blocks
            are read together and their cells shuffled in memory.
        output: `CsrOutput()` (default), `PaddedSparseOutput(width)` or
            `DenseOutput()`.
        shuffle: Shuffle cells inside each fetch (turn off together with the
            sampler's shuffle for a sequential pass).
        seed: Seed of the in-fetch shuffle (use the sampler's).
        remainder: `"pad"` or `"drop"` for a fetch's short last minibatch.

    Returns:
        `[grain.transforms.Batch(...), SplitFetch(...)]` for
        `grain.DataLoader(operations=...)`.

    Raises:
        ValueError: An argument is out of range, or a fetch's cells are not a
            whole number of minibatches.
    """
    if worker_process.in_child_process():
        # A spawned worker importing a script whose top level builds the
        # pipeline: say so once, instead of workers dying one by one.
        check_main_guard("a grain_cells pipeline with worker processes")
    else:
        # Grain reads an absl flag when it starts worker processes (from
        # whichever spelling: grain.DataLoader, mp_prefetch).
        worker_process.allow_unparsed_flags()
    batch_size = arguments.check_int("batch_size", batch_size, minimum=1)
    fetch_factor = arguments.check_int("fetch_factor", fetch_factor, minimum=1)
    seed = arguments.check_seed(seed)
    if remainder not in ("pad", "drop"):
        raise ValueError(f"remainder must be 'pad' or 'drop', got {remainder!r}")
    output = output or CsrOutput()
    if not isinstance(output, (CsrOutput, PaddedSparseOutput, DenseOutput)):
        raise TypeError(
            f"output must be CsrOutput, PaddedSparseOutput or "
            f"DenseOutput, got {output!r}"
        )
    config = FetchConfig(
        batch_size,
        fetch_factor,
        source.block_size,
        bool(shuffle),
        int(seed),
        remainder,
        output,
    )
    cells = config.blocks_per_fetch * source.block_size
    if cells % batch_size:
        raise ValueError(
            f"a fetch of {config.blocks_per_fetch} blocks of {source.block_size} "
            f"cells holds {cells} cells, not a multiple of batch_size="
            f"{batch_size}; choose block_size and batch_size * fetch_factor so "
            "that one divides the other (e.g. powers of two)"
        )
    if remainder == "drop":
        _warn_if_nothing_left(source, config)
    return [
        grain.transforms.Batch(
            config.blocks_per_fetch, drop_remainder=False, batch_fn=_GroupBlocks()
        ),
        SplitFetch(source, config),
    ]
