r"""Train a Flax MLP on `.h5ad` cells through `grain_cells.DataLoader`.

The model predicts one obs column of each cell from its log1p-normalised
expression over a gene subset (the `num_genes` genes with the highest mean in
a sample of training cells). Minibatches come straight from the files:
`AnnDataSource` -> `BlockSampler` -> `fetch_operations(PaddedSparseOutput)`,
densified on the device inside the jitted step (`grain_cells.densify`);
padding rows are masked out of the loss. Numeric obs columns are cut into
`label_bins` quantile classes of the training cells.

Usage (from the repository root)::

    python -m grain_cells.train --workdir=/tmp/run        # synthetic data
    python -m grain_cells.train --workdir=/tmp/run --config.data=a.h5ad,b.h5ad \
        --config.label=cell_type --config.worker_count=2
    python -m grain_cells.train --measure_loader_overhead  # loader vs in-memory

`--config` names the config file (default `configs/train.py`, whose
`get_config()` returns a dict); `--config.KEY=VALUE` overrides one key.

**Held-out split.** The cells of `--config.eval_data` files, or else the last
`eval_fraction` of the blocks of the training files, are never trained on;
the final accuracy is measured on them (in a plate-sorted file the last
blocks are the last plate: an unseen-plate split). Both splits are blocks of
one source, so categorical codes agree. With the synthetic data only `n_counts` (total
counts, the default label) is tied to the expression; `cell_line`, `drug` and
`plate` are drawn independently of it, so they train to chance level.

**Checkpoints and resume.** Every `checkpoint_every` steps (and at the end)
an orbax `CheckpointManager` in `<workdir>/checkpoints` saves the parameters,
the optimiser state and the data iterator's position together; the line
`checkpoint saved at step N` is printed once it is complete. Running the same
command again resumes from the latest checkpoint: the run continues with
exactly the minibatches and parameters of an uninterrupted one, bit for bit
(CPU; on GPU, XLA reductions may not be deterministic), also after SIGKILL.
Restoring under another data, worker count or batch configuration raises
`grain_cells.CheckpointMismatchError`; start a new workdir instead.

**Several JAX processes.** The same command runs once per process::

    python -m grain_cells.train --workdir=/shared/run --num_processes=2 \
        --process_id=0 --coordinator_address=host0:12355   # on host 0
    python -m grain_cells.train --workdir=/shared/run --num_processes=2 \
        --process_id=1 --coordinator_address=host0:12355   # on host 1

(on Cloud TPU, SLURM or Open MPI, `--coordinator_address=auto` lets
`jax.distributed.initialize()` find the others). Each process reads its own
shard of the blocks (`BlockSampler(shard_options=ShardByJaxProcess())`; an
epoch skips `num_blocks % num_processes` blocks so shards stay equal), feeds
`batch_size / num_processes` cells per step into a global batch sharded over
a mesh of every device of every process, and the jitted step averages
gradients across processes (XLA all-reduce; Gloo on CPU), so parameters stay
replicated and identical. Every process writes its part of each checkpoint:
orbax the arrays, Grain `process_<i>-of-<n>.json` with its iterator. The data
files and the workdir must be visible to every host under the same paths.
On one machine, set `JAX_PLATFORMS=cpu` and start the processes with
different `--process_id`s (see `tests/test_train.py`).

**Files in the workdir.** `checkpoints/`; `final_params/process_<i>-of-<n>.npz`
(the parameters after the last step, as each process holds them); with
`dump_row_ids`, `row_ids/process_<i>-of-<n>.txt` (per step: the step, then
the row ids of the real cells the process trained on); with
`dump_params_hash`, `params_hash/process_<i>-of-<n>.txt` (per step: the
step and a SHA-1 of the process's parameters). These two are appended to, so a
resumed run repeats the steps after its checkpoint.

**Loader overhead.** `--measure_loader_overhead` times the same jitted step
fed by the loader and fed by minibatches already in memory, and the loader
alone, and prints steps/s and cells/s for each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import itertools
import os
import pathlib
import time
from collections.abc import Iterator, Mapping, Sequence

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import app, flags, logging
from flax.training import train_state
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import grain_cells
from grain_cells import synthetic

_DEFAULT_CONFIG = (
    pathlib.Path(__file__).resolve().parent.parent / "configs" / "train.py"
)


# --------------------------------------------------------------------------- #
# Configuration.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """A training configuration; see `configs/train.py` for the meaning of keys."""

    data: str
    eval_data: str
    eval_fraction: float
    synthetic_cells: int
    synthetic_genes: int
    synthetic_mean_nnz: float
    synthetic_seed: int
    synthetic_dir: str
    label: str
    label_bins: int
    num_genes: int
    gene_sample_cells: int
    padded_width: int
    batch_size: int
    block_size: int
    fetch_factor: int
    worker_count: int
    hidden_size: int
    num_layers: int
    learning_rate: float
    seed: int
    num_steps: int
    checkpoint_every: int
    max_checkpoints: int
    log_every: int
    dump_row_ids: bool
    dump_params_hash: bool
    overhead_steps: int

    @classmethod
    def from_mapping(cls, config: Mapping | Config) -> Config:
        """Checks a config dict (every key, no other) and converts it.

        Raises:
            ValueError: A key is missing or unknown, or a value is out of range.
        """
        if isinstance(config, Config):
            return config
        names = {f.name for f in dataclasses.fields(cls)}
        missing, unknown = sorted(names - set(config)), sorted(set(config) - names)
        if missing or unknown:
            raise ValueError(
                f"config keys differ from grain_cells.train.Config: missing "
                f"{missing}, unknown {unknown}; start from configs/train.py's "
                "get_config()"
            )
        out = cls(**config)
        for key in ("num_steps", "batch_size", "block_size", "fetch_factor"):
            if getattr(out, key) < 1:
                raise ValueError(f"{key} must be positive, got {getattr(out, key)}")
        for key in ("checkpoint_every", "log_every", "num_genes", "label_bins"):
            if getattr(out, key) < 1:
                raise ValueError(f"{key} must be positive, got {getattr(out, key)}")
        if not 0 <= out.eval_fraction < 1:
            raise ValueError(
                f"eval_fraction must lie in [0, 1), got {out.eval_fraction}"
            )
        return out


def load_config(path: str | os.PathLike | None = None, overrides=()) -> dict:
    """Loads `get_config()` from a config file and applies `KEY=VALUE` overrides.

    Args:
        path: A Python file defining `get_config()`; default `configs/train.py`.
        overrides: `"key=value"` strings; values are parsed as the type of
            the key's value in the file (bools: true/false/1/0).

    Raises:
        ValueError: An override names an unknown key or has a bad value.
    """
    path = pathlib.Path(path or _DEFAULT_CONFIG)
    spec = importlib.util.spec_from_file_location("_grain_cells_train_config", path)
    if spec is None or not path.is_file():
        raise FileNotFoundError(f"config file {path} not found")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = dict(module.get_config())
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--config.{item}: write --config.{key}=VALUE")
        if key not in config:
            raise ValueError(
                f"--config.{key}: no such key in {path}; keys: {sorted(config)}"
            )
        config[key] = _parse_value(key, text, config[key])
    return config


def _parse_value(key: str, text: str, default):
    try:
        if isinstance(default, bool):
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return lowered in ("true", "1")
        if isinstance(default, int):
            return int(text.replace("_", ""))
        if isinstance(default, float):
            return float(text)
    except ValueError:
        raise ValueError(
            f"--config.{key}={text}: expected a value of type {type(default).__name__}"
        ) from None
    return text


# --------------------------------------------------------------------------- #
# Data.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Label:
    """How an obs column becomes class ids.

    Attributes:
        column: The obs column.
        names: Class names.
        edges: For a numeric column, the bin edges between classes (class
            `searchsorted(edges, value, side="right")`); None for categorical
            columns, whose codes are the classes (negative codes: no label).
    """

    column: str
    names: tuple[str, ...]
    edges: np.ndarray | None

    @property
    def key(self) -> str:
        """The minibatch key holding the column."""
        return f"obs/{self.column}"

    def classes(self, values, xp=jnp):
        """Class ids of a column's values (-1 for unlabelled cells)."""
        if self.edges is None:
            return values.astype(xp.int32)
        return xp.searchsorted(xp.asarray(self.edges), values, side="right").astype(
            xp.int32
        )


