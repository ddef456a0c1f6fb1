"""`cell_dataset(...)` and `loader(...)`: the explicit spelling's pipeline.

Design notes: docs/reference/design.md#pipeline-build.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from grain_cells.blocks import split_by_fraction
from grain_cells.pipeline._config import (
    ALL,
    buffer_fetches,
    keywords,
    make_sampler,
    make_split,
    options_of,
)
from grain_cells.pipeline._dataset import CellDataset
from grain_cells.pipeline._loader import DataLoader
from grain_cells.source import AnnDataSource


@keywords(ALL, worker_buffer_size=1)
def cell_dataset(source: AnnDataSource, **options) -> CellDataset:
    """Shuffled minibatches of `source` as a Grain `IterDataset`.

    Args:
        source: The cells (an `AnnDataSource` or view).
        **options: The keywords of `grain_cells.pipeline.PipelineOptions`
            (`batch_size` required); `worker_buffer_size` counts fetches.

    Returns:
        A `CellDataset` (an `IterDataset`) of minibatch dicts (see
        `grain_cells.outputs`; epochs and `len()` as in "Epochs" of
        `grain_cells.pipeline.CellDataset`). Pass `worker_count` rather than
        adding `.mp_prefetch`.

    Raises:
        TypeError: A keyword it does not take, or one of the wrong type.
        ValueError: An argument is out of range.

    Example:
        >>> ds = cell_dataset(source, batch_size=64, num_epochs=None,
        ...                   worker_count=2)
        >>> it = iter(ds); batch = next(it); state = it.get_state()
    """
    opts, _ = options_of(cell_dataset, options)
    return _dataset(source, opts, make_split(source, opts), opts.worker_buffer_size)


@keywords(ALL, more="source_options", worker_buffer_size=16)
def loader(
    paths_or_source,
    *,
    obs_columns: Sequence[str] = (),
    split: tuple[str, Mapping[str, float]] | None = None,
    block_size: int | None = None,
    **options,
) -> DataLoader:
    """Files to shuffled minibatches in one call: a `grain_cells.DataLoader`.

    The minibatches, states and checkpoints are those of the explicit
    spelling with the same arguments (`AnnDataSource`, `BlockSampler`,
    `fetch_operations`).

    Args:
        paths_or_source: One `.h5ad` path or URL, a sequence of them, or an
            `AnnDataSource` (or view, e.g. of `split_by_obs`).
        obs_columns: obs columns returned with every cell (`obs/<column>`,
            categorical ones as codes: `DataLoader.obs_frame(batch)` gives
            labels). With a source, its own columns are used (others are
            refused).
        split: `(name, fractions)`, e.g. `("train", {"train": 0.9, "val":
            0.1})`: that split of `split_by_fraction(source, fractions)`
            (seed 0 whatever `seed`: a run's seed never moves cells between
            splits). For other splits pass the view as `paths_or_source`.
        block_size: Cells per block (contiguous read); with paths only.
            None: what `AnnDataSource(paths)` chooses (16 cells, or the
            chunk grid of compressed files and zarr stores).
        **options: The keywords of `grain_cells.pipeline.PipelineOptions`
            (`batch_size` required; `sampler` or `weights` choose the
            sampler); any other keyword is an `AnnDataSource` argument
            (`layer`, `genes`, `join`, `genes_from`, `obs_missing`,
            `storage_options`, ...), with paths only.

    Returns:
        A `grain_cells.DataLoader`.

    Raises:
        ValueError: An argument is out of range, `split` is not
            `(name, fractions)` or names no split of `fractions`, or source
            arguments were given with a source.
    """
    opts, source_options = options_of(loader, options)
    source = paths_or_source
    if not isinstance(source, AnnDataSource):
        source = AnnDataSource(
            source, block_size=block_size, obs_columns=obs_columns, **source_options
        )
    else:  # a source fixes its blocks and columns: nothing else about it
        given = dict(source_options)
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
    if split is not None:
        if not (isinstance(split, tuple) and len(split) == 2) or not isinstance(
            split[1], Mapping
        ):
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
        source = split_by_fraction(source, fractions)[name]
    fetch = make_split(source, opts)
    buffer = buffer_fetches(opts.worker_buffer_size, fetch.config)
    return DataLoader.of(_dataset(source, opts, fetch, buffer))


def _dataset(source, options, split, buffer: int) -> CellDataset:
    return CellDataset(
        source,
        make_sampler(source, options),
        split,
        worker_count=options.worker_count,
        worker_buffer_size=buffer,
        shard_options=options.shard_options,
        readahead_cells=options.readahead_cells,
    )
