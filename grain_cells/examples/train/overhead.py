"""`--measure_loader_overhead`: steps/s fed by the loader vs from memory."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import jax
import ml_collections
import numpy as np

from grain_cells.examples.train import checkpointing, distributed, input_pipeline
from grain_cells.examples.train import train as train_lib
from grain_cells.examples.train.distributed import log


def _timed_steps(
    state, train_step, batches: Iterator, steps: int, keys, mesh
) -> tuple[object, float, float]:
    """Runs `steps` steps, one global batch prefetched to the devices ahead.

    Returns:
        The state, the seconds and the real cells of all processes.
    """
    cells = 0
    t0 = time.perf_counter()
    prefetched = distributed.prefetch_to_device(
        itertools.islice(batches, steps), keys, mesh
    )
    for batch, device_batch in prefetched:
        cells += int(np.asarray(batch["mask"]).sum())
        state, _ = train_step(state, device_batch)
    jax.block_until_ready(state)
    return state, time.perf_counter() - t0, cells * jax.process_count()


def measure_loader_overhead(
    config: ml_collections.ConfigDict, *, warmup: int = 30
) -> dict:
    """Steps/s of the training step fed by the loader vs by batches in memory.

    Both loops run the same jitted step, including the host-to-device copy of
    each minibatch (prefetched one step ahead); the second one cycles over
    `min(overhead_steps, 256)` minibatches taken from the loader beforehand.
    Also times the loader alone.

    Returns:
        `{"loader": {...}, "in_memory": {...}, "loader_only": {...}}`, each
        with `steps_per_sec` and `cells_per_sec`, plus `overhead_ms_per_step`.
    """
    train_lib.check_config(config)
    data = input_pipeline.prepare_data(config)
    mesh = distributed.make_mesh()
    state = train_lib.create_state(config, data, mesh)
    train_step = train_lib.make_train_step(data, mesh)
    keys = data.batch_keys
    steps = config.overhead_steps
    iterator = iter(input_pipeline.train_loader(data, config))
    try:
        state, _, _ = _timed_steps(state, train_step, iterator, warmup, keys, mesh)
        state, loader_s, loader_cells = _timed_steps(
            state, train_step, iterator, steps, keys, mesh
        )
        cached = [
            {k: np.array(v) for k, v in next(iterator).items()}
            for _ in range(min(steps, 256))
        ]
        state, memory_s, memory_cells = _timed_steps(
            state, train_step, itertools.cycle(cached), steps, keys, mesh
        )
        t0 = time.perf_counter()
        only_cells = 0
        for _ in range(steps):
            only_cells += int(np.asarray(next(iterator)["mask"]).sum())
        only_s = time.perf_counter() - t0
    finally:
        checkpointing.close_iterator(iterator)
        data.close()

    def figures(seconds, cells):
        return {"steps_per_sec": steps / seconds, "cells_per_sec": cells / seconds}

    result = {
        "loader": figures(loader_s, loader_cells),
        "in_memory": figures(memory_s, memory_cells),
        "loader_only": figures(only_s, only_cells * jax.process_count()),
        "overhead_ms_per_step": 1e3 * (loader_s - memory_s) / steps,
    }
    for name, text in (
        ("loader", "training fed by the loader"),
        ("in_memory", "training fed from memory"),
        ("loader_only", "the loader alone"),
    ):
        r = result[name]
        figures_text = (
            f"steps/s={r['steps_per_sec']:.1f}, cells/s={r['cells_per_sec']:.0f}"
        )
        log(f"{text}: {figures_text}")
    log(
        f"loader cost: {result['overhead_ms_per_step']:.2f} ms per step "
        f"(batch {config.batch_size}, {config.worker_count} workers, {steps} steps, "
        f"devices: {jax.devices()[0].platform} x {jax.device_count()})"
    )
    return result