@dataclasses.dataclass
class Data:
    """The source, the split and the input format of a run.

    Attributes:
        source: Training and held-out files, with the gene subset.
        train_blocks: Blocks `[0, train_blocks)` are trained on; the rest are
            held out.
        label: The target.
        width: `PaddedSparseOutput` width.
    """

    source: grain_cells.AnnDataSource
    train_blocks: int
    label: Label
    width: int

    @property
    def num_genes(self) -> int:
        """Input genes."""
        return self.source.num_genes

    @property
    def output(self) -> grain_cells.PaddedSparseOutput:
        """The minibatch format."""
        return grain_cells.PaddedSparseOutput(self.width)


def _paths(text: str) -> list[str]:
    return [p for p in (s.strip() for s in text.split(",")) if p]


def data_paths(cfg: Config) -> tuple[list[str], list[str]]:
    """Training and held-out files; makes the synthetic file when none is given.

    In a multi-process run, process 0 writes the synthetic file and the others
    wait for it.
    """
    train, held_out = _paths(cfg.data), _paths(cfg.eval_data)
    if train:
        return train, held_out

    def make():
        return synthetic.cached_tahoe_like(
            cfg.synthetic_cells,
            n_genes=cfg.synthetic_genes,
            mean_nnz=cfg.synthetic_mean_nnz,
            seed=cfg.synthetic_seed,
            cache_dir=cfg.synthetic_dir or None,
        )

    if jax.process_index() == 0:
        make()
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("grain_cells.train synthetic data")
    return [str(make())], held_out


