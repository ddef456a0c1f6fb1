"""The pipeline's keywords, declared once: `PipelineOptions`.

`keywords` declares which groups an entry point takes, `options_of` checks
them, `make_split` and `make_sampler` bind them to a source.

Design notes: docs/reference/design.md#pipeline-config.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections.abc import Mapping
from dataclasses import field
from typing import Any

from grain.sharding import ShardOptions

from grain_cells._util import arguments
from grain_cells.outputs import CsrOutput, Output
from grain_cells.pipeline._extra import check_output
from grain_cells.pipeline._fetch import FetchConfig, SplitFetch
from grain_cells.sampling import (
    BlockSampler,
    ConditionBlockSampler,
    WeightedBlockSampler,
)
from grain_cells.source import AnnDataSource
from grain_cells.source import default_fetch_factor as chunk_fetch_factor

# Groups of keywords: an entry point takes the fields of the groups it names.
FETCH, STREAM, WORKERS = "fetch", "stream", "workers"


def _meta(check=None, group=FETCH) -> dict:
    """A field's check `(name, value) -> value` and group."""
    return {"check": check, "group": group}


def _optional(check):
    return lambda name, value: None if value is None else check(name, value)


def _seed(name: str, value) -> int:
    return arguments.check_seed(value, name)


def _output(name: str, value):
    check_output(value, name)
    return value


def _int(minimum: int):
    return lambda name, value: arguments.check_int(name, value, minimum=minimum)


def _choice(*choices):
    return lambda name, value: arguments.check_choice(name, value, choices)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """The keywords of `loader`, `cell_dataset` and `fetch_operations`.

    Documented here once. `fetch_operations` takes the fetch keywords
    (`batch_size` to `condition`); `cell_dataset` and `loader` take them all
    (`loader` also takes the source's arguments). Each is checked when given,
    by name: `batch_size=0` raises `ValueError: batch_size must be a positive
    int, got batch_size=0`.

    Attributes:
        batch_size: Cells per minibatch (`m`; required).
        fetch_factor: Minibatches per fetch (`f`): `m * f / block_size`
            blocks are read together and their cells shuffled in memory (on
            blocks along a chunk grid, of varying size: enough blocks for
            `m * f` cells). None: 16, or enough for `source.fetch_blocks`
            blocks (a compressed source built without a `block_size`).
        output: `CsrOutput()` (None: the default), `PaddedSparseOutput(width)`,
            `DenseOutput()`, a token output (`grain_cells.tokens`), or any
            `grain_cells.Output`.
        shuffle: Shuffle blocks per epoch and cells inside each fetch (a
            plain `grain.DataLoader`: the fetch only; turn the sampler's
            off too for a sequential pass).
        seed: Seed of the block order and of the in-fetch shuffle, in
            `[0, 2**63)` (with `fetch_operations`: use the sampler's).
        remainder: `"pad"` (padded to `m` rows with `mask=False`) or
            `"drop"`, for a fetch's short last minibatch.
        extra: More matrices of the same cells per minibatch, by output key:
            `grain_cells.Layer(name, output)` (a layer, `"raw"` for `raw/X`)
            or `grain_cells.Obsm(name)` (see `grain_cells.pipeline._extra`).
        numeric_obs: `"native"` (numeric obs columns keep a float dtype,
            integers come as int32) or `"float32"` (every numeric column as
            float32, beside the int32 codes of categorical ones).
        condition: An obs column of the source: every minibatch then holds
            cells of one value of it (each condition's cells of a fetch are
            cut into minibatches, the last one short and padded). Pair with
            `grain_cells.ConditionBlockSampler(..., worker_count=0)`.
        num_epochs: Sampler epochs per `iter()` (a loader epoch), or None
            for an endless stream (see "Epochs" in `CellDataset`).
        shard_options: This process's shard (e.g.
            `grain.sharding.ShardByJaxProcess()`).
        sampler: A sampler over the source's blocks (e.g. a
            `WeightedBlockSampler`), or a function of the source (the view
            `split` selects) that returns one, instead of the shuffled
            `BlockSampler`; `shuffle` (of the blocks), `seed` (of the block
            order), `num_epochs` and `shard_options` then come from it.
        weights: One weight per block of the source (the view `split`
            selects), or a function of it that returns them (e.g. `lambda s:
            grain_cells.balanced_block_weights(s, "cell_type")`): blocks are
            drawn with replacement by a `WeightedBlockSampler(source,
            weights, seed=seed, num_epochs=num_epochs, ...)`.
        worker_count: Worker processes that read and format fetches (0: in
            this process). The minibatches are the same for every count.
        worker_buffer_size: What each worker may hold ahead: minibatches for
            `loader` and `grain_cells.DataLoader` (default 16, rounded up to
            whole fetches), fetches for `cell_dataset` (default 1).
        readahead_cells: How far ahead the fetch stage asks the OS (or the
            object store) for blocks; 0 turns read-ahead off.
    """

    batch_size: int = field(metadata=_meta(_int(1)))
    fetch_factor: int | None = field(default=None, metadata=_meta(_optional(_int(1))))
    output: Output | None = field(default=None, metadata=_meta(_optional(_output)))
    shuffle: bool = True
    seed: int = field(default=0, metadata=_meta(_seed))
    remainder: str = field(default="pad", metadata=_meta(_choice("pad", "drop")))
    extra: Mapping | None = field(default=None, metadata=_meta(arguments.check_mapping))
    numeric_obs: str = field(
        default="native", metadata=_meta(_choice("native", "float32"))
    )
    condition: str | None = None
    num_epochs: int | None = field(
        default=1, metadata=_meta(_optional(_int(1)), STREAM)
    )
    shard_options: ShardOptions | None = field(
        default=None, metadata=_meta(group=STREAM)
    )
    sampler: Any = field(default=None, metadata=_meta(group=STREAM))
    weights: Any = field(default=None, metadata=_meta(group=STREAM))
    worker_count: int = field(default=0, metadata=_meta(_int(0), WORKERS))
    worker_buffer_size: int | None = field(
        default=None, metadata=_meta(_optional(_int(1)), WORKERS)
    )
    readahead_cells: int = field(default=16384, metadata=_meta(_int(0), WORKERS))

    def __post_init__(self):
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            if check is not None:
                object.__setattr__(self, f.name, check(f.name, getattr(self, f.name)))
        if self.sampler is not None and self.weights is not None:
            raise ValueError(
                "give sampler= or weights=, not both (weights build a "
                "WeightedBlockSampler; pass your own sampler with the weights "
                "in it instead)"
            )


