"""`train_and_evaluate(config, workdir)`: training loop, steps, evaluation."""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax.training import train_state
from jax.experimental import multihost_utils

from grain_cells.examples.train import checkpointing, distributed, input_pipeline
from grain_cells.examples.train.distributed import local_value, log
from grain_cells.examples.train.models import MLP, features
from grain_cells.examples.train.transformer import CellTransformer, token_inputs

_POSITIVE = (
    "num_steps",
    "batch_size",
    "block_size",
    "fetch_factor",
    "checkpoint_every",
    "log_every",
    "num_genes",
    "label_bins",
    "max_checkpoints",
)


def check_config(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first key whose value is out of range."""
    for key in _POSITIVE:
        if config[key] < 1:
            raise ValueError(f"config.{key} must be positive, got {config[key]}")
    if not 0 <= config.eval_fraction < 1:
        raise ValueError(
            f"config.eval_fraction must lie in [0, 1), got {config.eval_fraction}"
        )
    if config.eval_split not in ("last", "random"):
        raise ValueError(
            f"config.eval_split must be 'last' or 'random', got {config.eval_split!r}"
        )
    if config.get("model", "mlp") not in ("mlp", "transformer"):
        raise ValueError(
            f"config.model must be 'mlp' or 'transformer', got {config.model!r}"
        )
    if config.worker_count < 0:
        raise ValueError(f"config.worker_count must be >= 0, got {config.worker_count}")


def create_state(
    config: ml_collections.ConfigDict, data: input_pipeline.Data, mesh
) -> train_state.TrainState:
    """Fresh parameters and adam state, replicated over the mesh."""
    if data.tokens is not None:
        model = CellTransformer(
            vocab_size=int(data.tokens.column_tokens.max()) + 1,
            length=data.tokens.length,
            width=config.hidden_size,
            heads=config.num_heads,
            num_layers=config.num_layers,
            num_classes=len(data.label.names),
        )
        inputs = (
            jnp.zeros((1, data.tokens.length), jnp.int32),
            jnp.ones((1, data.tokens.length), bool),
        )
    else:
        model = MLP(config.hidden_size, config.num_layers, len(data.label.names))
        inputs = (jnp.zeros((1, data.num_genes), jnp.float32),)
    tx = optax.adam(config.learning_rate)

    def init():
        params = model.init(jax.random.key(config.seed), *inputs)["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    return jax.jit(init, out_shardings=distributed.replicated(mesh))()


def _loss_and_metrics(params, apply_fn, batch, num_genes: int, label):
    if "gene_ids" in batch:  # token minibatches: the transformer
        logits = apply_fn({"params": params}, *token_inputs(batch))
    else:
        logits = apply_fn({"params": params}, features(batch, num_genes))
    labels = label.classes(batch[label.key])
    mask = batch["mask"] & (labels >= 0)
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.maximum(labels, 0)
    )
    count = mask.sum()
    loss = jnp.where(mask, losses, 0.0).sum() / jnp.maximum(count, 1)
    correct = (mask & (logits.argmax(-1) == labels)).sum()
    return loss, {"loss": loss, "correct": correct, "count": count}


def make_train_step(data: input_pipeline.Data, mesh):
    """The jitted step: global minibatch in, replicated state and metrics out.

    The loss is the mean over the real cells of the global minibatch, so its
    gradient is averaged over every process's cells (XLA inserts the
    all-reduce over the `data` axis).
    """

    def step(state, batch):
        grad_fn = jax.grad(_loss_and_metrics, has_aux=True)
        grads, metrics = grad_fn(
            state.params, state.apply_fn, batch, data.num_genes, data.label
        )
        return state.apply_gradients(grads=grads), metrics

    return jax.jit(step, out_shardings=distributed.replicated(mesh))


def make_eval_step(data: input_pipeline.Data, apply_fn):
    """Per-process (no collectives) correct and count of a local minibatch."""

    @jax.jit
    def step(params, batch):
        _, metrics = _loss_and_metrics(
            params, apply_fn, batch, data.num_genes, data.label
        )
        return metrics["correct"], metrics["count"]

    return step


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains (resuming from `workdir` when it holds a checkpoint), then evaluates.

    Call `jax.distributed.initialize` first for a multi-process run (`main`
    does); every process calls this with the same config and workdir.

    Args:
        config: The keys of `configs/default.py`'s `get_config()`.
        workdir: Checkpoints and outputs; created if missing.

    Returns:
        Figures of the run: `step`, `resumed_from`, `steps_per_sec` and
        `cells_per_sec` (over this invocation's steps after the first, which
        compiles; cells of all processes; NaN when it ran fewer than two
        steps), `loss` and `train_accuracy` (mean over the last `log_every`
        steps; NaN when it trained none), `eval_accuracy`, `eval_cells`,
        `majority_accuracy` (always predicting the held-out split's most
        common class), `num_classes`, `num_genes`, `width`.

    Raises:
        ValueError: A config value is out of range.
    """
    check_config(config)
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    data = input_pipeline.prepare_data(config)
    mesh = distributed.make_mesh()
    state = create_state(config, data, mesh)
    train_step = make_train_step(data, mesh)
    batches = input_pipeline.train_batches(
        data, config, distributed.batch_sharding(mesh)
    )
    mngr = checkpointing.manager(workdir, config)
    step_files = checkpointing.StepFiles(workdir, config)
    try:
        state, resumed_from = checkpointing.restore(mngr, state, batches)
        step = start_step = int(local_value(state.step))
        log(
            f"data: {data.train.num_selected_cells} training cells "
            f"({len(data.train)} blocks), "
            f"{0 if data.eval is None else data.eval.num_selected_cells} held out; "
            f"{data.num_genes} genes, width {data.width}; label {config.label!r}: "
            f"{len(data.label.names)} classes; {jax.process_count()} process(es), "
            f"batch {config.batch_size}"
        )
        if step >= config.num_steps:
            log(
                f"already at step {step} (num_steps={config.num_steps}): nothing "
                "to train; raise --config.num_steps to train on"
            )
        last, timed, elapsed = _train_loop(
            config, state, train_step, batches, mngr, step_files, step
        )
        state, step = last.pop("state"), last.pop("step")
    finally:
        step_files.close()
        checkpointing.close_iterator(batches)
        mngr.close()

    checkpointing.save_final_params(workdir, state.params)
    timed_steps, timed_cells = timed
    nan = float("nan")
    result = {
        "step": step,
        "resumed_from": resumed_from,
        "steps_per_sec": timed_steps / elapsed if timed_steps > 0 else nan,
        "cells_per_sec": timed_cells / elapsed if timed_steps > 0 else nan,
        "loss": last["loss"],
        "train_accuracy": last["accuracy"],
        **evaluate(state, data, config),
        "num_classes": len(data.label.names),
        "num_genes": data.num_genes,
        "width": data.width,
    }
    data.close()
    held_out = (
        f"accuracy={result['eval_accuracy']:.4f} on {result['eval_cells']} "
        f"held-out cells (majority class: {result['majority_accuracy']:.4f})"
        if result["eval_cells"]
        else "no held-out cells"
    )
    if step == start_step:
        log(f"done at step {step}, trained nothing in this run: {held_out}")
    elif timed_steps > 0:
        log(
            f"done at step {step}: steps/s={result['steps_per_sec']:.1f}, "
            f"cells/s={result['cells_per_sec']:.0f}, loss={result['loss']:.4f}, "
            f"train accuracy={result['train_accuracy']:.4f}, {held_out}"
        )
    else:  # one step: the compiling one, not timed
        log(
            f"done at step {step} (one step, not timed): loss={result['loss']:.4f}, "
            f"train accuracy={result['train_accuracy']:.4f}, {held_out}"
        )
    return result


