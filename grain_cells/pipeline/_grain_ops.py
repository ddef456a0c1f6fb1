"""`fetch_operations`: the adapter for a plain `grain.DataLoader`.

Design notes: docs/reference/design.md#pipeline-grain-ops.
"""

from __future__ import annotations

import os

import grain
import numpy as np

from grain_cells import transport
from grain_cells._util.arguments import ArgumentTypeError
from grain_cells.pipeline._config import FETCH, keywords, make_split, options_of
from grain_cells.pipeline._fetch import Minibatches, SplitFetch
from grain_cells.pipeline._stage import fetch_blocks
from grain_cells.source import AnnDataSource


class GroupBlocks:
    """Batch function: a fetch as rows of (block, file, start, stop, source id)."""

    def __call__(self, blocks) -> np.ndarray:
        return np.asarray(blocks, dtype=np.int64).reshape(len(blocks), -1)

    def __repr__(self) -> str:
        return "GroupBlocks()"


_UNGUARDED_SITE: tuple[str, int] | None = None


class GrainFetch(grain.experimental.FlatMapTransform):
    """A fetch of block records -> its minibatches (`split`'s), in Grain."""

    def __init__(self, split: SplitFetch):
        self.split = split
        self.max_fan_out = split.config.max_minibatches
        self._checked = False
        self._report = None  # this process's TruncationReport, made on first use

    @property
    def config(self):
        return self.split.config

    def __repr__(self) -> str:
        return repr(self.split)

    def __getstate__(self):
        global _UNGUARDED_SITE
        site = _UNGUARDED_SITE
        if site is None and not transport.in_child_process():
            site = transport.main_thread_site()
        if site is not None:  # workers would re-run the script's top level
            _UNGUARDED_SITE = site  # sticky: Grain pickles from several threads
            raise transport.main_guard_error(
                "grain.DataLoader(..., operations=fetch_operations(...)) with "
                "worker processes",
                site,
            ) from None
        state = self.__dict__.copy()
        state["_pickled_in"] = os.getpid()
        state["_report"] = None
        return state

    def __setstate__(self, state):
        pickled_in = state.pop("_pickled_in", None)
        self.__dict__.update(state)
        if pickled_in != os.getpid():  # unpickled in another process: a worker
            transport.worker_init()

    def flat_map(self, blocks: np.ndarray) -> Minibatches:
        if not self._checked and len(blocks):
            self._check_blocks(blocks)
        self._checked = True
        transport.fetch_starting()
        batches = self.split.read(blocks)
        if self._report is None:  # each process reports what it formats
            self._report = self.split.truncation_report()
        batches.report = self._report
        if transport.in_worker():  # each minibatch formatted into a slot
            ring = transport.ring_for(len(batches))
            batches.send = lambda format, i: transport.send(format, i, ring)
        return batches

    def _check_blocks(self, blocks: np.ndarray) -> None:
        source, keys = self.split.source, blocks[:, 0]
        if int(keys.max()) >= len(source):
            found = f"block {int(keys.max())}, past its {len(source)} blocks"
        elif blocks.shape[1] > 4 and np.any(blocks[:, 4] != source.source_id):
            found = "records of another source (Block.source_id differs)"
        elif np.array_equal(fetch_blocks(source, keys), blocks[:, :4]):
            return
        else:
            found = "blocks whose rows differ from its own"
        raise ValueError(
            f"fetch_operations(...) was built on {source!r}, but the loader's "
            f"data_source gave it {found}: data_source is another source or "
            "view (a split, a selection, other files). Build the sampler and "
            "fetch_operations from the source passed as data_source."
        )


@keywords(FETCH)
def fetch_operations(source: AnnDataSource, **options) -> list:
    """The operations that turn block records into shuffled minibatches.

    Args:
        source: The source the sampler walks (the loader's `data_source`).
        **options: The fetch keywords of `grain_cells.pipeline.PipelineOptions`
            (`batch_size` required); pass the sampler's `seed`.

    Returns:
        `[grain.transforms.Batch(...), GrainFetch(...)]` for
        `grain.DataLoader(operations=...)` (or `grain_cells.DataLoader`).

    Raises:
        ValueError: An argument is out of range, or a fetch's cells are not a
            whole number of minibatches. While iterating: the loader's
            `data_source` is another source or view than `source`.
    """
    opts, _ = options_of(fetch_operations, options)
    if transport.in_child_process():  # a worker running the script's top level
        transport.check_main_guard("a grain_cells pipeline with worker processes")
    else:
        transport.allow_unparsed_flags()  # Grain reads a flag to start workers
    split = make_split(source, opts)
    return [
        grain.transforms.Batch(
            split.config.blocks_per_fetch, drop_remainder=False, batch_fn=GroupBlocks()
        ),
        GrainFetch(split),
    ]


def fetch_of(operations) -> tuple[SplitFetch, tuple]:
    """The `SplitFetch` of `fetch_operations(...)` in `operations`, and the
    `Map`s after it; `TypeError`/`ValueError` for anything else.
    """  # noqa: D205
    if not isinstance(operations, (list, tuple)):
        raise ArgumentTypeError(
            "operations must be a list of transforms, "
            "grain_cells.fetch_operations(source, ...), got "
            f"operations={operations!r} ({type(operations).__name__})"
        )
    ops = list(operations)
    at = [i for i, op in enumerate(ops) if isinstance(op, GrainFetch)]
    before = ops[: at[0]] if len(at) == 1 else ()
    if len(before) != 1 or not isinstance(before[0], grain.transforms.Batch):
        raise ValueError(
            "grain_cells.DataLoader needs operations=grain_cells.fetch_operations("
            f"...) (a Batch and one fetch transform), got {ops!r}; for other "
            "operations use grain.DataLoader"
        )
    after = tuple(ops[at[0] + 1 :])
    for op in after:
        if not isinstance(op, grain.transforms.Map):
            raise ValueError(
                f"grain_cells.DataLoader runs operations after the fetch as "
                f"per-minibatch grain.transforms.Map only, got {op!r}"
            )
    return ops[at[0]].split, after
