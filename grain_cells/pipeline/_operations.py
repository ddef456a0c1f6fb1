"""`fetch_operations`: the batched fetch as operations for `grain.DataLoader`.

Returns `[grain.transforms.Batch(G), SplitFetch(...)]` (see
`grain_cells.pipeline._fetch` for what a fetch is). `grain_cells.DataLoader`
and `cell_dataset` take the same arguments and use only the `SplitFetch`
(their fetch stage forms fetches itself, worker-independently:
`grain_cells.pipeline._stage`).
"""

from __future__ import annotations

import warnings

import grain

from grain_cells._util import arguments
from grain_cells.outputs._formats import CsrOutput, Output
from grain_cells.pipeline._fetch import FetchConfig, SplitFetch, _GroupBlocks
from grain_cells.source._source import AnnDataSource
from grain_cells.transport import _worker as worker_process
from grain_cells.transport._main_guard import check_main_guard


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
    extra: dict | None = None,
    numeric_obs: str = "native",
    condition: str | None = None,
) -> list:
    """The operations that turn block records into shuffled minibatches.

    Args:
        source: The source the sampler walks.
        batch_size: Cells per minibatch (`m`).
        fetch_factor: Minibatches per fetch (`f`): `m * f / block_size` blocks
            are read together and their cells shuffled in memory.
        output: `CsrOutput()` (default), `PaddedSparseOutput(width)`,
            `DenseOutput()`, a token output (`grain_cells.tokens.RankValueTokens`,
            `ValueBinTokens`), or any `grain_cells.Output`.
        shuffle: Shuffle cells inside each fetch (turn off together with the
            sampler's shuffle for a sequential pass).
        seed: Seed of the in-fetch shuffle (use the sampler's).
        remainder: `"pad"` or `"drop"` for a fetch's short last minibatch.
        extra: More matrices of the same cells per minibatch, by output key:
            `grain_cells.Layer(name, output)` (a layer, `"raw"` for `raw/X`)
            or `grain_cells.Obsm(name)` (see `grain_cells.pipeline._extra`).
        numeric_obs: `"native"` (numeric obs columns keep a float dtype,
            integers come as int32) or `"float32"` (every numeric column as
            float32, beside the int32 codes of categorical ones).
        condition: An obs column of the source: every minibatch then holds
            cells of one value of it (each condition's cells of a fetch are
            cut into minibatches, the last one short and padded). Pair with
            `grain_cells.ConditionBlockSampler`; see `grain_cells.sampling._conditions`.

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
    if numeric_obs not in ("native", "float32"):
        raise ValueError(
            f"numeric_obs must be 'native' or 'float32', got {numeric_obs!r}"
        )
    output = output or CsrOutput()
    if not isinstance(output, Output) or isinstance(output, (str, bytes)):
        raise TypeError(
            f"output must be an output format (CsrOutput, PaddedSparseOutput, "
            f"DenseOutput, RankValueTokens, ValueBinTokens or any object with "
            f"format(fetch, rows, batch_size)), got {output!r}"
        )
    config = FetchConfig(
        batch_size,
        fetch_factor,
        source.block_size,
        bool(shuffle),
        int(seed),
        remainder,
        output,
        numeric_obs,
        condition,
    )
    if condition is not None and condition not in source.obs_columns:
        raise ValueError(
            f"condition={condition!r} is not one of the source's obs_columns "
            f"{list(source.obs_columns)}; add it there"
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
        SplitFetch(source, config, extra),
    ]
