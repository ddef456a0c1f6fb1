"""A plain `grain.DataLoader` over an `AnnDataSource` without `fetch_operations`.

Its records are `Block` descriptors (which cells a record holds), not
minibatches. Used as minibatches (indexed by a key such as `"X"`, by the
trainer or by an operation in a worker) they raise `NotAMinibatchError`,
which names the fix; with worker processes that error, not absl's
`UnparsedFlagAccessError`, reaches the trainer (issue 34).
"""

from __future__ import annotations

import grain
import pytest
from absl import flags
from conftest import close_iterator

import grain_cells
from grain_cells import errors


class ReadX(grain.transforms.Map):
    """A user's operation that expects minibatches (dicts of arrays)."""

    def map(self, element):
        return element["X"]


@pytest.fixture
def unparsed_flags():
    """A program that never parsed absl flags (as a script or notebook is)."""
    parsed = flags.FLAGS.is_parsed()
    flags.FLAGS.unparse_flags()
    yield
    if parsed and not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _loader(paths, operations, worker_count):
    source = grain_cells.AnnDataSource(paths, block_size=8)
    return grain.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=1),
        operations=operations,
        worker_count=worker_count,
    )


@pytest.mark.parametrize(
    "operations",
    [
        pytest.param(lambda: [], id="no-operations"),
        pytest.param(lambda: [grain.transforms.Batch(4)], id="batch"),
    ],
)
def test_blocks_used_as_minibatches_without_workers(csr_paths, operations):
    iterator = iter(_loader(csr_paths, operations(), 0))
    try:
        element = next(iterator)
        with pytest.raises(errors.NotAMinibatchError, match="fetch_operations"):
            element["X"]
    finally:
        close_iterator(iterator)


def test_an_operation_that_reads_a_block_as_a_minibatch(csr_paths):
    iterator = iter(_loader(csr_paths, [ReadX()], 0))
    try:
        with pytest.raises(errors.NotAMinibatchError, match=r"operations.*batch_size"):
            next(iterator)
    finally:
        close_iterator(iterator)


@pytest.mark.slow
def test_blocks_from_workers_used_as_minibatches(csr_paths, unparsed_flags):
    """With 2 workers: absl's UnparsedFlagAccessError used to come first."""
    iterator = iter(_loader(csr_paths, [grain.transforms.Batch(4)], 2))
    try:
        element = next(iterator)
        with pytest.raises(errors.NotAMinibatchError, match="fetch_operations"):
            element["X"]
    finally:
        close_iterator(iterator)


@pytest.mark.slow
def test_an_operation_in_a_worker_raises_in_the_trainer(csr_paths, unparsed_flags):
    iterator = iter(_loader(csr_paths, [ReadX()], 2))
    try:
        with pytest.raises(errors.NotAMinibatchError, match="fetch_operations"):
            next(iterator)
    finally:
        close_iterator(iterator)


def test_block_fields_still_index_by_position():
    block = grain_cells.source.Block(3, 1, 40, 56, 9)
    assert (block[0], block[-1], block[2:4], tuple(block)) == (
        3,
        9,
        (40, 56),
        (3, 1, 40, 56, 9),
    )
    assert block.start == 40
