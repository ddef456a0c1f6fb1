"""Several JAX processes: the mesh, the shardings, local values, logs."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def initialize(num_processes: int, process_id: int, coordinator_address: str) -> None:
    """Joins the other JAX processes of the run (nothing to do for one).

    Args:
        num_processes: Processes of the run.
        process_id: This process's index.
        coordinator_address: `host:port` of process 0's coordinator, or
            `"auto"` to let `jax.distributed.initialize()` detect the cluster
            (Cloud TPU, SLURM, Open MPI).

    Raises:
        ValueError: Several processes but no coordinator address.
    """
    if coordinator_address == "auto":
        jax.distributed.initialize()
    elif num_processes > 1:
        if not coordinator_address:
            raise ValueError(
                f"num_processes={num_processes} needs a coordinator_address "
                "(host:port of process 0, or 'auto')"
            )
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )


def make_mesh() -> jax.sharding.Mesh:
    """A one-axis (`"data"`) mesh over every device of every process."""
    return jax.make_mesh(
        (jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
    )


def replicated(mesh) -> NamedSharding:
    """The sharding of arrays every device holds whole (parameters)."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh) -> NamedSharding:
    """The sharding of minibatches: rows split over the `data` axis."""
    return NamedSharding(mesh, P("data"))


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a global minibatch entry, in order."""
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def local_value(x: jax.Array) -> np.ndarray:
    """This process's copy of a replicated array."""
    return np.asarray(x.addressable_data(0))


def log(message: str) -> None:
    """Prints a line, prefixed with the process in multi-process runs."""
    if jax.process_count() > 1:
        message = f"[process {jax.process_index()}/{jax.process_count()}] {message}"
    print(message, flush=True)
