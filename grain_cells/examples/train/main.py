"""Command line of the training example; see the package docstring.

Example::

    python -m grain_cells.examples.train --workdir=/tmp/run \
        --config.data=a.h5ad,b.h5ad --config.label=cell_type
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from absl import app, flags, logging
from ml_collections import config_flags

from grain_cells.examples.train import distributed, overhead, train

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "default.py")

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Checkpoints and outputs (required to train)."
)
_CONFIG = config_flags.DEFINE_config_file(
    "config",
    DEFAULT_CONFIG,
    "File with get_config() (default: the shipped configs/default.py); "
    "override keys with --config.KEY=VALUE.",
    lock_config=True,
)
_MEASURE = flags.DEFINE_bool(
    "measure_loader_overhead",
    False,
    "Time the step fed by the loader and by in-memory batches, then exit.",
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "JAX processes of the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "This process's index.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address",
    "",
    "host:port of process 0's coordinator; 'auto' lets "
    "jax.distributed.initialize() detect the cluster.",
)


def main(argv: Sequence[str]) -> None:
    """Joins the other JAX processes, then trains or measures."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO
        logging.set_verbosity(logging.WARNING)
    try:
        distributed.initialize(
            _NUM_PROCESSES.value, _PROCESS_ID.value, _COORDINATOR.value
        )
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    config = _CONFIG.value
    if _MEASURE.value:
        overhead.measure_loader_overhead(config)
        return
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required to train")
    try:
        train.check_config(config)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    train.train_and_evaluate(config, _WORKDIR.value)


if __name__ == "__main__":
    app.run(main)