def prepare_data(cfg: Config) -> Data:
    """Opens the files, chooses the split, the genes, the label and the width.

    Everything is a deterministic function of the files and the config, so
    every process (and every resumed run) makes the same choices.
    """
    train_paths, eval_paths = data_paths(cfg)
    full = grain_cells.AnnDataSource(
        train_paths + eval_paths, block_size=cfg.block_size, obs_columns=[cfg.label]
    )
    try:
        if eval_paths:
            train_blocks = int(full.block_offsets[len(train_paths)])
        else:
            train_blocks = len(full) - round(len(full) * cfg.eval_fraction)
        if train_blocks < 1:
            raise ValueError(
                f"no training blocks: {len(full)} blocks, eval_fraction="
                f"{cfg.eval_fraction}"
            )
        train_cells = (
            full.num_cells if train_blocks == len(full) else full[train_blocks].start
        )
        label = _make_label(full, cfg, train_cells)
        sample = np.unique(
            np.linspace(0, train_cells - 1, min(cfg.gene_sample_cells, train_cells))
            .round()
            .astype(np.int64)
        )
        x = full.read(sample).X
        genes, width = _choose_genes(x, cfg.num_genes)
    finally:
        full.close()
    if cfg.padded_width:
        width = cfg.padded_width
    source = grain_cells.AnnDataSource(
        train_paths + eval_paths,
        block_size=cfg.block_size,
        obs_columns=[cfg.label],
        genes=genes,
    )
    return Data(source, train_blocks, label, width)


def _make_label(full: grain_cells.AnnDataSource, cfg: Config, train_cells: int):
    categories = full.categories[cfg.label]
    if categories is not None:
        return Label(cfg.label, tuple(str(c) for c in categories), None)
    values = full.obs_values(cfg.label)[:train_cells].astype(np.float64)
    edges = np.unique(
        np.quantile(values, np.linspace(0, 1, cfg.label_bins + 1)[1:-1])
    ).astype(np.float32)
    bounds = ["-inf", *(f"{e:g}" for e in edges), "inf"]
    names = tuple(f"[{a}, {b})" for a, b in itertools.pairwise(bounds))
    return Label(cfg.label, names, edges)


