"""Orbax checkpoints of a data iterator that restore on another process count.

`IteratorSave(iterator)` / `IteratorRestore(iterator)` take the place of Grain's
`CheckpointSave` / `CheckpointRestore` inside `ocp.args.Composite(...)` and write
the same `process_<i>-of-<P>.json` files. Restored on another process count, a
grain_cells pipeline's states are checked to be one lock-step save and handed
over: every remaining cell exactly once (docs/guides/checkpoints.md).

Example:
    >>> import orbax.checkpoint as ocp
    >>> from grain_cells.checkpoint import IteratorSave, IteratorRestore
    >>> manager.save(step, args=ocp.args.Composite(
    ...     state=ocp.args.StandardSave(train_state),
    ...     data=IteratorSave(iterator)))
    >>> # ... later, on any number of JAX processes:
    >>> manager.restore(step, args=ocp.args.Composite(
    ...     state=ocp.args.StandardRestore(train_state),
    ...     data=IteratorRestore(iterator)))
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import grain
import orbax.checkpoint as ocp
from etils import epath

from grain_cells.errors import CheckpointMismatchError
from grain_cells.pipeline import STAMP

__all__ = ["IteratorHandler", "IteratorRestore", "IteratorSave"]

_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")
# Position fields every old process's state must share for a hand-over.
_SHARED = ("origin", "count", "pieces", "step", "epoch")


def file_name(index: int, count: int) -> str:
    """The state file of process `index` of `count` (Grain's name)."""
    return f"process_{index}-of-{count}.json"


class IteratorHandler(ocp.CheckpointHandler):
    """Saves and restores a data iterator; restores on another process count.

    Args:
        process_index: This process; default `jax.process_index()`.
        process_count: Processes of the run; default `jax.process_count()`.
    """

    def __init__(
        self, *, process_index: int | None = None, process_count: int | None = None
    ):
        """Binds the process (default: JAX's)."""
        if (process_index is None) != (process_count is None):
            raise ValueError(
                "IteratorHandler takes process_index and process_count together, "
                f"got process_index={process_index}, process_count={process_count}"
            )
        if process_count is not None and not 0 <= process_index < process_count:
            raise ValueError(
                f"process_index must lie in [0, {process_count}), got {process_index}"
            )
        self._process = None
        if process_count is not None:
            self._process = (int(process_index), int(process_count))

    def process(self) -> tuple[int, int]:
        """(this process, processes of the run)."""
        if self._process is not None:
            return self._process
        import jax

        return jax.process_index(), jax.process_count()

    def save(self, directory, item=None, args: IteratorSave | None = None) -> None:
        """Writes this process's iterator state into `directory`."""
        item = item if item is not None else args.item
        state, as_dict = item.get_state(), isinstance(item, grain.DatasetIterator)
        text = json.dumps(state, indent=4) if as_dict else state.decode()
        (epath.Path(directory) / file_name(*self.process())).write_text(text)

    def restore(self, directory, item=None, args: IteratorRestore | None = None):
        """Sets the iterator to the state saved in `directory` (see module doc).

        Raises:
            CheckpointMismatchError: No state of this process count, and the
                saved ones cannot be handed over (the message names the
                folder and what differs); or the iterator refuses the state.
        """
        item = item if item is not None else args.item
        directory = epath.Path(directory)
        index, count = self.process()
        own = directory / file_name(index, count)
        # The same process count reads its own file, as Grain's handler does.
        text = own.read_text() if own.exists() else _hand_over_text(directory, count)
        as_dict = isinstance(item, grain.DatasetIterator)
        item.set_state(json.loads(text) if as_dict else text.encode())
        getattr(item, "start_prefetch", lambda: None)()  # workers start now
        return item

    def structure(self, directory) -> None:
        """No structure (as Grain's handler); no metadata: the state files are all."""
        del directory


def _saved_files(directory: epath.Path, count: int) -> tuple[int, list]:
    """The saved process count and its files, in process order."""
    found = {}
    for path in directory.glob("process_*-of-*.json"):
        match = _FILE.fullmatch(path.name)
        if match:
            found[(int(match[1]), int(match[2]))] = path
    counts = sorted({c for _, c in found})
    if not counts:
        raise CheckpointMismatchError(
            f"{directory}: no data iterator state in this checkpoint (expected "
            f"{file_name(0, count)}, or process_<i>-of-<n>.json of another "
            "process count)"
        )
    if len(counts) > 1:
        raise CheckpointMismatchError(
            f"{directory}: iterator states of several process counts {counts} "
            "(one save writes one count); remove the stray files"
        )
    (saved,) = counts
    missing = [file_name(i, saved) for i in range(saved) if (i, saved) not in found]
    if missing:
        raise CheckpointMismatchError(
            f"{directory}: saved by {saved} processes, but {', '.join(missing)} "
            f"missing; restoring on {count} processes needs every old process's "
            "state"
        )
    return saved, [found[(i, saved)] for i in range(saved)]


def _hand_over_text(directory: epath.Path, count: int) -> str:
    """One old process's state, once all of them are checked to agree."""
    saved, paths = _saved_files(directory, count)
    texts, states = [], []
    for path in paths:
        text = path.read_text()
        try:
            state = json.loads(text)
        except ValueError as e:
            raise CheckpointMismatchError(f"{path}: not a JSON state ({e})") from e
        if not isinstance(state, dict) or STAMP not in state:
            raise CheckpointMismatchError(
                f"{directory}: saved by {saved} processes, restoring on {count}: "
                f"{path.name} is not a grain_cells state (a plain Grain iterator's "
                f"state restores on {saved} processes only). Restore on {saved} "
                "processes, or use grain_cells.DataLoader / cell_dataset"
            )
        texts.append(text)
        states.append(state)
    first = states[0]
    for path, state in zip(paths[1:], states[1:], strict=True):
        diffs = []
        if state[STAMP] != first[STAMP]:
            diffs.append("pipeline (stamp)")
        pos, pos0 = state.get("position") or {}, first.get("position") or {}
        diffs += [
            f"{key}: {pos0.get(key)!r} in {paths[0].name}, {pos.get(key)!r} in "
            f"{path.name}"
            for key in _SHARED
            if pos.get(key) != pos0.get(key)
        ]
        if diffs:
            raise CheckpointMismatchError(
                f"{directory}: the {saved} saved iterator states are not one "
                f"lock-step save of one pipeline ({'; '.join(diffs)}), so they "
                f"cannot be handed over to {count} processes. Restore on {saved} "
                "processes, or from a checkpoint every process saved at the same "
                "step"
            )
    return texts[0]


@ocp.args.register_with_handler(IteratorHandler, for_save=True)
@dataclasses.dataclass
class IteratorSave(ocp.args.CheckpointArgs):
    """Saves `item`, a data iterator (see the module docstring)."""

    item: Any


@ocp.args.register_with_handler(IteratorHandler, for_restore=True)
@dataclasses.dataclass
class IteratorRestore(ocp.args.CheckpointArgs):
    """Restores into `item`, a data iterator, on any process count."""

    item: Any
