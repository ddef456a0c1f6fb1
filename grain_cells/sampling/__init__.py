"""Block samplers: shuffled, weighted, and one condition per minibatch."""

from grain_cells.sampling._conditions import ConditionBlockSampler, condition_blocks
from grain_cells.sampling._samplers import BlockSampler
from grain_cells.sampling._weighted import WeightedBlockSampler

__all__ = [
    "BlockSampler",
    "ConditionBlockSampler",
    "WeightedBlockSampler",
    "condition_blocks",
]
