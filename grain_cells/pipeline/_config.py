"""The pipeline's keywords, declared once (`PipelineOptions`), and bound to a source.

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
from grain_cells.outputs import CsrOutput, Output, declared
from grain_cells.pipeline._fetch import FetchConfig, SplitFetch
from grain_cells.sampling import BlockSampler, WeightedBlockSampler
from grain_cells.source import AnnDataSource
from grain_cells.source import default_fetch_factor as chunk_fetch_factor


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """The keywords of `loader`, `cell_dataset` and `fetch_operations`.

    `fetch_operations` takes `batch_size` to `condition`; the others take all.
    Each is checked by name (`batch_size=0`: `ValueError`).

    Attributes:
        batch_size: Cells per minibatch (`m`; required).
        fetch_factor: Minibatches per fetch (`f`): about `m * f` cells are
            read together and shuffled in memory. None: 16, or the chunk grid's.
        output: `CsrOutput()` (None), `PaddedSparseOutput(width)`,
            `DenseOutput()`, a token output, or any `grain_cells.Output`.
        shuffle: Shuffle blocks per epoch and cells inside each fetch (a plain
            `grain.DataLoader`: the fetch only; turn the sampler's off too).
        seed: Seed of the block order and the in-fetch shuffle, in `[0, 2**63)`
            (with `fetch_operations`: use the sampler's).
        remainder: `"pad"` (to `m` rows, `mask=False`) or `"drop"`, for a
            fetch's short last minibatch.
        extra: More matrices of the same cells, by output key:
            `grain_cells.Layer(name, output)` or `grain_cells.Obsm(name)`.
        numeric_obs: `"native"` (numeric obs keep a float dtype, integers
            come as int32) or `"float32"`.
        condition: An obs column: every minibatch holds cells of one value of
            it. Pair with `grain_cells.ConditionBlockSampler(..., worker_count=0)`.
        num_epochs: Sampler epochs per `iter()`, or None for an endless stream.
        shard_options: This process's shard (`grain.sharding.ShardByJaxProcess()`).
        sampler: A sampler over the source's blocks (or a function of the
            source returning one) instead of the shuffled `BlockSampler`;
            `shuffle`, `seed`, `num_epochs` and `shard_options` then its own.
        weights: One weight per block (or a function of the source returning
            them, e.g. `lambda s: grain_cells.balanced_block_weights(s, "cell_type")`):
            blocks are drawn with replacement by a `WeightedBlockSampler`.
        worker_count: Worker processes that read and format fetches (0: in this
            process). The minibatches are the same for every count.
        worker_buffer_size: What each worker holds ahead: minibatches for
            `loader`/`DataLoader` (16, rounded up to whole fetches), fetches
            for `cell_dataset` (1).
        readahead_cells: How far ahead the fetch stage asks the OS (or the
            object store) for blocks; 0 turns read-ahead off.
    """

    batch_size: int = field(metadata={"min": 1})
    fetch_factor: int | None = field(default=None, metadata={"min": 1})
    output: Output | None = None
    shuffle: bool = True
    seed: int = 0
    remainder: str = field(default="pad", metadata={"choices": ("pad", "drop")})
    extra: Mapping | None = None
    numeric_obs: str = field(
        default="native", metadata={"choices": ("native", "float32")}
    )
    condition: str | None = None
    num_epochs: int | None = field(default=1, metadata={"min": 1})
    shard_options: ShardOptions | None = None
    sampler: Any = None
    weights: Any = None
    worker_count: int = field(default=0, metadata={"min": 0})
    worker_buffer_size: int | None = field(default=None, metadata={"min": 1})
    readahead_cells: int = field(default=16384, metadata={"min": 0})

    def __post_init__(self):
        for f in dataclasses.fields(self):
            name, value, meta = f.name, getattr(self, f.name), f.metadata
            if value is None and "None" in f.type:
                continue
            if "min" in meta:
                value = arguments.check_int(name, value, minimum=meta["min"])
            elif "choices" in meta:
                value = arguments.check_choice(name, value, meta["choices"])
            elif name == "seed":
                value = arguments.check_seed(value, name)
            elif name == "output":
                value = declared(value, name)
            elif name == "extra":
                arguments.check_mapping(name, value)
            object.__setattr__(self, name, value)
        if self.sampler is not None and self.weights is not None:
            raise ValueError(
                "give sampler= or weights=, not both (weights build a "
                "WeightedBlockSampler; pass your own sampler with the weights "
                "in it instead)"
            )


_FIELDS = {f.name: f for f in dataclasses.fields(PipelineOptions)}
# The fetch keywords (what `fetch_operations` takes), and all of them.
FETCH = tuple(_FIELDS)[: tuple(_FIELDS).index("condition") + 1]
ALL = tuple(_FIELDS)


def keywords(names: tuple, more: str = "", **defaults):
    """Declares that an entry point takes the fields `names` (its `__signature__`);
    `more` names a `**` parameter for the entry point's own keywords.
    """  # noqa: D205

    def declare(entry):
        sig = inspect.signature(entry)
        params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        for name in names:
            f, kind = _FIELDS[name], inspect.Parameter.KEYWORD_ONLY
            default = defaults.get(name, f.default)
            if default is dataclasses.MISSING:
                default = inspect.Parameter.empty
            params.append(
                inspect.Parameter(name, kind, default=default, annotation=f.type)
            )
        if more:
            params.append(inspect.Parameter(more, inspect.Parameter.VAR_KEYWORD))
        entry.__signature__ = sig.replace(parameters=params)
        entry._keywords = (names, defaults, more)
        return entry

    return declare


def options_of(entry, given: dict) -> tuple[PipelineOptions, dict]:
    """The `PipelineOptions` an entry point was given, and its other keywords.

    Raises `TypeError` (a keyword it does not take, no `batch_size`) or `ValueError`.
    """
    names, defaults, more = entry._keywords
    others = {k: v for k, v in given.items() if k not in names}
    if others and not more:
        raise TypeError(
            f"{entry.__name__}() got an unexpected keyword argument "
            f"{next(iter(others))!r}; it takes {sorted(names)}"
        )
    if "batch_size" not in given:
        raise TypeError(
            f"{entry.__name__}() missing 1 required keyword-only argument: 'batch_size'"
        )
    taken = {k: v for k, v in given.items() if k in names}
    return PipelineOptions(**{**defaults, **taken}), others


# Most bytes a reading process (a worker, or the trainer's without workers)
# may hold for one fetch before `make_split` warns: see "A fetch's memory" in
# docs/guides/performance.md.
FETCH_MEMORY_BUDGET = 1 << 30


def fetch_bytes(source: AnnDataSource, cells: float) -> int:
    """Bytes a process holds for a fetch of `cells` cells: its decoded rows
    (mean stored values per cell, from file metadata, times a value's bytes
    and a 4-byte index if sparse) and as much again for its formatted minibatches.
    """  # noqa: D205
    column = source.files.records.column
    rows = column("n_obs")
    files = zip(rows, column("n_vars"), column("nnz"), strict=True)
    values = sum(n * v if z is None else z for n, v, z in files)
    per_value = source.dtype.itemsize + (4 if source.is_sparse else 0)
    return int(2 * cells * values / max(1, sum(rows)) * per_value)


def _warn_about_fetches(source: AnnDataSource, config: FetchConfig) -> None:
    """Warns when a fetch passes `FETCH_MEMORY_BUDGET`, or when
    `remainder="drop"` leaves (almost) no minibatch per pass.
    """  # noqa: D205
    selected, blocks = source.num_selected_cells, len(source)
    per_fetch = min(config.blocks_per_fetch, blocks) * selected / blocks
    size, factor = fetch_bytes(source, per_fetch), config.fetch_factor
    if size > FETCH_MEMORY_BUDGET:
        while factor > 1 and size * factor > FETCH_MEMORY_BUDGET * config.fetch_factor:
            factor //= 2
        warnings.warn(
            f"batch_size={config.batch_size}, fetch_factor={config.fetch_factor}: "
            f"each worker (or this process, without workers) holds about "
            f"{size / 2**30:.2f} GiB for a fetch of about {per_fetch:.0f} cells "
            f"(its decoded rows and its formatted minibatches), over the "
            f"{FETCH_MEMORY_BUDGET / 2**30:g} GiB budget per worker. Pass a "
            f"smaller fetch_factor (e.g. fetch_factor={factor}).",
            stacklevel=4,
        )
    if config.remainder != "drop" or per_fetch >= config.batch_size:
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


def default_fetch_factor(source: AnnDataSource, batch_size: int) -> int:
    """The fetch factor when none is given: 16, or the chunk grid's."""
    if source.fetch_blocks is None:
        return 16
    return chunk_fetch_factor(batch_size, source.block_size, source.fetch_blocks)


def _not_whole(block_size: int, batch_size: int, fetch_factor: int) -> str:
    """Why blocks of `block_size` cells make no fetch of whole minibatches."""
    step = block_size // math.gcd(block_size, batch_size)  # whole fetches
    lower, upper = fetch_factor // step * step, fetch_factor // step * step + step
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


def make_split(source: AnnDataSource, options: PipelineOptions) -> SplitFetch:
    """The fetch transform of `options` over `source`; warns of large fetches.

    Raises `TypeError` (not a source) or `ValueError` (`condition` is no obs
    column, or a fetch is not a whole number of minibatches).
    """
    arguments.check_source(source, AnnDataSource)
    if len(source) == 0:  # (a selection of no cell is refused where it is made)
        raise ValueError(
            f"{source!r} holds no cells: its files have no rows, so there is "
            "nothing to read. Check the paths (or the element read as X)."
        )
    o, size = options, source.block_size
    factor = o.fetch_factor or default_fetch_factor(source, o.batch_size)
    if o.condition is not None and o.condition not in source.obs_columns:
        raise ValueError(
            f"condition={o.condition!r} is not one of the source's obs_columns "
            f"{list(source.obs_columns)}; add it there"
        )
    same = ("batch_size", "seed", "remainder", "numeric_obs", "condition")
    config = FetchConfig(
        **{k: getattr(o, k) for k in same},
        shuffle=bool(o.shuffle),
        fetch_factor=factor,
        block_size=size,
        output=CsrOutput() if o.output is None else o.output,
    )
    if config.blocks_per_fetch * size % o.batch_size:
        if source.fetch_blocks is None:  # blocks of the user's block_size
            raise ValueError(_not_whole(size, o.batch_size, factor))
        # Chunk-grid blocks hold varying cells: a fetch takes enough blocks
        # for the cells asked, its last minibatch padded or dropped.
        config = dataclasses.replace(config, cover=True)
    _warn_about_fetches(source, config)
    return SplitFetch(source, config, o.extra)


def make_sampler(source: AnnDataSource, options: PipelineOptions):
    """The sampler of `options`: given, weighted, or a shuffled `BlockSampler`."""
    chosen, weights, o = options.sampler, options.weights, options
    if callable(chosen) and not hasattr(chosen, "__getitem__"):
        chosen = chosen(source)
    if chosen is not None:
        return chosen
    stream = dict(seed=o.seed, num_epochs=o.num_epochs, shard_options=o.shard_options)
    stream["readahead_cells"] = 0  # the fetch stage reads ahead
    if weights is None:
        return BlockSampler(len(source), shuffle=o.shuffle, **stream)
    weights = weights(source) if callable(weights) else weights
    return WeightedBlockSampler(source, weights, **stream)


def buffer_fetches(minibatches: int, config: FetchConfig) -> int:
    """Whole fetches that hold `minibatches` (`worker_buffer_size`) minibatches."""
    minibatches = arguments.check_int("worker_buffer_size", minibatches, minimum=1)
    return -(-minibatches // config.fetch_factor)