def _choose_genes(x, num_genes: int) -> tuple[np.ndarray | None, int]:
    """The `num_genes` genes of highest mean (in file order), and a width.

    The width is the most stored values any sampled cell has over those
    genes, rounded up to a multiple of 16.
    """
    mean = np.asarray(x.mean(axis=0)).ravel()
    if num_genes >= mean.size:
        genes = None
        sub = x
    else:
        genes = np.sort(np.argsort(-mean, kind="stable")[:num_genes])
        sub = x[:, genes]
    if hasattr(sub, "getnnz"):
        nnz = sub.getnnz(axis=1)
    else:
        nnz = np.count_nonzero(sub, axis=1)
    width = max(16, -(-int(nnz.max(initial=1)) // 16) * 16)
    return genes, width


class BlockRange:
    """Blocks `[start, stop)` of an `AnnDataSource`, as a Grain data source.

    Record `k` is the source's block `start + k` (its `Block` keeps its own
    index and rows), so `fetch_operations(source, ...)` reads it unchanged.
    """

    def __init__(self, source: grain_cells.AnnDataSource, start: int, stop: int):
        """A view of blocks `[start, stop)` of `source`."""
        if not 0 <= start < stop <= len(source):
            raise ValueError(
                f"block range [{start}, {stop}) is empty or outside the "
                f"source's {len(source)} blocks"
            )
        self.source, self.start, self.stop = source, int(start), int(stop)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, record_key: int) -> grain_cells.Block:
        k = int(record_key)
        if not 0 <= k < len(self):
            raise IndexError(f"record {k} of a range of {len(self)} blocks")
        return self.source[self.start + k]

    def __repr__(self) -> str:
        return f"BlockRange({self.source!r}, start={self.start}, stop={self.stop})"


def local_batch_size(cfg: Config) -> int:
    """Cells per minibatch of this process (the global batch, split evenly)."""
    n = jax.process_count()
    if cfg.batch_size % n or (cfg.batch_size // n) % jax.local_device_count():
        raise ValueError(
            f"batch_size={cfg.batch_size} must split evenly over {n} processes "
            f"of {jax.local_device_count()} devices each"
        )
    return cfg.batch_size // n


def train_loader(data: Data, cfg: Config) -> grain_cells.DataLoader:
    """The endless, shuffled, sharded stream of training minibatches."""
    source = data.source
    # Given the source itself, the sampler also reads ahead; given a count, it
    # samples blocks [0, count) (the training split).
    blocks = source if data.train_blocks == len(source) else data.train_blocks
    sampler = grain_cells.BlockSampler(
        blocks,
        seed=cfg.seed,
        num_epochs=None,
        shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
    )
    return grain_cells.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=grain_cells.fetch_operations(
            source,
            batch_size=local_batch_size(cfg),
            fetch_factor=cfg.fetch_factor,
            seed=cfg.seed,
            output=data.output,
        ),
        worker_count=cfg.worker_count,
    )


def eval_loader(data: Data, cfg: Config) -> grain_cells.DataLoader | None:
    """One sequential pass over this process's share of the held-out blocks.

    None when nothing is held out. Sharding drops the last
    `held-out blocks % processes` blocks, so that shards stay equal.
    """
    if data.train_blocks == len(data.source):
        return None
    held_out = BlockRange(data.source, data.train_blocks, len(data.source))
    sampler = grain_cells.BlockSampler(
        len(held_out),
        shuffle=False,
        num_epochs=1,
        shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
    )
    return grain_cells.DataLoader(
        data_source=held_out,
        sampler=sampler,
        operations=grain_cells.fetch_operations(
            data.source,
            batch_size=local_batch_size(cfg),
            fetch_factor=cfg.fetch_factor,
            shuffle=False,
            output=data.output,
        ),
    )


# --------------------------------------------------------------------------- #
# Model and steps.
# --------------------------------------------------------------------------- #


class MLP(nn.Module):
    """`num_layers` ReLU layers of `hidden_size`, then class logits."""

    hidden_size: int
    num_layers: int
    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits `[batch, num_classes]` of features `[batch, genes]`."""
        for _ in range(self.num_layers):
            x = nn.relu(nn.Dense(self.hidden_size)(x))
        return nn.Dense(self.num_classes)(x)


def features(batch: Mapping[str, jax.Array], num_genes: int) -> jax.Array:
    """log1p(x / total * 1e4) of a padded-sparse minibatch, densified (in jit).

    The total is over the input genes; an empty (padding) row stays zero.
    """
    x = grain_cells.densify(batch["values"], batch["indices"], num_genes)
    total = x.sum(axis=-1, keepdims=True)
    return jnp.log1p(x * jnp.where(total > 0, 1e4 / total, 0.0))


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh(
        (jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
    )


def create_state(cfg: Config, data: Data, mesh) -> train_state.TrainState:
    """Fresh parameters and adam state, replicated over the mesh."""
    model = MLP(cfg.hidden_size, cfg.num_layers, len(data.label.names))
    tx = optax.adam(cfg.learning_rate)

    def init():
        x = jnp.zeros((1, data.num_genes), jnp.float32)
        params = model.init(jax.random.key(cfg.seed), x)["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    return jax.jit(init, out_shardings=NamedSharding(mesh, P()))()


def _loss_and_metrics(params, apply_fn, batch, num_genes: int, label: Label):
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


def make_train_step(data: Data, mesh):
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

    return jax.jit(step, out_shardings=NamedSharding(mesh, P()))


def make_eval_step(data: Data, apply_fn):
    """Per-process (no collectives) correct and count of a local minibatch."""

    @jax.jit
    def step(params, batch):
        _, metrics = _loss_and_metrics(
            params, apply_fn, batch, data.num_genes, data.label
        )
        return metrics["correct"], metrics["count"]

    return step


def _batch_keys(data: Data) -> tuple[str, ...]:
    return ("values", "indices", "mask", data.label.key)


def global_batch(batch: Mapping[str, np.ndarray], keys, mesh) -> dict:
    """This process's minibatch as its rows of a global one over the mesh."""
    sharding = NamedSharding(mesh, P("data"))
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(batch[k]))
        for k in keys
    }