def keywords(*groups: str, more: str = "", **defaults):
    """Declares that an entry point takes the `PipelineOptions` of `groups`.

    Sets its `__signature__` (what `help()` shows) with their defaults
    (`defaults` override the dataclass's); with `more`, other keywords are left
    to the entry point.
    """

    def declare(entry):
        sig = inspect.signature(entry)
        params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        rest = [inspect.Parameter(more, inspect.Parameter.VAR_KEYWORD)] if more else []
        for f in dataclasses.fields(PipelineOptions):
            if _group(f) in groups:
                default = defaults.get(f.name, f.default)
                params.append(
                    inspect.Parameter(
                        f.name,
                        inspect.Parameter.KEYWORD_ONLY,
                        default=inspect.Parameter.empty
                        if default is dataclasses.MISSING
                        else default,
                        annotation=f.type,
                    )
                )
        entry.__signature__ = sig.replace(parameters=params + rest)
        entry._keywords = (groups, defaults, more)
        return entry

    return declare


def _group(f: dataclasses.Field) -> str:
    return f.metadata.get("group", FETCH)


def options_of(entry, given: dict) -> tuple[PipelineOptions, dict]:
    """The `PipelineOptions` an entry point was given, and its other keywords.

    Raises:
        TypeError: A keyword the entry point does not take (without `more`),
            or `batch_size` is missing.
        ValueError: A value is out of range (named, as in `PipelineOptions`).
    """
    groups, defaults, more = entry._keywords
    fields = dataclasses.fields(PipelineOptions)
    names = {f.name for f in fields if _group(f) in groups}
    taken = {k: given[k] for k in given if k in names}
    others = {k: v for k, v in given.items() if k not in names}
    if others and not more:
        raise TypeError(
            f"{entry.__name__}() got an unexpected keyword argument "
            f"{next(iter(others))!r}; it takes {sorted(names)}"
        )
    if "batch_size" not in taken:
        raise TypeError(
            f"{entry.__name__}() missing 1 required keyword-only argument: 'batch_size'"
        )
    return PipelineOptions(**{**defaults, **taken}), others


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
        stacklevel=4,
    )


