"""Writes `states_5f1fd87.json`: iterator states saved by an older grain_cells.

Run on commit 5f1fd87 (the last main before the sub-package restructure,
whose checkpoint stamps were `repr` texts), from a checkout of it:

    git worktree add /tmp/old 5f1fd87
    PYTHONPATH=/tmp/old python tests/data/make_states.py

For each pipeline of `PIPELINES` it writes the files of
`tests/conftest.write_files` into a temporary folder, takes `SKIP`
minibatches, saves `iterator.get_state()` and the row ids of the next
`AFTER` minibatches. `tests/pipeline/test_restore_stamps.py` builds the same
pipelines with the builders below (names public in both versions) on copies
of the files and checks that the current code refuses each state by name, as
an older grain_cells's (0.x restores only its own states).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

import grain_cells

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE / "states_5f1fd87.json"
OBS = ("plate", "cell_type", "idx")
SKIP = 7  # minibatches before the state is saved
AFTER = 3  # minibatches after it whose row ids are recorded


def _tokens():
    """`(ValueBinTokens, RankValueTokens, GeneVocabulary, corpus_stats)`."""
    try:  # since the sub-packages
        from grain_cells.tokens import (
            GeneVocabulary,
            RankValueTokens,
            ValueBinTokens,
            corpus_stats,
        )
    except ImportError:  # 5f1fd87: flat modules
        from grain_cells.corpus_stats import corpus_stats
        from grain_cells.value_bins import ValueBinTokens
        from grain_cells.vocabulary import GeneVocabulary

        from grain_cells.tokens import RankValueTokens
    return ValueBinTokens, RankValueTokens, GeneVocabulary, corpus_stats


def _source(paths, block_size=5):
    return grain_cells.AnnDataSource(paths, block_size=block_size, obs_columns=OBS)


def block_csr(paths, seed=3, fetch_factor=5, num_epochs=1):
    """`grain_cells.DataLoader` over a `BlockSampler`, CSR output."""
    source = _source(paths)
    sampler = grain_cells.BlockSampler(len(source), seed=seed, num_epochs=num_epochs)
    ops = grain_cells.fetch_operations(
        source, batch_size=4, fetch_factor=fetch_factor, seed=seed
    )
    return grain_cells.DataLoader(data_source=source, sampler=sampler, operations=ops)


def padded_dataset(paths, width=6, numeric_obs="float32", extra_dtype="float32"):
    """`cell_dataset`, padded sparse, X again as a dense extra matrix."""
    return grain_cells.cell_dataset(
        _source(paths),
        batch_size=4,
        fetch_factor=5,
        output=grain_cells.PaddedSparseOutput(width=width, truncate="first"),
        seed=1,
        num_epochs=2,
        extra={"dense": grain_cells.Layer("X", grain_cells.DenseOutput(extra_dtype))},
        numeric_obs=numeric_obs,
    )


def weighted(paths, seed=2, first_weight=1.0, epoch_blocks=40):
    """A `WeightedBlockSampler` (weights 1, 2, 3, ... by block)."""
    source = _source(paths)
    weights = np.arange(1, len(source) + 1, dtype=np.float64)
    weights[0] = first_weight
    sampler = grain_cells.WeightedBlockSampler(
        source, weights, epoch_blocks=epoch_blocks, seed=seed
    )
    ops = grain_cells.fetch_operations(source, batch_size=4, fetch_factor=5, seed=seed)
    return grain_cells.DataLoader(data_source=source, sampler=sampler, operations=ops)


def condition(paths, seed=4, remainder="pad", plate0=2.0):
    """`ConditionBlockSampler` with weights, `condition="plate"`."""
    view = grain_cells.condition_blocks(_source(paths), "plate")
    ops = grain_cells.fetch_operations(
        view,
        batch_size=4,
        fetch_factor=5,
        seed=seed,
        condition="plate",
        remainder=remainder,
    )
    weights = {f"plate{i}": 1.0 for i in range(8)}
    weights["plate0"] = plate0
    sampler = grain_cells.ConditionBlockSampler(
        view,
        "plate",
        blocks_per_fetch=ops[0].batch_size,
        worker_count=0,
        seed=seed,
        weights=weights,
        epoch_groups=12,
    )
    return grain_cells.DataLoader(data_source=view, sampler=sampler, operations=ops)


def value_bins(paths, n_bins=5, mlm_probability=0.25):
    """`ValueBinTokens` (random gene choice and masks keyed by fetch)."""
    value_bin_tokens, _, vocabulary, _ = _tokens()
    source = _source(paths)
    vocab = vocabulary.from_genes(source.var_names[1:])  # g0: not in it
    output = value_bin_tokens.for_source(
        source,
        vocab,
        length=6,
        n_bins=n_bins,
        selection="random",
        mlm_probability=mlm_probability,
        kernels="numpy",
    )
    return grain_cells.cell_dataset(
        source, batch_size=4, fetch_factor=5, output=output, seed=5
    )


def rank_value(paths, length=7):
    """`RankValueTokens` over medians of the files themselves."""
    _, rank_value_tokens, vocabulary, corpus_stats = _tokens()
    source = _source(paths)
    stats = corpus_stats(source, progress=False, cache=False)
    output = rank_value_tokens.for_source(
        source, vocabulary.from_genes(source.var_names), stats, length=length
    )
    return grain_cells.cell_dataset(
        source, batch_size=4, fetch_factor=5, output=output, seed=6
    )


PIPELINES = {
    "block_csr": block_csr,
    "padded_dataset": padded_dataset,
    "weighted": weighted,
    "condition": condition,
    "value_bins": value_bins,
    "rank_value": rank_value,
}


def state_of(iterator) -> dict:
    """The iterator's state as parsed JSON (a DataLoader's is bytes)."""
    state = iterator.get_state()
    return json.loads(state) if isinstance(state, bytes) else state


def main() -> None:
    """Saves every pipeline's state after `SKIP` minibatches."""
    sys.path.insert(0, str(HERE.parent))
    from conftest import write_files

    commit = subprocess.run(
        [
            "git",
            "-C",
            str(pathlib.Path(grain_cells.__file__).parent),
            "rev-parse",
            "HEAD",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    out = {"commit": commit, "skip": SKIP, "states": {}}
    with tempfile.TemporaryDirectory() as folder:
        paths = write_files(pathlib.Path(folder))
        for name, build in PIPELINES.items():
            iterator = iter(build(paths))
            for _ in range(SKIP):
                next(iterator)
            state = state_of(iterator)
            after = [next(iterator)["row_ids"].tolist() for _ in range(AFTER)]
            out["states"][name] = {"state": state, "next_row_ids": after}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT} (grain_cells at {commit})")


if __name__ == "__main__":
    main()