def local_value(x: jax.Array) -> np.ndarray:
    """This process's copy of a replicated array."""
    return np.asarray(x.addressable_data(0))


def _flat_params(params) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path): local_value(x) for path, x in leaves}


def params_hash(params) -> str:
    """SHA-1 of this process's copy of the parameters."""
    h = hashlib.sha1()
    for key, value in _flat_params(params).items():
        h.update(key.encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- #
# Training.
# --------------------------------------------------------------------------- #


def _process_file(workdir: str, kind: str, suffix: str) -> str:
    folder = os.path.join(workdir, kind)
    os.makedirs(folder, exist_ok=True)
    name = f"process_{jax.process_index()}-of-{jax.process_count()}{suffix}"
    return os.path.join(folder, name)


def _log(message: str) -> None:
    if jax.process_count() > 1:
        message = f"[process {jax.process_index()}/{jax.process_count()}] {message}"
    print(message, flush=True)


def _close(iterator) -> None:
    close = getattr(iterator, "close", None)
    if close is None:
        return
    # grain_cells' slot-ring transport can fail to close a worker whose
    # segment is already gone; the workers still exit with this process.
    with contextlib.suppress(FileNotFoundError):
        close()


def _checkpoint_manager(workdir: str, cfg: Config) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        os.path.join(workdir, "checkpoints"),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=cfg.max_checkpoints,
            # Synchronous: "checkpoint saved" means it is on disk.
            enable_async_checkpointing=False,
            # A save cut short by a kill leaves a temporary folder behind.
            cleanup_tmp_directories=True,
        ),
    )