def _train_loop(config, state, train_step, batches, mngr, files, step):
    """Steps from `step` to `num_steps` on global device minibatches.

    `batches` (`grain_cells.feed`) copies the next minibatch to the devices
    while the current step runs (double buffering); its state is that of the
    last minibatch it returned, so a checkpoint saved after step N holds the
    data position of step N, however far the feed has read ahead.

    Returns:
        `{"state", "step", "loss", "accuracy"}` (loss and accuracy over the
        last logged window), `(timed steps, timed cells)` and the seconds
        they took (all steps after the first, which compiles).
    """
    t0, timed_cells, start = None, 0.0, step
    window: list[dict] = []
    last = {"loss": float("nan"), "accuracy": float("nan")}
    while step < config.num_steps:
        batch = next(batches)
        state, metrics = train_step(state, batch)  # runs asynchronously
        step += 1
        window.append(metrics)
        if step % config.checkpoint_every == 0 or step == config.num_steps:
            checkpointing.save(mngr, step, state, batches)
        files.write(step, batch, state)
        if t0 is None:  # compiled, workers started: start the clock
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            timed_cells -= float(local_value(metrics["count"]))
        if step % config.log_every == 0 or step == config.num_steps:
            last, cells = _summarise(window)
            timed_cells += cells
            window = []
            log(
                f"step {step}: loss={last['loss']:.4f}, accuracy={last['accuracy']:.4f}"
            )
    jax.block_until_ready(state)
    elapsed = time.perf_counter() - t0 if t0 is not None else float("nan")
    timed_steps = max(step - start - 1, 0)
    return {"state": state, "step": step, **last}, (timed_steps, timed_cells), elapsed


def _summarise(window: list[dict]) -> tuple[dict, float]:
    """Mean loss and accuracy over steps; the number of cells in them."""
    values = {k: np.array([local_value(m[k]) for m in window]) for k in window[0]}
    count = float(values["count"].sum())
    return {
        "loss": float(values["loss"].mean()),
        "accuracy": float(values["correct"].sum() / max(count, 1.0)),
    }, count


def evaluate(
    state, data: input_pipeline.Data, config: ml_collections.ConfigDict
) -> dict:
    """Accuracy on the held-out blocks (each process reads its share)."""
    params = jax.tree.map(local_value, state.params)
    step = make_eval_step(data, state.apply_fn)
    n_classes = len(data.label.names)
    totals = np.zeros(2 + n_classes, np.int64)  # correct, count, class histogram
    loader = input_pipeline.eval_loader(data, config)
    iterator = iter(loader if loader is not None else ())
    try:
        for batch in iterator:
            correct, count = step(params, {k: batch[k] for k in data.batch_keys})
            totals[0] += int(correct)
            totals[1] += int(count)
            labels = data.label.classes(np.asarray(batch[data.label.key]), np)
            labels = labels[np.asarray(batch["mask"]) & (labels >= 0)]
            totals[2:] += np.bincount(labels, minlength=n_classes)[:n_classes]
    finally:
        checkpointing.close_iterator(iterator)
    if jax.process_count() > 1:
        totals = np.asarray(multihost_utils.process_allgather(totals))
        totals = totals.reshape(-1, 2 + n_classes).sum(axis=0)
    count = int(totals[1])
    if count == 0:  # nothing held out
        nan = float("nan")
        return {"eval_accuracy": nan, "eval_cells": 0, "majority_accuracy": nan}
    return {
        "eval_accuracy": float(totals[0] / count),
        "eval_cells": int(totals[1]),
        "majority_accuracy": float(totals[2:].max(initial=0) / count),
    }
