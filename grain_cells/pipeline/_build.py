"""Building a pipeline from arguments: `cell_dataset(...)` and `loader(...)`.

Both are thin: they build the `BlockSampler` and the fetch transform that
the explicit spellings take (`grain_cells.DataLoader(data_source=...,
sampler=BlockSampler(...), operations=fetch_operations(...))`), so their
minibatches, states and checkpoints are those of the explicit spelling with
the same arguments (tested), and a state saved by one restores in another.

**Defaults.** Given no `block_size` and no `fetch_factor`, every spelling
(`loader(paths)`, `loader(source)`, `grain_cells.DataLoader` or a plain
`grain.DataLoader` with `fetch_operations`, `cell_dataset`) reads the same
blocks and fetches, each decided in one place: the blocks by
`AnnDataSource(paths)` (`grain_cells.source._options.default_blocks`: the
grid of 16 cells, or blocks along the chunk grid of a compressed `.h5ad` or
zarr store), the fetch factor by `pipeline._config.default_fetch_factor`
from those blocks (16, or 64 blocks per fetch on the chunk grid)
(`tests/pipeline/test_one_default.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from grain import sharding

from grain_cells.blocks import split_by_fraction
from grain_cells.outputs import Output
from grain_cells.pipeline._config import make_split
from grain_cells.pipeline._dataset import CellDataset
from grain_cells.pipeline._grain_ops import fetch_operations
from grain_cells.pipeline._loader import DataLoader
from grain_cells.sampling import BlockSampler
from grain_cells.source import AnnDataSource


def cell_dataset(
    source: AnnDataSource,
    *,
    batch_size: int,
    fetch_factor: int | None = None,
    output=None,
    shuffle: bool = True,
    seed: int = 0,
    num_epochs: int | None = 1,
    shard_options: sharding.ShardOptions | None = None,
    remainder: str = "pad",
    readahead_cells: int = 16384,
    sampler=None,
    extra: dict | None = None,
    numeric_obs: str = "native",
    condition: str | None = None,
    worker_count: int = 0,
    worker_buffer_size: int = 1,
) -> CellDataset:
    """Shuffled minibatches of `source` as a Grain `IterDataset`.

    Args:
        source: The cells.
        batch_size: Cells per minibatch.
        fetch_factor: Minibatches per fetch; None as in `fetch_operations`.
        output: `CsrOutput()` (default), `PaddedSparseOutput(...)` or
            `DenseOutput()`.
        shuffle: Shuffle blocks per epoch and cells inside each fetch.
        seed: Seed of both shuffles.
        num_epochs: Sampler epochs per `iter()` (a loader epoch), or None
            for an endless stream (see "Epochs" in `CellDataset`).
        shard_options: This process's shard (e.g. `ShardByJaxProcess()`).
        remainder: `"pad"` or `"drop"` for a fetch's short last minibatch.
        readahead_cells: How far ahead the fetch stage asks the OS for blocks.
        sampler: A sampler over `source`'s blocks to use instead of a
            `BlockSampler` built from the arguments above (e.g. a
            `WeightedBlockSampler`); `shuffle`, `seed` (of the block order),
            `num_epochs` and `shard_options` then come from it.
        extra: More matrices per minibatch (`grain_cells.Layer`,
            `grain_cells.Obsm`), as in `fetch_operations`.
        numeric_obs: `"native"` or `"float32"`, as in `fetch_operations`.
        condition: One condition per minibatch, as in `fetch_operations`
            (pair with `grain_cells.ConditionBlockSampler(...,
            worker_count=0)`: fetches are consecutive positions of the shard).
        worker_count: Worker processes that read and format fetches (0: in
            this process). The minibatches are the same for every count.
        worker_buffer_size: Finished fetches each worker may hold ahead.

    Returns:
        A `CellDataset` (an `IterDataset`) of minibatch dicts (see
        `grain_cells.outputs`); each `iter()` starts the next epoch, and
        `len()` counts an epoch's minibatches (see "Epochs" in
        `CellDataset`). Do not add `.mp_prefetch` to it: pass
        `worker_count` (Grain refuses to slice it anyway).

    Example:
        >>> ds = cell_dataset(source, batch_size=64, num_epochs=None,
        ...                   worker_count=2)
        >>> it = iter(ds); batch = next(it); state = it.get_state()
    """
    if sampler is None:
        sampler = BlockSampler(
            len(source),
            shuffle=shuffle,
            seed=seed,
            num_epochs=num_epochs,
            shard_options=shard_options,
            readahead_cells=0,
        )
    split = make_split(
        source,
        batch_size=batch_size,
        fetch_factor=fetch_factor,
        output=output,
        shuffle=shuffle,
        seed=seed,
        remainder=remainder,
        extra=extra,
        numeric_obs=numeric_obs,
        condition=condition,
    )
    return CellDataset(
        source,
        sampler,
        split,
        worker_count=worker_count,
        worker_buffer_size=worker_buffer_size,
        shard_options=shard_options,
        readahead_cells=readahead_cells,
    )


def loader(
    paths_or_source,
    *,
    batch_size: int,
    obs_columns: Sequence[str] = (),
    output: Output | None = None,
    split: tuple[str, Mapping[str, float]] | None = None,
    worker_count: int = 0,
    seed: int = 0,
    num_epochs: int | None = 1,
    shuffle: bool = True,
    block_size: int | None = None,
    fetch_factor: int | None = None,
    remainder: str = "pad",
    shard_options: sharding.ShardOptions | None = None,
    extra: dict | None = None,
    worker_buffer_size: int = 16,
    **source_options,
) -> DataLoader:
    """Files to shuffled minibatches in one call: a `grain_cells.DataLoader`.

    The source is given once and the seed once; this builds what the
    explicit spelling takes (`AnnDataSource`, `BlockSampler(seed=seed)`,
    `fetch_operations(seed=seed)`), so the minibatches, the states and the
    orbax checkpoints are the same as theirs: the same for any
    `worker_count`, resumable, restorable under another worker or shard
    count. Each `iter()` starts the next epoch in a new order, `len()` is an
    epoch's minibatches and `close()` ends an iterator (see "Epochs" in
    `grain_cells.pipeline.CellDataset`).

    Args:
        paths_or_source: One `.h5ad` path or URL, a sequence of them, or an
            `AnnDataSource` (or view, e.g. of `split_by_obs`).
        batch_size: Cells per minibatch.
        obs_columns: obs columns returned with every cell (`obs/<column>`,
            categorical ones as codes: `DataLoader.obs_frame(batch)` gives
            labels). With a source, its own columns are used (others are
            refused).
        output: `CsrOutput()` (default), `PaddedSparseOutput(width)`,
            `DenseOutput()` or a token output.
        split: `(name, fractions)`, e.g. `("train", {"train": 0.9, "val":
            0.1})`: iterate that split of `split_by_fraction(source,
            fractions)` (seed 0, whole blocks), the same for every
            `seed`, so a run's seed never moves cells between splits. For
            other splits (by donor, by labels, another split seed) pass the
            view as `paths_or_source`.
        worker_count: Worker processes that read and format fetches (0: in
            this process); the minibatches do not depend on it.
        seed: Seed of the block order and of the in-fetch shuffle.
        num_epochs: Sampler epochs per `iter()`, or None for an endless
            stream.
        shuffle: Shuffle blocks per epoch and cells inside each fetch.
        block_size: Cells per block (contiguous read); with paths only.
            None: the blocks `AnnDataSource(paths)` chooses, as every
            spelling does: 16 cells on uncompressed files, blocks along the
            chunk grid of compressed `.h5ad` files and zarr stores.
        fetch_factor: Minibatches per fetch (read together and shuffled);
            None as in `fetch_operations` (16, or 64 blocks per fetch on
            blocks along a chunk grid).
        remainder: `"pad"` or `"drop"` for a fetch's short last minibatch.
        shard_options: This process's shard (e.g.
            `grain.sharding.ShardByJaxProcess()`).
        extra: More matrices per minibatch (`grain_cells.Layer`,
            `grain_cells.Obsm`), as in `fetch_operations`.
        worker_buffer_size: Minibatches each worker may hold ahead.
        **source_options: More `AnnDataSource` arguments (`layer`, `genes`,
            `join`, `genes_from`, `obs_missing`, `storage_options`, ...);
            with paths only.

    Returns:
        A `grain_cells.DataLoader`.

    Raises:
        ValueError: An argument is out of range, `split` is not
            `(name, fractions)` or names no split of `fractions`, or source
            arguments were given with a source.

    Example:
        >>> train = grain_cells.loader(paths, batch_size=64,
        ...     obs_columns=["cell_type"], split=("train", {"train": 0.9,
        ...     "val": 0.1}), worker_count=2, seed=0)
        >>> for epoch in range(3):
        ...     for batch in tqdm.tqdm(train):    # len(train) minibatches
        ...         ...
    """
    source = _source_of(paths_or_source, obs_columns, block_size, source_options)
    if split is not None:
        source = _split_of(source, split)
    sampler = BlockSampler(
        len(source),
        shuffle=shuffle,
        seed=seed,
        num_epochs=num_epochs,
        shard_options=shard_options,
    )
    operations = fetch_operations(
        source,
        batch_size=batch_size,
        fetch_factor=fetch_factor,
        output=output,
        shuffle=shuffle,
        seed=seed,
        remainder=remainder,
        extra=extra,
    )
    return DataLoader(
        data_source=source,
        sampler=sampler,
        operations=operations,
        worker_count=worker_count,
        worker_buffer_size=worker_buffer_size,
    )


def _source_of(paths_or_source, obs_columns, block_size, options) -> AnnDataSource:
    """The source: opened from paths, or given (then nothing else about it)."""
    if not isinstance(paths_or_source, AnnDataSource):
        # No block_size: the source's own default (`source._options`), so
        # `loader(paths)` reads the blocks `AnnDataSource(paths)` would.
        return AnnDataSource(
            paths_or_source, block_size=block_size, obs_columns=obs_columns, **options
        )
    source = paths_or_source
    given = dict(options)
    if block_size is not None and block_size != source.block_size:
        given["block_size"] = block_size
    if obs_columns and tuple(obs_columns) != source.obs_columns:
        given["obs_columns"] = list(obs_columns)
    if given:
        raise ValueError(
            f"loader: {sorted(given)} were given with an AnnDataSource, which "
            f"already fixes them (block_size={source.block_size}, obs_columns="
            f"{list(source.obs_columns)}); pass paths instead, or build the "
            "source with them"
        )
    return source


def _split_of(source: AnnDataSource, split) -> AnnDataSource:
    """The view `split = (name, fractions)` names."""
    ok = isinstance(split, tuple) and len(split) == 2
    if not ok or not isinstance(split[1], Mapping):
        raise ValueError(
            f"split must be (name, fractions), e.g. ('train', {{'train': 0.9, "
            f"'val': 0.1}}), got {split!r}"
        )
    name, fractions = split
    if name not in fractions:
        raise ValueError(
            f"split=({name!r}, ...) names no split of the fractions "
            f"{dict(fractions)}; choose one of {list(fractions)}"
        )
    return split_by_fraction(source, fractions)[name]
