"""When a view's blocks are fragmented, and what to tell the user about it."""

from __future__ import annotations

import numpy as np


def fragmented(lengths, block_size: int) -> bool:
    """Whether blocks hold on average less than half of `block_size` cells.

    `lengths`: the blocks' lengths, or their mean.
    """
    return block_size > 1 and 2 * float(np.mean(lengths)) < block_size


def fragment_note(lengths, block_size: int) -> str:
    """Says what fragmented blocks cost, and what to do about it.

    `lengths`: the blocks' lengths, or their mean.

    True for the usual case, an obs label interleaved with others within
    each donor or batch: a plain shuffled copy would scatter the selected
    cells further, a copy grouped by the label makes them one run.
    """
    mean = float(np.mean(lengths))
    return (
        f"the selection is fragmented: its blocks hold {mean:.1f} cells on "
        f"average, of block_size={block_size}, so each read is "
        f"{block_size / mean:.1f}x shorter than the block size allows and "
        "fetches hold fewer cells. When you select by an obs column whose "
        "labels are interleaved in the files (cell types within donors), write "
        "a copy grouped by it once, grain_cells.preshuffle(paths, out_dir, "
        "group_by=[column, ...]) (add the columns you split on, e.g. "
        "['cell_type', 'donor']): each label's cells are then one contiguous "
        "run (a plain shuffled copy scatters them further). Splits of this "
        "view are fragmented too and do not warn again."
    )


__all__ = ["fragment_note", "fragmented"]
