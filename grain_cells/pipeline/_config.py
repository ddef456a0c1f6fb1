"""The fetch transform's arguments, checked once for every spelling.

`make_split` is what `fetch_operations` (a plain `grain.DataLoader`),
`grain_cells.DataLoader` and `cell_dataset` all build their fetch transform
with: the same checks and messages whichever way a user came in.
"""

from __future__ import annotations

import warnings

from grain_cells._util import arguments
from grain_cells.outputs._formats import CsrOutput, Output
from grain_cells.pipeline._fetch import FetchConfig, SplitFetch
from grain_cells.source import _chunk_grid as chunk_grid
from grain_cells.source._source import AnnDataSource


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


def default_fetch_factor(source: AnnDataSource, batch_size: int) -> int:
    """The fetch factor of a loader given none: 16, or per the source's blocks.

    A source built without a `block_size` over a compressed matrix has
    blocks along its chunk grid and asks for `source.fetch_blocks` blocks
    per fetch (`grain_cells.source._chunk_grid`): the least fetch factor
    that holds that many.
    """
    if source.fetch_blocks is None:
        return 16
    return chunk_grid.default_fetch_factor(
        batch_size, source.block_size, source.fetch_blocks
    )


def make_split(
    source: AnnDataSource,
    *,
    batch_size: int,
    fetch_factor: int | None = None,
    output: Output | None = None,
    shuffle: bool = True,
    seed: int = 0,
    remainder: str = "pad",
    extra: dict | None = None,
    numeric_obs: str = "native",
    condition: str | None = None,
) -> SplitFetch:
    """The fetch transform, its arguments checked (see `fetch_operations`).

    Raises:
        ValueError: An argument is out of range, or a fetch's cells are not a
            whole number of minibatches.
        TypeError: `output` is not an output format.
    """
    batch_size = arguments.check_int("batch_size", batch_size, minimum=1)
    if fetch_factor is None:
        fetch_factor = default_fetch_factor(source, batch_size)
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
    return SplitFetch(source, config, extra)
