"""One of two JAX processes feeding unequal shards (run by test_device.py).

Usage: python two_processes.py COORDINATOR PROCESS_ID OUT_JSON PATH...

Process i reads file i alone (unequal numbers of minibatches), feeds it with
`equal_steps=True`, and runs a jitted step whose result needs every
process's rows (a sum over the global batch). Writes the steps, padding
steps, per-step global real-cell counts and its own real row ids.
"""

import json
import sys

import jax
import numpy as np

import grain_cells
from grain_cells.feed import device_iterator

coordinator, process_id, out_path, *paths = sys.argv[1:]
jax.distributed.initialize(
    coordinator_address=coordinator, num_processes=2, process_id=int(process_id)
)


def loader():
    source = grain_cells.AnnDataSource([paths[jax.process_index()]], block_size=8)
    return grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=3, num_epochs=1),
        operations=grain_cells.fetch_operations(
            source,
            batch_size=16,
            fetch_factor=2,
            seed=3,
            output=grain_cells.PaddedSparseOutput(8),
        ),
    )


host = [int(np.sum(b["mask"])) for b in loader()]
count = jax.jit(
    lambda b: b["mask"].sum(),
    out_shardings=jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.asarray(jax.devices()), ("d",)),
        jax.sharding.PartitionSpec(),
    ),
)
totals, rows = [], []
with device_iterator(iter(loader()), equal_steps=True) as batches:
    for batch in batches:
        totals.append(int(count(batch)))
        (shard,) = batch["row_ids"].addressable_shards
        ids = np.asarray(shard.data)
        rows += ids[np.asarray(batch["mask"].addressable_shards[0].data)].tolist()
    padding = batches.padding_steps
with open(out_path, "w") as f:
    json.dump(
        {
            "host_steps": len(host),
            "steps": len(totals),
            "padding": padding,
            "totals": totals,
            "rows": rows,
            "shape": list(batch["values"].shape),
        },
        f,
    )
