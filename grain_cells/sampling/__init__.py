"""Block samplers: shuffled, weighted, and one condition per minibatch."""

from grain_cells.sampling._conditions import ConditionBlockSampler, condition_blocks
from grain_cells.sampling._samplers import BlockSampler
from grain_cells.sampling._stream import BlockStream, check_sampler_fits
from grain_cells.sampling._weighted import WeightedBlockSampler

__all__ = [
    "BlockSampler",
    "BlockStream",
    "ConditionBlockSampler",
    "WeightedBlockSampler",
    "check_sampler_fits",
    "condition_blocks",
]
