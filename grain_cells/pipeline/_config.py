"""The fetch transform's arguments, checked once for every spelling.

`make_split` is what `fetch_operations` (a plain `grain.DataLoader`),
`grain_cells.DataLoader` and `cell_dataset` all build their fetch transform
with: the same checks and messages whichever way a user came in, and the
same fetch factor when none is given (`default_fetch_factor`, the one place
that decides it).
`check_same_source` and `check_condition_sampler` check that transform and
the sampler against the data source a pipeline is given.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

from grain_cells._util import arguments
from grain_cells.outputs import CsrOutput, Output
from grain_cells.pipeline._extra import check_output
from grain_cells.pipeline._fetch import FetchConfig, SplitFetch
from grain_cells.sampling import ConditionBlockSampler
from grain_cells.source import AnnDataSource
from grain_cells.source import default_fetch_factor as chunk_fetch_factor


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
    """The fetch factor of a loader given none: 16, or per the source's blocks.

    A source built without a `block_size` over a compressed matrix has
    blocks along its chunk grid and asks for `source.fetch_blocks` blocks
    per fetch (`grain_cells.source._chunk_grid`): the least fetch factor
    that holds that many.
    """
    if source.fetch_blocks is None:
        return 16
    return chunk_fetch_factor(batch_size, source.block_size, source.fetch_blocks)


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
    arguments.check_source(source, AnnDataSource)
    batch_size = arguments.check_int("batch_size", batch_size, minimum=1)
    if fetch_factor is None:
        fetch_factor = default_fetch_factor(source, batch_size)
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
        if source.fetch_blocks is None:  # blocks of the user's block_size
            raise ValueError(_not_whole(source.block_size, batch_size, fetch_factor))
        # Blocks along a chunk grid (no block_size given) hold varying cells:
        # their fetches are never whole minibatches. The fetch takes enough
        # blocks for the cells asked; its last minibatch is padded or dropped.
        # (Only here: fetches that were whole blocks stay as they were.)
        config = dataclasses.replace(config, cover=True)
    if remainder == "drop":
        _warn_if_nothing_left(source, config)
    return SplitFetch(source, config, extra)


def check_same_source(split: SplitFetch, data_source) -> None:
    """Refuses fetch operations built on another source or view.

    The fetch transform reads through its own source; blocks of another view
    (a split, a selection) or of other files would be read from the wrong
    rows without a word.

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
