"""The fetch transform's arguments, checked once for every spelling.

`make_split` is what `fetch_operations` (a plain `grain.DataLoader`),
`grain_cells.DataLoader` and `cell_dataset` all build their fetch transform
with: the same checks and messages whichever way a user came in.
"""

from __future__ import annotations

import warnings

from grain_cells._util import arguments
from grain_cells.outputs._formats import CsrOutput, Output
from grain_cells.pipeline._extra import check_output
from grain_cells.pipeline._fetch import FetchConfig, SplitFetch
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


def make_split(
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
) -> SplitFetch:
    """The fetch transform, its arguments checked (see `fetch_operations`).

    Raises:
        ValueError: An argument is out of range, or a fetch's cells are not a
            whole number of minibatches.
        TypeError: `output` is not an output format.
    """
    arguments.check_source(source, AnnDataSource)
    batch_size = arguments.check_int("batch_size", batch_size, minimum=1)
    fetch_factor = arguments.check_int("fetch_factor", fetch_factor, minimum=1)
    seed = arguments.check_seed(seed)
    arguments.check_choice("remainder", remainder, ("pad", "drop"))
    arguments.check_choice("numeric_obs", numeric_obs, ("native", "float32"))
    output = CsrOutput() if output is None else output
    check_output(output)
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
