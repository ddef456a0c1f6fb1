"""Checkpoints of a run and the per-process files it writes into its workdir.

A checkpoint holds the parameters, the optimiser state and the data
iterator's position together. The iterator goes through
`grain_cells.checkpoint` (Grain's file names and content), so a run restores
a checkpoint saved by another number of JAX processes: the rest of the data
stream is handed over (every remaining cell once), provided the per-process
batch (`batch_size / processes`) and the rest of the configuration are the
same.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from grain_cells.checkpoint import IteratorRestore, IteratorSave
from grain_cells.examples.train.distributed import local_rows, local_value, log


def manager(workdir: str, config: ml_collections.ConfigDict) -> ocp.CheckpointManager:
    """The orbax manager of `<workdir>/checkpoints`; saves are synchronous."""
    return ocp.CheckpointManager(
        os.path.join(workdir, "checkpoints"),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=config.max_checkpoints,
            # Synchronous: "checkpoint saved" means it is on disk.
            enable_async_checkpointing=False,
            # A save cut short by a kill leaves a temporary folder behind.
            cleanup_tmp_directories=True,
        ),
    )


def save(mngr: ocp.CheckpointManager, step: int, state, iterator) -> None:
    """Saves the train state and the iterator's position as step `step`.

    The iterator must report the position after `step` minibatches: a
    `grain_cells.feed` iterator does, however far it has read ahead.
    """
    mngr.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=IteratorSave(iterator),
        ),
    )
    mngr.wait_until_finished()
    log(f"checkpoint saved at step {step}")


def restore(mngr: ocp.CheckpointManager, state, iterator):
    """Restores the latest checkpoint into `state` and `iterator`, if any.

    Returns:
        The state, and the step restored (None when there is no checkpoint).
    """
    step = mngr.latest_step()
    if step is None:
        return state, None
    restored = mngr.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(state),
            data=IteratorRestore(iterator),
        ),
    )
    log(f"resumed from step {step}")
    return restored["state"], step


def close_iterator(iterator) -> None:
    """Closes a loader iterator (stops its workers), if it can be closed."""
    close = getattr(iterator, "close", None)
    if close is None:
        return
    # grain_cells' slot-ring transport can fail to close a worker whose
    # segment is already gone; the workers still exit with this process.
    with contextlib.suppress(FileNotFoundError):
        close()


def process_file(workdir: str, kind: str, suffix: str) -> str:
    """`<workdir>/<kind>/process_<i>-of-<n><suffix>`, its folder created."""
    folder = os.path.join(workdir, kind)
    os.makedirs(folder, exist_ok=True)
    name = f"process_{jax.process_index()}-of-{jax.process_count()}{suffix}"
    return os.path.join(folder, name)


def flat_params(params) -> dict[str, np.ndarray]:
    """This process's copy of the parameters, by path."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path): local_value(x) for path, x in leaves}


def params_hash(params) -> str:
    """SHA-1 of this process's copy of the parameters."""
    h = hashlib.sha1()
    for key, value in flat_params(params).items():
        h.update(key.encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def save_final_params(workdir: str, params) -> None:
    """Writes `final_params/process_<i>-of-<n>.npz`."""
    np.savez(process_file(workdir, "final_params", ".npz"), **flat_params(params))


class StepFiles:
    """The per-step test hooks: row ids and parameter hashes, appended."""

    def __init__(self, workdir: str, config: ml_collections.ConfigDict):
        """Opens the files the config asks for."""
        self._row_ids = self._params = None
        if config.dump_row_ids:
            self._row_ids = open(process_file(workdir, "row_ids", ".txt"), "a")  # noqa: SIM115
        if config.dump_params_hash:
            self._params = open(process_file(workdir, "params_hash", ".txt"), "a")  # noqa: SIM115

    def write(self, step: int, batch, state) -> None:
        """Records this process's real cells of `batch` and the state.

        `batch` holds global device arrays (`grain_cells.feed`); the row ids
        written are this process's rows of it.
        """
        if self._row_ids is not None:
            ids = local_rows(batch["row_ids"])[local_rows(batch["mask"])]
            self._row_ids.write(f"{step} {' '.join(map(str, ids))}\n")
            self._row_ids.flush()
        if self._params is not None:
            self._params.write(f"{step} {params_hash(state.params)}\n")
            self._params.flush()

    def close(self) -> None:
        """Closes the files."""
        for f in (self._row_ids, self._params):
            if f is not None:
                f.close()
