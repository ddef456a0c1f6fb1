"""The data of a training run: files, split, genes, label and loaders.

Every choice here is a deterministic function of the files and the config,
so every JAX process (and every resumed run) makes the same ones.
"""

from __future__ import annotations

import dataclasses
import itertools

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

import grain_cells
from grain_cells.feed import DeviceIterator, device_iterator
from grain_cells.synthetic import cached_tahoe_like


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
    """The splits and the input format of a run.

    Attributes:
        train: The training blocks (a view of the files, with the gene subset).
        eval: The held-out blocks of the same files, or None; categorical
            codes agree with `train`'s.
        label: The target.
        width: `PaddedSparseOutput` width: `config.padded_width`, or fitted
            to the training cells (`PaddedSparseOutput().fit_to_source`).
        tokens: The token output when the model reads tokens, else None.
    """

    train: grain_cells.AnnDataSource
    eval: grain_cells.AnnDataSource | None
    label: Label
    width: int
    tokens: grain_cells.tokens.RankValueTokens | None = None

    @property
    def num_genes(self) -> int:
        """Input genes."""
        return self.train.num_genes

    @property
    def output(self):
        """The minibatch format."""
        if self.tokens is not None:
            return self.tokens
        return grain_cells.PaddedSparseOutput(self.width)

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """The minibatch entries the model uses."""
        if self.tokens is not None:
            return ("gene_ids", "attention_mask", "mask", self.label.key)
        return ("values", "indices", "mask", self.label.key)

    def close(self) -> None:
        """Closes the sources' file handles."""
        for source in (self.train, self.eval):
            if source is not None:
                source.close()


def _paths(text: str) -> list[str]:
    return [p for p in (s.strip() for s in text.split(",")) if p]


def data_paths(config: ml_collections.ConfigDict) -> tuple[list[str], list[str]]:
    """Training and held-out files; makes the synthetic file when none is given.

    In a multi-process run, process 0 writes the synthetic file and the others
    wait for it.
    """
    train, held_out = _paths(config.data), _paths(config.eval_data)
    if train:
        return train, held_out

    def make():
        return cached_tahoe_like(
            config.synthetic_cells,
            n_genes=config.synthetic_genes,
            mean_nnz=config.synthetic_mean_nnz,
            seed=config.synthetic_seed,
            cache_dir=config.synthetic_dir or None,
            progress=jax.process_index() == 0,
        )

    if jax.process_index() == 0:
        make()
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("grain_cells train: synthetic data")
    return [str(make())], held_out


def _split(
    source: grain_cells.AnnDataSource,
    num_train_files: int,
    config: ml_collections.ConfigDict,
) -> tuple[grain_cells.AnnDataSource, grain_cells.AnnDataSource | None]:
    """The training and held-out views of a source over all files."""
    if num_train_files < len(source.paths):  # held-out files
        cut = int(source.block_offsets[num_train_files])
        _, starts, stops = source.block_ranges(np.arange(len(source)))
        return (
            source.with_blocks(starts[:cut], stops[:cut]),
            source.with_blocks(starts[cut:], stops[cut:]),
        )
    if config.eval_fraction == 0:
        return source, None
    if config.eval_split == "random":
        splits = grain_cells.split_by_fraction(
            source,
            {"train": 1 - config.eval_fraction, "eval": config.eval_fraction},
            seed=config.seed,
        )
        return splits["train"], splits["eval"]
    cut = len(source) - round(len(source) * config.eval_fraction)
    if not 0 < cut < len(source):
        raise ValueError(
            f"eval_fraction={config.eval_fraction} of {len(source)} blocks leaves "
            f"{cut} training and {len(source) - cut} held-out blocks; both must "
            "be positive: change eval_fraction or block_size"
        )
    _, starts, stops = source.block_ranges(np.arange(len(source)))
    return (
        source.with_blocks(starts[:cut], stops[:cut]),
        source.with_blocks(starts[cut:], stops[cut:]),
    )


def prepare_data(config: ml_collections.ConfigDict) -> Data:
    """Opens the files, chooses the split, the genes, the label and the width."""
    train_paths, eval_paths = data_paths(config)
    paths = train_paths + eval_paths
    full = grain_cells.AnnDataSource(
        paths, block_size=config.block_size, obs_columns=[config.label]
    )
    try:
        train, _ = _split(full, len(train_paths), config)
        _, starts, stops = train.block_ranges(np.arange(len(train)))
        train.close()
        train_rows = _rows_of(starts, stops)
        label = _make_label(full, config, train_rows)
        take = np.linspace(0, train_rows.size - 1, config.gene_sample_cells)
        sample = train_rows[np.unique(take.round().astype(np.int64))]
        genes = _choose_genes(full.read(sample).X, config.num_genes)
    finally:
        full.close()
    source = grain_cells.AnnDataSource(
        paths, block_size=config.block_size, obs_columns=[config.label], genes=genes
    )
    train, held_out = _split(source, len(train_paths), config)
    if train is not source:
        source.close()
    # The padded width: given, or fitted as every pipeline fits it (a sample
    # of the training cells over the chosen genes; see PaddedSparseOutput).
    output = grain_cells.PaddedSparseOutput(config.padded_width or None)
    width = output.fit_to_source(train).width
    return Data(train, held_out, label, width, _tokens(train, config))


