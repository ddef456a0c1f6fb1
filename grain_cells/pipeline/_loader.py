"""The entry points: `loader(...)`, `cell_dataset(...)` and `DataLoader`.

Design notes: docs/reference/design.md#pipeline-build and #pipeline-loader.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import numpy as np

from grain_cells._util.arguments import check_source
from grain_cells.blocks import split_by_fraction
from grain_cells.errors import CheckpointMismatchError
from grain_cells.pipeline._config import (
    ALL,
    buffer_fetches,
    keywords,
    make_sampler,
    make_split,
    options_of,
)
from grain_cells.pipeline._dataset import CellDataset, CellIterator
from grain_cells.pipeline._grain_ops import fetch_of
from grain_cells.source import AnnDataSource


@keywords(ALL, worker_buffer_size=1)
def cell_dataset(source: AnnDataSource, **options) -> CellDataset:
    """Shuffled minibatches of `source` as a Grain `IterDataset`.

    Args:
        source: The cells (an `AnnDataSource` or view).
        **options: The keywords of `grain_cells.pipeline.PipelineOptions`
            (`batch_size` required); `worker_buffer_size` counts fetches.

    Returns:
        A `CellDataset` (an `IterDataset`) of minibatch dicts; pass
        `worker_count` rather than adding `.mp_prefetch`.

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

    Minibatches, states and checkpoints are those of the explicit spelling
    (`AnnDataSource`, `BlockSampler`, `fetch_operations`) with these arguments.

    Args:
        paths_or_source: One `.h5ad` path or URL, a sequence of them, or an
            `AnnDataSource` (or view).
        obs_columns: obs columns returned with every cell (categorical ones
            as codes: `DataLoader.obs_frame(batch)` gives labels); with paths.
        split: `(name, fractions)`, e.g. `("train", {"train": 0.9, "val":
            0.1})`: that split of `split_by_fraction(source, fractions)`
            (seed 0 whatever `seed`).
        block_size: Cells per block, with paths only (None: the source's choice).
        **options: The keywords of `grain_cells.pipeline.PipelineOptions`
            (`batch_size` required); any other keyword is an `AnnDataSource`
            argument (`layer`, `genes`, `join`, ...), with paths only.

    Returns:
        A `grain_cells.DataLoader`.

    Raises:
        ValueError: `split` is not `(name, fractions)` or names no split of
            `fractions`, or source arguments were given with a source.
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


class DataLoader:
    """Shuffled minibatches with `grain.DataLoader`'s arguments.

    Its minibatches do not depend on `worker_count`, and its state (a
    position) restores under any worker or shard count.

    Example:
        >>> source = grain_cells.AnnDataSource(paths, obs_columns=["plate"])
        >>> loader = grain_cells.DataLoader(
        ...     data_source=source,
        ...     sampler=grain_cells.BlockSampler(len(source), seed=0),
        ...     operations=grain_cells.fetch_operations(source, batch_size=64),
        ...     worker_count=2)
        >>> for batch in loader: ...
    """

    def __init__(
        self,
        *,
        data_source,
        sampler,
        operations=(),
        worker_count=0,
        worker_buffer_size=16,
        shard_options=None,
        read_options=None,
        enable_profiling=False,
    ):
        """Same arguments as `grain.DataLoader` (`read_options` and
        `enable_profiling` accepted, unused).

        `data_source` is an `AnnDataSource` (or view), `sampler` walks its
        blocks (its `readahead_cells`: how far ahead the fetch stage hints),
        `operations` is `fetch_operations(...)` then optionally
        `grain.transforms.Map`s per minibatch; `worker_count` and
        `worker_buffer_size` as in `PipelineOptions`; `shard_options`
        defaults to the sampler's. `ValueError`: other `operations`, or a
        sampler over more blocks than the source has.
        """  # noqa: D205
        del read_options, enable_profiling
        check_source(data_source, AnnDataSource, "data_source")
        split, after = fetch_of(operations)
        self._dataset = CellDataset(
            data_source,
            sampler,
            split,
            worker_count=worker_count,
            worker_buffer_size=buffer_fetches(worker_buffer_size, split.config),
            shard_options=shard_options,
            readahead_cells=getattr(sampler, "readahead_cells", 16384),
            after=after,
        )

    @classmethod
    def of(cls, dataset: CellDataset) -> DataLoader:
        """The loader of a pipeline built otherwise (`grain_cells.loader`)."""
        loader = cls.__new__(cls)
        loader._dataset = dataset
        return loader

    @property
    def dataset(self) -> CellDataset:
        """The pipeline, as a Grain `IterDataset`."""
        return self._dataset

    @property
    def stamp(self) -> dict:
        """What a saved state must match to be restored by this loader."""
        return dict(self._dataset.stamp)

    @property
    def epoch(self) -> int:
        """The epoch the next `iter()` starts (see "Epochs and iterators")."""
        return self._dataset.epoch

    def set_epoch(self, epoch: int) -> None:
        """Makes the next `iter()` start epoch `epoch` (`CellDataset.set_epoch`)."""
        self._dataset.set_epoch(epoch)

    def __len__(self) -> int:
        """Minibatches of the next `iter()`'s epoch (`CellDataset.__len__`)."""
        return len(self._dataset)

    def obs_frame(self, batch: dict):
        """The obs columns of a minibatch's real cells, as a pandas DataFrame.

        Categorical columns (codes in the minibatch) become `pd.Categorical`
        labels of `source.categories[column]` (code -1: missing), numeric ones
        stay numbers. Padding rows (`mask` False) are left out; the index is
        the cells' global `row_ids`, in minibatch order.

        Example:
            >>> frame = loader.obs_frame(batch)
            >>> frame["cell_type"].value_counts()
        """
        import pandas as pd  # only where labels are asked for

        mask = np.asarray(batch["mask"], bool) if "mask" in batch else slice(None)
        columns = {}
        for column, labels in self._dataset.source.categories.items():
            if f"obs/{column}" not in batch:
                continue
            values = np.asarray(batch[f"obs/{column}"])[mask]
            if labels is not None:
                values = pd.Categorical.from_codes(values.astype(np.int64), labels)
            columns[column] = values
        index = batch.get("row_ids")
        if index is not None:
            index = pd.Index(np.asarray(index)[mask], name="row_id")
        return pd.DataFrame(columns, index=index)

    def __iter__(self) -> CheckedIterator:
        return CheckedIterator(iter(self._dataset))


class CheckedIterator:
    """A `DataLoader`'s iterator: a `CellIterator` whose states are JSON bytes."""

    def __init__(self, iterator: CellIterator):
        self._it = iterator

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._it, name)

    def __iter__(self) -> CheckedIterator:
        return self

    def __next__(self) -> dict:
        return next(self._it)

    def __len__(self) -> int:
        return len(self._it)

    def __bool__(self) -> bool:
        return True

    def get_state(self) -> bytes:
        return json.dumps(self._it.get_state(), indent=1).encode()

    def set_state(self, state: bytes) -> None:
        """Raises `CheckpointMismatchError` for bytes that are not JSON."""
        try:
            obj = json.loads(state)
        except (ValueError, TypeError) as e:
            raise CheckpointMismatchError(f"iterator state is not JSON: {e}") from e
        self._it.set_state(obj)

    def __enter__(self) -> CheckedIterator:
        return self

    def __exit__(self, *exc) -> None:
        self._it.close()
