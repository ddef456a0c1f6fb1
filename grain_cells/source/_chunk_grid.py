"""Blocks along a compressed matrix's chunk grid, and the defaults built on it.

In a compressed file the unit of decoding is a chunk, not a cell: blocks that
follow the chunk grid decode no chunk for a fraction of its cells. Each file's
chunk starts are cached by file identity. Design notes:
docs/reference/design.md#source-chunk-grid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os

import numpy as np

from grain_cells._util.cache_files import cache_root, write_atomic
from grain_cells.io import FileSet, OpenFiles
from grain_cells.source import _selection
from grain_cells.source._table import BlockTable

DEFAULT_BLOCKS_PER_FETCH = 64  # the uncompressed defaults: 16 x 16 / 16 at batch 64
# Most decoded bytes of one default fetch per process (4 chunks per block at
# anndata's largest chunks: 1 MiB of values + 1 MiB of indices).
FETCH_BUDGET_BYTES = 256 << 20
# Most cells of a default fetch: a worker formats a whole fetch into its ring
# of at most 128 shared-memory slots before the trainer can take any.
MAX_FETCH_CELLS = 120 * 64
MAX_BLOCK_CELLS = 1024  # a multiple of 64 (a minibatch)
_CHUNKS_PER_BLOCK = (4, 2, 1)  # tried in this order
_MARGIN = 1.25  # block_size over the cells of n average chunks
_CACHE_VERSION = "chunk-starts-v1"


@dataclasses.dataclass(frozen=True)
class ChunkDefaults:
    """The blocks of a source given no `block_size`.

    `chunks_per_block` chunks of `cells_per_chunk` cells on average (at most
    `block_size` cells), `chunk_bytes` decoded per chunk (values and indices).
    """

    chunks_per_block: int
    block_size: int
    cells_per_chunk: float
    chunk_bytes: int

    @property
    def fetch_blocks(self) -> int:
        """Blocks per default fetch: 64, fewer if 64 would pass MAX_FETCH_CELLS."""
        cells = min(self.chunks_per_block * self.cells_per_chunk, self.block_size)
        fits = int(MAX_FETCH_CELLS // max(cells, 1.0))
        return max(1, min(DEFAULT_BLOCKS_PER_FETCH, fits))


def compressed_defaults(
    n_cells: int, chunk_starts: np.ndarray, chunk_bytes: int
) -> ChunkDefaults:
    """The defaults for a matrix whose chunks begin at global rows `chunk_starts`.

    `chunk_bytes`: decoded bytes of one chunk of values plus one of indices.
    """
    per_chunk = n_cells / max(1, np.asarray(chunk_starts).size)
    n = next(
        (
            n
            for n in _CHUNKS_PER_BLOCK
            if DEFAULT_BLOCKS_PER_FETCH * n * chunk_bytes <= FETCH_BUDGET_BYTES
            and DEFAULT_BLOCKS_PER_FETCH * n * per_chunk <= MAX_FETCH_CELLS
        ),
        1,
    )
    block_size = max(16, 16 * math.ceil(_MARGIN * n * per_chunk / 16))
    block_size = min(block_size, MAX_BLOCK_CELLS)
    return ChunkDefaults(n, block_size, per_chunk, int(chunk_bytes))


def default_fetch_factor(
    batch_size: int, block_size: int, blocks: int = DEFAULT_BLOCKS_PER_FETCH
) -> int:
    """The least fetch factor whose fetch holds a whole number >= `blocks` of blocks."""
    step = block_size // math.gcd(block_size, batch_size)  # keeps it whole
    per_step = batch_size * step // block_size  # blocks per `step`
    return step * max(1, -(-blocks // per_step))


def chunk_aligned_blocks(
    table: BlockTable, chunk_starts: np.ndarray, chunks_per_block: int = 1
) -> BlockTable:
    """Blocks of `table`'s cells that follow the chunk grid.

    Cut at every `chunks_per_block`-th chunk start of each file, at gaps, at file
    boundaries and every `table.block_size` cells.
    """
    cuts = np.union1d(
        table.cell_offsets, _every_nth_chunk(chunk_starts, table, chunks_per_block)
    )
    if table.run_starts is None:  # every cell: the runs lie between cuts (no mask)
        return table.with_runs(cuts[:-1], cuts[1:])
    return table.with_runs(*_selection.runs_of_mask(table.cell_mask(), cuts))


def _every_nth_chunk(starts: np.ndarray, table: BlockTable, n: int) -> np.ndarray:
    """Every `n`-th chunk start of each file, counted from the file's first."""
    if n == 1:
        return starts
    offsets = np.asarray(table.cell_offsets, np.int64)
    files = np.searchsorted(offsets, starts, side="right") - 1
    first = np.searchsorted(starts, offsets[:-1], side="left")
    rank = np.arange(starts.size) - first[files]
    return starts[rank % n == 0]


def default_blocks(files: FileSet, options):
    """`(table, options)` of a source built without a `block_size`.

    Opens compressed files once more to find their chunk starts, unless cached.
    """
    sizes = files.records.column("chunk_bytes")
    if all(size is None for size in sizes):
        return BlockTable.grid(files.n_obs, 16), options
    offsets = np.concatenate([[0], np.cumsum(files.n_obs)])
    # Only the matrix is scanned: an open that reads no obs column.
    handles = OpenFiles(
        dataclasses.replace(files, obs_names=(), obs={}), 0, options.max_open_files
    )
    try:
        starts = [
            file_chunk_starts(files, handles, i) + offsets[i]
            if size is not None
            else offsets[i : i + 1]
            for i, size in enumerate(sizes)
        ]
    finally:
        handles.close()
    compressed = [i for i, size in enumerate(sizes) if size is not None]
    chosen = compressed_defaults(
        sum(files.n_obs[i] for i in compressed),
        np.concatenate([starts[i] for i in compressed]),
        max(sizes[i] for i in compressed),
    )
    grid = BlockTable.grid(files.n_obs, chosen.block_size)
    table = chunk_aligned_blocks(
        grid, np.unique(np.concatenate(starts)), chosen.chunks_per_block
    )
    return table, dataclasses.replace(options, fetch_blocks=chosen.fetch_blocks)


def cache_dir() -> str:
    """The folder of cached chunk starts (under the user's cache, never the data's)."""
    return os.path.join(cache_root(), "chunk-starts")


def file_chunk_starts(files: FileSet, handles: OpenFiles, i: int) -> np.ndarray:
    """Local rows where file `i`'s matrix chunks begin: cached, else scanned and kept.

    A sorted int64 array starting at 0, kept in `cache_dir()` by file identity.
    """
    identity, n_obs = files.identities[i], int(files.n_obs[i])
    key = [_CACHE_VERSION, identity.path, identity.element]
    key += [dataclasses.astuple(identity.stat), identity.layout, identity.sample]
    key.append(identity.format)
    name = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
    path = os.path.join(cache_dir(), name + ".npy")
    try:
        starts = np.load(path, allow_pickle=False)
        ok = starts.dtype == np.int64 and starts.ndim == 1 and starts.size > 0
        ok = ok and starts[0] == 0 and starts[-1] < max(n_obs, 1)
        if ok and (np.diff(starts) > 0).all():
            return starts
    except (OSError, ValueError):
        pass
    with handles.pinned([i]) as (f,):  # not evicted while it is scanned
        starts = np.asarray(f.reader.chunk_starts(), np.int64)
    with contextlib.suppress(OSError):  # a read-only or full cache: scan again
        write_atomic(path, lambda out: np.save(out, starts, allow_pickle=False))
    return starts