class _StepFiles:
    """The per-step test hooks: row ids and parameter hashes, appended."""

    def __init__(self, workdir: str, cfg: Config):
        self._row_ids = self._params = None
        if cfg.dump_row_ids:
            self._row_ids = open(_process_file(workdir, "row_ids", ".txt"), "a")  # noqa: SIM115
        if cfg.dump_params_hash:
            self._params = open(_process_file(workdir, "params_hash", ".txt"), "a")  # noqa: SIM115

    def write(self, step: int, batch, state) -> None:
        if self._row_ids is not None:
            ids = np.asarray(batch["row_ids"])[np.asarray(batch["mask"])]
            self._row_ids.write(f"{step} {' '.join(map(str, ids))}\n")
            self._row_ids.flush()
        if self._params is not None:
            self._params.write(f"{step} {params_hash(state.params)}\n")
            self._params.flush()

    def close(self) -> None:
        for f in (self._row_ids, self._params):
            if f is not None:
                f.close()


def _save(manager: ocp.CheckpointManager, step: int, state, iterator) -> None:
    manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(iterator),
        ),
    )
    manager.wait_until_finished()
    _log(f"checkpoint saved at step {step}")


def _restore(manager: ocp.CheckpointManager, state, iterator):
    """Restores the latest checkpoint into `state` and `iterator`, if any.

    Returns:
        The state, and the step restored (None when there is no checkpoint).
    """
    step = manager.latest_step()
    if step is None:
        return state, None
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(state),
            data=grain.checkpoint.CheckpointRestore(iterator),
        ),
    )
    _log(f"resumed from step {step}")
    return restored["state"], step


def train_and_evaluate(config: Mapping | Config, workdir: str) -> dict:
    """Trains (resuming from `workdir` when it holds a checkpoint), then evaluates.

    Call `jax.distributed.initialize` first for a multi-process run (`main`
    does); every process calls this with the same config and workdir.

    Args:
        config: A dict from `configs/train.py`'s `get_config()` (all keys), or
            a `Config`.
        workdir: Checkpoints and outputs; created if missing.

    Returns:
        Figures of the run: `step`, `resumed_from`, `steps_per_sec` and
        `cells_per_sec` (over this invocation's steps after the first, which
        compiles; cells of all processes), `loss` and `train_accuracy` (mean
        over the last `log_every` steps), `eval_accuracy`, `eval_cells`,
        `majority_accuracy` (always predicting the held-out split's most common
        class), `num_classes`, `num_genes`, `width`.
    """
    cfg = Config.from_mapping(config)
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    data = prepare_data(cfg)
    mesh = _mesh()
    state = create_state(cfg, data, mesh)
    train_step = make_train_step(data, mesh)
    keys = _batch_keys(data)
    iterator = iter(train_loader(data, cfg))
    manager = _checkpoint_manager(workdir, cfg)
    step_files = _StepFiles(workdir, cfg)
    try:
        state, resumed_from = _restore(manager, state, iterator)
        step = start_step = int(local_value(state.step))
        _log(
            f"data: {data.source.num_cells} cells ({data.train_blocks} of "
            f"{len(data.source)} blocks for training), {data.num_genes} genes, "
            f"width {data.width}; label {cfg.label!r}: "
            f"{len(data.label.names)} classes; {jax.process_count()} process(es), "
            f"batch {cfg.batch_size}"
        )
        t0, timed_cells = None, 0.0
        window: list[dict] = []
        last = {"loss": float("nan"), "accuracy": float("nan")}
        while step < cfg.num_steps:
            batch = next(iterator)
            state, metrics = train_step(state, global_batch(batch, keys, mesh))
            step += 1
            window.append(metrics)
            step_files.write(step, batch, state)
            if t0 is None:  # compiled, workers started: start the clock
                jax.block_until_ready(state)
                t0 = time.perf_counter()
                timed_cells -= float(local_value(metrics["count"]))
            if step % cfg.log_every == 0 or step == cfg.num_steps:
                last, cells = _summarise(window)
                timed_cells += cells
                window = []
                _log(
                    f"step {step}: loss={last['loss']:.4f}, "
                    f"accuracy={last['accuracy']:.4f}"
                )
            if step % cfg.checkpoint_every == 0 or step == cfg.num_steps:
                _save(manager, step, state, iterator)
        jax.block_until_ready(state)
        elapsed = time.perf_counter() - t0 if t0 is not None else float("nan")
    finally:
        step_files.close()
        _close(iterator)
        manager.close()

    np.savez(
        _process_file(workdir, "final_params", ".npz"), **_flat_params(state.params)
    )
    timed_steps = step - start_step - 1
    nan = float("nan")
    result = {
        "step": step,
        "resumed_from": resumed_from,
        "steps_per_sec": timed_steps / elapsed if timed_steps > 0 else nan,
        "cells_per_sec": timed_cells / elapsed if timed_steps > 0 else nan,
        "loss": last["loss"],
        "train_accuracy": last["accuracy"],
        **evaluate(state, data, cfg),
        "num_classes": len(data.label.names),
        "num_genes": data.num_genes,
        "width": data.width,
    }
    _log(
        f"done at step {step}: steps/s={result['steps_per_sec']:.1f}, "
        f"cells/s={result['cells_per_sec']:.0f}, loss={result['loss']:.4f}, "
        f"train accuracy={result['train_accuracy']:.4f}, "
        f"accuracy={result['eval_accuracy']:.4f} on {result['eval_cells']} "
        f"held-out cells (majority class: {result['majority_accuracy']:.4f})"
    )
    return result


