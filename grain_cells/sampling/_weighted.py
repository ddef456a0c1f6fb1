"""`WeightedBlockSampler`: weighted and class-balanced draws of blocks.

Large cumulative weights reach workers as a mapped cache file. Design notes:
docs/reference/design.md#sampling-shared-table.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import pathlib

import numpy as np
from grain import sharding

from grain_cells._util import counter_rng
from grain_cells._util.arguments import check_int
from grain_cells._util.cache_files import cache_root, write_atomic
from grain_cells.sampling._stream import BlockStream
from grain_cells.source import AnnDataSource

SHARED_MIN_BYTES = 1 << 20  # smaller tables travel in the pickle
_STAMP = 40  # hex digits of the name, also written after the values


def _mapped(path, size: int, stamp: str) -> np.ndarray:
    """The whole entry named `stamp`, mapped read-only; else FileNotFoundError."""
    try:
        values = np.load(path, mmap_mode="r")
        with open(path, "rb") as fh:
            length = os.fstat(fh.fileno()).st_size
            fh.seek(max(length - _STAMP, 0))
            found = fh.read(_STAMP).decode("ascii", "replace")
    except FileNotFoundError:
        problem = "no such file"
    except (OSError, ValueError) as e:
        problem = f"unreadable ({e})"
    else:
        whole = length == values.offset + values.nbytes + _STAMP and found == stamp
        if values.shape == (size,) and values.dtype == np.dtype("<f8") and whole:
            return values
        problem = (
            f"shape {values.shape}, dtype {values.dtype}, {length} bytes ending in "
            f"{found!r}; expected ({size},) float64 and the stamp {stamp!r}"
        )
    raise FileNotFoundError(
        f"{path}: the weighted sampler's shared table (cumulative weights, "
        f"{size} blocks) is not whole: {problem}. It is written when the "
        "sampler is pickled for workers; the cache folder was emptied while "
        "workers started. Start the loader again, and leave the folder "
        "(weights/ under $GRAIN_CELLS_CACHE) alone while loaders start"
    )


def _share(values: np.ndarray, stamp: str) -> str | None:
    """The path of a cache entry of 1-D float64 `values` (None: cannot write one)."""
    path = pathlib.Path(cache_root(xdg=False)).expanduser() / "weights" / f"{stamp}.npy"
    with contextlib.suppress(FileNotFoundError):
        _mapped(path, values.size, stamp)
        return str(path)

    def write(fh) -> None:
        np.save(fh, np.ascontiguousarray(values, "<f8"))
        fh.write(stamp.encode())

    try:
        write_atomic(path, write)
    except OSError:
        return None
    return str(path)


class WeightedBlockSampler(BlockStream):
    """Draws blocks with replacement, with probability proportional to their weight.

    A Grain `Sampler` like `BlockSampler`: the block at a position is a pure
    function of `(seed, epoch, position)`, so a restored position repeats the
    stream. Blocks repeat, and a fetch may hold one twice (its cells then come
    out twice). Design notes: docs/reference/design.md#sampling-weighted.

    Example:
        >>> weights = grain_cells.balanced_block_weights(source, "cell_type")
        >>> sampler = WeightedBlockSampler(source, weights, epoch_cells=100_000,
        ...                                seed=0, num_epochs=None)
        >>> loader = grain_cells.DataLoader(
        ...     data_source=source, sampler=sampler,
        ...     operations=grain_cells.fetch_operations(source, batch_size=64))
    """

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
            epoch_blocks: Draws per epoch (default `num_blocks`), rounded up to
                a multiple of the shard count.
            epoch_cells: Cells per epoch, in expectation: `epoch_cells`
                divided by the expected cells per draw (exact when all blocks
                are full), rounded up. Exclusive with `epoch_blocks`.
            seed: Seed of the draws, in `[0, 2**63)`.
            num_epochs: Epochs in the stream, or None for an endless stream.
            shard_options: As in `BlockSampler`.
            readahead_cells: As in `BlockSampler`.

        Raises:
            ValueError: An argument is out of range (weights: one finite value
                >= 0 per block, not all 0; one epoch length at most).
        """
        super().__init__(
            source, seed, num_epochs, shard_options, readahead_cells, False
        )
        num_blocks = self.num_blocks
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
        if epoch_blocks is not None and epoch_cells is not None:
            raise ValueError(
                f"pass epoch_blocks or epoch_cells, not both (got epoch_blocks="
                f"{epoch_blocks}, epoch_cells={epoch_cells})"
            )
        if epoch_blocks is not None:
            check_int("epoch_blocks", epoch_blocks, minimum=1)
        if epoch_cells is not None:
            check_int("epoch_cells", epoch_cells, minimum=1)
        self._cdf = np.cumsum(w)
        self._total = float(self._cdf[-1])
        self._last_drawable = int(np.flatnonzero(w > 0)[-1])
        if epoch_cells is not None:
            if not isinstance(source, AnnDataSource):
                raise ValueError(
                    "epoch_cells needs the source (block lengths), not a block "
                    "count; pass the AnnDataSource or use epoch_blocks"
                )
            _, starts, stops = source.block_ranges(np.arange(num_blocks))
            per_draw = float(w @ (stops - starts)) / self._total
            draws = math.ceil(epoch_cells / per_draw)
        else:
            draws = num_blocks if epoch_blocks is None else int(epoch_blocks)
        count = self.shard_options.shard_count
        self.epoch_length = -(-draws // count) * count
        digest = hashlib.sha256(np.ascontiguousarray(w, "<f8")).hexdigest()
        self._weights_id = digest[:16]
        self._cdf_name = hashlib.sha256(f"cdf {digest}".encode()).hexdigest()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self._cdf.nbytes >= SHARED_MIN_BYTES:
            path = _share(self._cdf, self._cdf_name[:_STAMP])
            if path is not None:  # mapped by each worker, not pickled
                del state["_cdf"]
                state["_cdf_file"] = path
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        shared = self.__dict__.pop("_cdf_file", None)
        if shared is not None:
            self._cdf = _mapped(shared, self.num_blocks, self._cdf_name[:_STAMP])

    @property
    def probabilities(self) -> np.ndarray:
        """Probability of each block per draw."""
        return np.diff(self._cdf, prepend=0.0) / self._total

    def _block(self, epoch: int, offset: int) -> int:
        u = counter_rng.uniform_int(self.seed, epoch, offset)
        k = int(np.searchsorted(self._cdf, u * self._total, side="right"))
        return min(k, self._last_drawable)

    def _blocks(self, epochs: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        u = counter_rng.uniform(self.seed, epochs, offsets)
        k = np.searchsorted(self._cdf, u * self._total, side="right")
        return np.minimum(k, self._last_drawable).astype(np.int64)

    def fingerprint(self) -> dict:
        """What a checkpoint records: what decides the order, never the shard."""
        return {
            "class": type(self).__name__,
            "num_blocks": self.num_blocks,
            "weights": f"sha256:{self._weights_id}",
            "epoch_length": self.epoch_length,
            "seed": self.seed,
            "num_epochs": self.num_epochs,
        }