def _tokens(
    train: grain_cells.AnnDataSource, config
) -> grain_cells.tokens.RankValueTokens | None:
    """Rank-value tokens over the input genes, medians from the training cells."""
    if config.get("model", "mlp") != "transformer":
        return None
    vocab = grain_cells.tokens.GeneVocabulary.from_genes(train.var_names)
    stats = grain_cells.tokens.corpus_stats(train, progress=jax.process_index() == 0)
    return grain_cells.tokens.RankValueTokens.for_source(
        train, vocab, stats, length=config.token_length
    )


def _rows_of(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """The row ids of ranges `[starts[i], stops[i])`, in order."""
    lengths = stops - starts
    offsets = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) + offsets


def _make_label(
    full: grain_cells.AnnDataSource,
    config: ml_collections.ConfigDict,
    train_rows: np.ndarray,
) -> Label:
    categories = full.categories[config.label]
    if categories is not None:
        return Label(config.label, tuple(str(c) for c in categories), None)
    values = full.obs_values(config.label)[train_rows].astype(np.float64)
    edges = np.unique(
        np.quantile(values, np.linspace(0, 1, config.label_bins + 1)[1:-1])
    ).astype(np.float32)
    bounds = ["-inf", *(f"{e:g}" for e in edges), "inf"]
    names = tuple(f"[{a}, {b})" for a, b in itertools.pairwise(bounds))
    return Label(config.label, names, edges)


def _choose_genes(x, num_genes: int) -> np.ndarray | None:
    """The `num_genes` genes of highest mean (in file order); None: all."""
    mean = np.asarray(x.mean(axis=0)).ravel()
    if num_genes >= mean.size:
        return None
    return np.sort(np.argsort(-mean, kind="stable")[:num_genes])


def local_batch_size(config: ml_collections.ConfigDict) -> int:
    """Cells per minibatch of this process (the global batch, split evenly)."""
    n = jax.process_count()
    if config.batch_size % n or (config.batch_size // n) % jax.local_device_count():
        raise ValueError(
            f"batch_size={config.batch_size} must split evenly over {n} processes "
            f"of {jax.local_device_count()} devices each"
        )
    return config.batch_size // n


def _loader(
    source: grain_cells.AnnDataSource,
    config: ml_collections.ConfigDict,
    output,
    *,
    shuffle: bool,
    num_epochs: int | None,
    worker_count: int = 0,
) -> grain_cells.DataLoader:
    """A loader over this process's shard of `source`'s blocks."""
    seed = config.seed if shuffle else 0  # unused without shuffling
    return grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(
            source,
            shuffle=shuffle,
            seed=seed,
            num_epochs=num_epochs,
            shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
        ),
        operations=grain_cells.fetch_operations(
            source,
            batch_size=local_batch_size(config),
            fetch_factor=config.fetch_factor,
            shuffle=shuffle,
            seed=seed,
            output=output,
        ),
        worker_count=worker_count,
    )


def train_loader(
    data: Data, config: ml_collections.ConfigDict
) -> grain_cells.DataLoader:
    """The endless, shuffled, sharded stream of training minibatches."""
    return _loader(
        data.train,
        config,
        data.output,
        shuffle=True,
        num_epochs=None,
        worker_count=config.worker_count,
    )


def train_batches(
    data: Data, config: ml_collections.ConfigDict, sharding
) -> DeviceIterator:
    """The training minibatches as global device arrays, one copy ahead.

    `grain_cells.feed.device_iterator` over `train_loader`'s iterator: each
    process's minibatch becomes its rows of a global batch (`sharding`),
    copied while the previous step runs. Its state is the loader's after the
    last minibatch returned, so a checkpoint saved after step N resumes at
    minibatch N + 1.
    """
    keys = data.batch_keys + (("row_ids",) if config.dump_row_ids else ())
    return device_iterator(iter(train_loader(data, config)), sharding, keys=keys)


def eval_loader(
    data: Data, config: ml_collections.ConfigDict
) -> grain_cells.DataLoader | None:
    """One sequential pass over this process's share of the held-out blocks.

    None when nothing is held out. Sharding drops the last
    `held-out blocks % processes` blocks, so that shards stay equal.
    """
    if data.eval is None:
        return None
    return _loader(data.eval, config, data.output, shuffle=False, num_epochs=1)