def _summarise(window: list[dict]) -> tuple[dict, float]:
    """Mean loss and accuracy over steps; the number of cells in them."""
    if not window:
        return {"loss": float("nan"), "accuracy": float("nan")}, 0.0
    values = {k: np.array([local_value(m[k]) for m in window]) for k in window[0]}
    count = float(values["count"].sum())
    return {
        "loss": float(values["loss"].mean()),
        "accuracy": float(values["correct"].sum() / max(count, 1.0)),
    }, count


def evaluate(state, data: Data, cfg: Config) -> dict:
    """Accuracy on the held-out blocks (each process reads its share)."""
    params = jax.tree.map(local_value, state.params)
    step = make_eval_step(data, state.apply_fn)
    n_classes = len(data.label.names)
    totals = np.zeros(2 + n_classes, np.int64)  # correct, count, class histogram
    loader = eval_loader(data, cfg)
    iterator = iter(loader if loader is not None else ())
    try:
        for batch in iterator:
            correct, count = step(params, {k: batch[k] for k in _batch_keys(data)})
            totals[0] += int(correct)
            totals[1] += int(count)
            labels = data.label.classes(np.asarray(batch[data.label.key]), np)
            labels = labels[np.asarray(batch["mask"]) & (labels >= 0)]
            totals[2:] += np.bincount(labels, minlength=n_classes)[:n_classes]
    finally:
        _close(iterator)
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


# --------------------------------------------------------------------------- #
# Loader overhead.
# --------------------------------------------------------------------------- #


def _timed_steps(
    state, train_step, batches: Iterator, steps: int, keys, mesh
) -> tuple[object, float, float]:
    """Runs `steps` steps; returns the state, seconds and real cells."""
    cells = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        batch = next(batches)
        cells += int(np.asarray(batch["mask"]).sum())
        state, _ = train_step(state, global_batch(batch, keys, mesh))
    jax.block_until_ready(state)
    return state, time.perf_counter() - t0, cells * jax.process_count()


def _cycle(batches: Sequence) -> Iterator:
    while True:
        yield from batches