def _not_whole(block_size: int, batch_size: int, fetch_factor: int) -> str:
    """Why blocks of `block_size` cells make no fetch of whole minibatches."""
    step = block_size // math.gcd(block_size, batch_size)  # whole fetches
    lower = fetch_factor // step * step
    upper = lower + step
    values = f"fetch_factor={lower} or {upper}" if lower else f"fetch_factor={upper}"
    blocks = -(-batch_size * fetch_factor // block_size)
    return (
        f"batch_size={batch_size}, fetch_factor={fetch_factor}: a fetch of "
        f"{blocks} blocks of block_size={block_size} cells holds "
        f"{blocks * block_size} cells, not a whole number of minibatches. Pass "
        f"{values} (a multiple of {step}: whole blocks and whole minibatches), "
        "or a block_size that divides batch_size * fetch_factor (e.g. powers "
        "of two)"
    )


def default_fetch_factor(source: AnnDataSource, batch_size: int) -> int:
    """The fetch factor given none: 16, or enough for `source.fetch_blocks` blocks.

    (A compressed source built without `block_size` has chunk-grid blocks.)
    """
    if source.fetch_blocks is None:
        return 16
    return chunk_fetch_factor(batch_size, source.block_size, source.fetch_blocks)


def make_split(source: AnnDataSource, options: PipelineOptions) -> SplitFetch:
    """The fetch transform of `options` over `source`.

    Raises:
        TypeError: `source` is not an `AnnDataSource`.
        ValueError: `condition` is no obs column of the source, or a fetch's
            cells are not a whole number of minibatches.
    """
    arguments.check_source(source, AnnDataSource)
    batch_size, fetch_factor = options.batch_size, options.fetch_factor
    if fetch_factor is None:
        fetch_factor = default_fetch_factor(source, batch_size)
    condition = options.condition
    if condition is not None and condition not in source.obs_columns:
        raise ValueError(
            f"condition={condition!r} is not one of the source's obs_columns "
            f"{list(source.obs_columns)}; add it there"
        )
    config = FetchConfig(
        batch_size,
        fetch_factor,
        source.block_size,
        bool(options.shuffle),
        options.seed,
        options.remainder,
        CsrOutput() if options.output is None else options.output,
        options.numeric_obs,
        condition,
    )
    if config.blocks_per_fetch * source.block_size % batch_size:
        if source.fetch_blocks is None:  # blocks of the user's block_size
            raise ValueError(_not_whole(source.block_size, batch_size, fetch_factor))
        # Blocks along a chunk grid (no block_size given) hold varying cells:
        # their fetches are never whole minibatches. The fetch takes enough
        # blocks for the cells asked; its last minibatch is padded or dropped.
        # (Only here: fetches that were whole blocks stay as they were.)
        config = dataclasses.replace(config, cover=True)
    if options.remainder == "drop":
        _warn_if_nothing_left(source, config)
    return SplitFetch(source, config, options.extra)


def make_sampler(source: AnnDataSource, options: PipelineOptions):
    """The sampler of `options`: given, weighted, or a shuffled `BlockSampler`."""
    chosen = options.sampler
    if callable(chosen) and not hasattr(chosen, "__getitem__"):
        chosen = chosen(source)
    if chosen is not None:
        return chosen
    stream = {
        "seed": options.seed,
        "num_epochs": options.num_epochs,
        "shard_options": options.shard_options,
        "readahead_cells": 0,  # the fetch stage reads ahead
    }
    weights = options.weights
    if weights is None:
        return BlockSampler(len(source), shuffle=options.shuffle, **stream)
    if callable(weights):
        weights = weights(source)
    return WeightedBlockSampler(source, weights, **stream)


def buffer_fetches(minibatches: int, config: FetchConfig) -> int:
    """Whole fetches that hold `minibatches` minibatches (at least 1)."""
    return max(1, -(-int(minibatches) // config.fetch_factor))


def check_same_source(split: SplitFetch, data_source) -> None:
    """Refuses fetch operations built on another source or view.

    Blocks of another view or files would be read from the wrong rows silently.

    Raises:
        ValueError: `split.source` is not `data_source` (nor an equal one).
    """
    made = split.source
    if made is data_source or repr(made) == repr(data_source):
        return
    raise ValueError(
        "the fetch operations were built on another source than data_source: "
        f"fetch_operations(...) reads {made!r}, but data_source is "
        f"{data_source!r}. Build the sampler and fetch_operations from the "
        "source (or split view) passed as data_source."
    )


def check_condition_sampler(sampler) -> None:
    """Refuses a `ConditionBlockSampler` striped for a plain grain.DataLoader.

    Raises:
        ValueError: The sampler's `worker_count` is not 0.
    """
    if isinstance(sampler, ConditionBlockSampler) and sampler.worker_count:
        raise ValueError(
            f"ConditionBlockSampler(worker_count={sampler.worker_count}) stripes "
            "its groups for a plain grain.DataLoader's workers; "
            "grain_cells.DataLoader and cell_dataset form each fetch from "
            "consecutive positions whatever their worker_count, so build the "
            "sampler with worker_count=0 (its fetches then hold one condition "
            "each)"
        )
