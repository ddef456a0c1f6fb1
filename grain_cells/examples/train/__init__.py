r"""Train a Flax MLP on `.h5ad` cells read in place through grain_cells.

A flax-style example: `configs/default.py` (`get_config()`), `main.py` (absl
flags), `train.py` (`train_and_evaluate(config, workdir)`), `models.py`,
`input_pipeline.py`, `checkpointing.py`, `distributed.py` and `overhead.py`.

The model predicts one obs column of each cell from its log1p-normalised
expression over a gene subset (the `num_genes` genes with the highest mean in
a sample of training cells). Minibatches come straight from the files:
`AnnDataSource` -> `BlockSampler` -> `fetch_operations(PaddedSparseOutput)`,
densified on the device inside the jitted step (`grain_cells.densify`);
padding rows are masked out of the loss. Numeric obs columns are cut into
`label_bins` quantile classes of the training cells. The minibatches reach
the devices through `grain_cells.feed.device_iterator`: while a step runs,
the next minibatch is already on its way and the one after is being read
(double buffering); checkpoints save the feed's state, that of the last
minibatch trained on.

Usage (from anywhere; the default config ships inside the package)::

    python -m grain_cells.examples.train --workdir=/tmp/run   # synthetic data
    python -m grain_cells.examples.train --workdir=/tmp/run \
        --config.data=a.h5ad,b.h5ad --config.label=cell_type \
        --config.worker_count=2
    python -m grain_cells.examples.train --config=my_config.py --workdir=/tmp/run
    python -m grain_cells.examples.train --measure_loader_overhead

or from Python::

    from grain_cells.examples.train import get_config, train_and_evaluate
    config = get_config()
    config.num_steps = 100
    result = train_and_evaluate(config, "/tmp/run")

**Held-out split.** The cells of `eval_data` files, or else `eval_fraction`
of the blocks of the training files, are never trained on; the final
accuracy is measured on them. `eval_split="last"` (default) holds out the
last blocks (in a plate-sorted file, the last plate: an unseen-plate split),
`"random"` blocks drawn by `grain_cells.split_by_fraction`. Both splits are
views of one source (`AnnDataSource.with_blocks`), so categorical codes
agree. With the synthetic data only `n_counts` (total counts, the default
label) is tied to the expression; `cell_line`, `drug` and `plate` are drawn
independently of it, so they train to chance level.

**Checkpoints and resume.** Every `checkpoint_every` steps (and at the end)
an orbax `CheckpointManager` in `<workdir>/checkpoints` saves the parameters,
the optimiser state and the data iterator's position together; the line
`checkpoint saved at step N` is printed once it is complete. Running the same
command again resumes from the latest checkpoint: the run continues with
exactly the minibatches and parameters of an uninterrupted one, bit for bit
(CPU; on GPU, XLA reductions may not be deterministic), also after SIGKILL.
A run already at `num_steps` says so and only evaluates. The worker count
may change between runs (same minibatches); other data, another per-process
batch or fetch configuration raise `grain_cells.errors.CheckpointMismatchError`;
start a new workdir instead.

**Several JAX processes.** The same command runs once per process::

    python -m grain_cells.examples.train --workdir=/shared/run \
        --num_processes=2 --process_id=0 --coordinator_address=host0:12355
    python -m grain_cells.examples.train --workdir=/shared/run \
        --num_processes=2 --process_id=1 --coordinator_address=host0:12355

(on Cloud TPU, SLURM or Open MPI, `--coordinator_address=auto` lets
`jax.distributed.initialize()` find the others). Each process reads its own
shard of the blocks (`BlockSampler(shard_options=ShardByJaxProcess())`; an
epoch skips `num_blocks % num_processes` blocks so shards stay equal), feeds
`batch_size / num_processes` cells per step into a global batch sharded over
a mesh of every device of every process, and the jitted step averages
gradients across processes (XLA all-reduce; Gloo on CPU), so parameters stay
replicated and identical. Every process writes its part of each checkpoint:
orbax the arrays, `grain_cells.checkpoint.IteratorSave` its iterator as
`process_<i>-of-<n>.json` (Grain's file). A checkpoint restores on another
number of processes when the per-process batch (`batch_size /
num_processes`) stays the same (e.g. `batch_size=64` on 2 processes, then 32
on 1): the rest of the data stream is handed over, every remaining cell once.
The data files and the workdir must be visible to every host under the same
paths.
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
fed by the loader and fed by minibatches already in memory (both through the
same device feed), then the loader alone on a new iterator (its workers
started afresh, `overhead_warmup` minibatches taken first, so no buffer
filled during the other phases is counted), and prints steps/s and cells/s
for each.
"""

# Nothing heavy at import: Grain's spawned workers import this package again
# when the trainer runs as `python -m grain_cells.examples.train`.

__all__ = ["get_config", "train_and_evaluate"]


def __getattr__(name: str):
    if name == "get_config":
        from grain_cells.examples.train.configs.default import get_config

        return get_config
    if name == "train_and_evaluate":
        from grain_cells.examples.train.train import train_and_evaluate

        return train_and_evaluate
    raise AttributeError(
        f"module 'grain_cells.examples.train' has no attribute {name!r}"
    )