def measure_loader_overhead(config: Mapping | Config, *, warmup: int = 30) -> dict:
    """Steps/s of the training step fed by the loader vs by batches in memory.

    Both loops run the same jitted step, including the host-to-device copy of
    each minibatch; the second one cycles over `min(overhead_steps, 256)`
    minibatches taken from the loader beforehand. Also times the loader alone.

    Returns:
        `{"loader": {...}, "in_memory": {...}, "loader_only": {...}}`, each
        with `steps_per_sec` and `cells_per_sec`, plus `overhead_ms_per_step`.
    """
    cfg = Config.from_mapping(config)
    data = prepare_data(cfg)
    mesh = _mesh()
    state = create_state(cfg, data, mesh)
    train_step = make_train_step(data, mesh)
    keys = _batch_keys(data)
    steps = cfg.overhead_steps
    iterator = iter(train_loader(data, cfg))
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
            state, train_step, _cycle(cached), steps, keys, mesh
        )
        t0 = time.perf_counter()
        only_cells = 0
        for _ in range(steps):
            only_cells += int(np.asarray(next(iterator)["mask"]).sum())
        only_s = time.perf_counter() - t0
    finally:
        _close(iterator)

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
        _log(
            f"{text}: steps/s={r['steps_per_sec']:.1f}, "
            f"cells/s={r['cells_per_sec']:.0f}"
        )
    _log(
        f"loader cost: {result['overhead_ms_per_step']:.2f} ms per step "
        f"(batch {cfg.batch_size}, {cfg.worker_count} workers, {steps} steps)"
    )
    return result


# --------------------------------------------------------------------------- #
# Command line.
# --------------------------------------------------------------------------- #

_CONFIG_OVERRIDES: list[str] = []


def _define_flags() -> None:
    # Defined only when run as a program: Grain's spawned workers import this
    # module again and must not define the flags twice.
    flags.DEFINE_string("workdir", None, "Checkpoints and outputs (required to train).")
    flags.DEFINE_string(
        "config",
        str(_DEFAULT_CONFIG),
        "Config file with get_config(); override keys with --config.KEY=VALUE.",
    )
    flags.DEFINE_bool(
        "measure_loader_overhead",
        False,
        "Time the step fed by the loader and by in-memory batches, then exit.",
    )
    flags.DEFINE_integer("num_processes", 1, "JAX processes of the run.")
    flags.DEFINE_integer("process_id", 0, "This process's index.")
    flags.DEFINE_string(
        "coordinator_address",
        "",
        "host:port of process 0's coordinator; 'auto' lets "
        "jax.distributed.initialize() detect the cluster.",
    )


def _parse_flags(argv: list[str]) -> list[str]:
    """Absl parsing, with `--config.KEY=VALUE` taken out first."""
    rest = []
    for arg in argv:
        if arg.startswith("--config."):
            _CONFIG_OVERRIDES.append(arg[len("--config.") :])
        else:
            rest.append(arg)
    return app.parse_flags_with_usage(rest)


def main(argv: Sequence[str]) -> None:
    """Parses flags, joins the other JAX processes, trains or measures."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    if not f["verbosity"].present:  # orbax logs every save at INFO: --verbosity=0
        logging.set_verbosity(logging.WARNING)
    if f.coordinator_address == "auto":
        jax.distributed.initialize()
    elif f.num_processes > 1:
        if not f.coordinator_address:
            raise app.UsageError("--num_processes > 1 needs --coordinator_address")
        jax.distributed.initialize(
            coordinator_address=f.coordinator_address,
            num_processes=f.num_processes,
            process_id=f.process_id,
        )
    try:
        config = load_config(f.config, _CONFIG_OVERRIDES)
    except (ValueError, FileNotFoundError) as e:
        raise app.UsageError(str(e)) from None
    if f.measure_loader_overhead:
        measure_loader_overhead(config)
        return
    if not f.workdir:
        raise app.UsageError("--workdir is required to train")
    train_and_evaluate(config, f.workdir)


if __name__ == "__main__":
    _define_flags()
    app.run(main, flags_parser=_parse_flags)
