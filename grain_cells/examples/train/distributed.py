"""Several JAX processes: the mesh, global minibatches, device prefetch, logs."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Mapping

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


def global_batch(batch: Mapping[str, np.ndarray], keys, mesh) -> dict:
    """This process's minibatch as its rows of a global one over the mesh.

    The host-to-device copies start at once and run asynchronously.
    """
    sharding = NamedSharding(mesh, P("data"))
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(batch[k]))
        for k in keys
    }


def prefetch_to_device(
    batches: Iterable[Mapping[str, np.ndarray]], keys, mesh, size: int = 2
) -> Iterator[tuple[Mapping[str, np.ndarray], dict]]:
    """Yields `(host batch, global batch)`, keeping `size - 1` batches ahead.

    While the consumer runs a step on one global batch, the next ones are
    already being read and copied to the devices (double buffering at
    `size=2`). The source iterator is then `size - 1` batches ahead of the
    consumer: save its state only where the consumer has caught up.
    """
    queue = collections.deque()
    for batch in batches:
        queue.append((batch, global_batch(batch, keys, mesh)))
        if len(queue) >= size:
            yield queue.popleft()
    while queue:
        yield queue.popleft()


def local_value(x: jax.Array) -> np.ndarray:
    """This process's copy of a replicated array."""
    return np.asarray(x.addressable_data(0))


def log(message: str) -> None:
    """Prints a line, prefixed with the process in multi-process runs."""
    if jax.process_count() > 1:
        message = f"[process {jax.process_index()}/{jax.process_count()}] {message}"
    print(message, flush=True)
