"""`--measure_loader_overhead`: steps/s fed by the loader vs from memory."""

from __future__ import annotations

import itertools
import time

import jax
import ml_collections
import numpy as np

from grain_cells.examples.train import checkpointing, distributed, input_pipeline
from grain_cells.examples.train import train as train_lib
from grain_cells.examples.train.distributed import local_value, log
from grain_cells.feed import device_iterator


def _timed_steps(state, train_step, batches, steps: int) -> tuple[object, float, int]:
    """Runs `steps` steps on `batches` (a device feed, one copy ahead).

    Returns:
        The state, the seconds and the real labelled cells of all processes
        (the step's own count, read once at the end).
    """
    counts = []
    t0 = time.perf_counter()
    for batch in itertools.islice(batches, steps):
        state, metrics = train_step(state, batch)
        counts.append(metrics["count"])
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t0
    return state, seconds, int(sum(int(local_value(c)) for c in counts))


def _loader_alone(data, config, steps: int, warmup: int) -> tuple[float, int]:
    """Seconds and real cells of `steps` host minibatches from a new loader.

    A fresh iterator (its workers started, `warmup` minibatches taken at
    full speed first), so no buffer filled while something else ran is
    counted.
    """
    iterator = iter(input_pipeline.train_loader(data, config))
    try:
        for _ in range(warmup):
            next(iterator)
        cells = 0
        t0 = time.perf_counter()
        for _ in range(steps):
            cells += int(np.count_nonzero(next(iterator)["mask"]))
        return time.perf_counter() - t0, cells * jax.process_count()
    finally:
        checkpointing.close_iterator(iterator)


def timed_steps(config: ml_collections.ConfigDict) -> int:
    """`overhead_steps`, but at least 8 fetches per worker.

    Workers fill their buffers while the first steps compile and run (and a
    fetch yields `fetch_factor` minibatches at once); a window of only a few
    fetches would time minibatches read before it started. Eight fetches
    per worker keep what was read ahead to a small share of the window.
    """
    fetches = 8 * max(1, config.worker_count)
    return max(config.overhead_steps, fetches * config.fetch_factor)


def measure_loader_overhead(config: ml_collections.ConfigDict) -> dict:
    """Steps/s of the training step fed by the loader vs by batches in memory.

    Both loops run the same jitted step fed by the same device feed
    (`grain_cells.feed.device_iterator`: the host-to-device copy of each
    minibatch runs one step ahead); the second one cycles over
    `min(steps, 256)` minibatches taken from the loader beforehand. Each
    timed window is `timed_steps(config)` minibatches.
    Then the training loader is closed and a new one is timed alone (host
    minibatches, no step). Each variant first runs `overhead_warmup`
    untimed minibatches.

    Returns:
        `{"loader": {...}, "in_memory": {...}, "loader_only": {...}}`, each
        with `steps_per_sec` and `cells_per_sec`, plus `overhead_ms_per_step`.
    """
    train_lib.check_config(config)
    data = input_pipeline.prepare_data(config)
    mesh = distributed.make_mesh()
    sharding = distributed.batch_sharding(mesh)
    state = train_lib.create_state(config, data, mesh)
    train_step = train_lib.make_train_step(data, mesh)
    steps = timed_steps(config)
    warmup = config.get("overhead_warmup", 30)
    keys = data.batch_keys
    host = iter(input_pipeline.train_loader(data, config))
    fed = device_iterator(host, sharding, keys=keys)
    try:
        state, _, _ = _timed_steps(state, train_step, fed, warmup)
        state, loader_s, loader_cells = _timed_steps(state, train_step, fed, steps)
        cached = [
            {k: np.array(v) for k, v in next(host).items() if k in keys}
            for _ in range(min(steps, 256))
        ]
    finally:
        checkpointing.close_iterator(fed)
    in_memory = device_iterator(itertools.cycle(cached), sharding, keys=keys)
    state, memory_s, memory_cells = _timed_steps(state, train_step, in_memory, steps)
    try:
        only_s, only_cells = _loader_alone(data, config, steps, warmup)
    finally:
        data.close()

    def figures(seconds, cells):
        return {"steps_per_sec": steps / seconds, "cells_per_sec": cells / seconds}

    result = {
        "loader": figures(loader_s, loader_cells),
        "in_memory": figures(memory_s, memory_cells),
        "loader_only": figures(only_s, only_cells),
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
