"""The pipeline's keywords are declared once: `grain_cells.pipeline.PipelineOptions`.

`loader`, `cell_dataset` and `fetch_operations` show its fields in their
signatures (what `help()` prints), check them in one place, and `loader`
takes the sampler choices (`sampler=`, `weights=`) that the explicit
spelling takes, with the same minibatches.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

import grain_cells
from grain_cells.pipeline import PipelineOptions

FETCH = [
    "batch_size",
    "fetch_factor",
    "output",
    "shuffle",
    "seed",
    "remainder",
    "extra",
    "numeric_obs",
    "condition",
]


@pytest.fixture(scope="module")
def source(csr_paths):
    return grain_cells.AnnDataSource(
        csr_paths, block_size=5, obs_columns=["idx", "cell_type"]
    )


def _keywords(entry) -> dict:
    params = inspect.signature(entry).parameters.values()
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}


@pytest.mark.parametrize(
    "entry, names, defaults",
    [
        pytest.param(grain_cells.fetch_operations, FETCH, {}, id="fetch_operations"),
        pytest.param(
            grain_cells.cell_dataset, None, {"worker_buffer_size": 1}, id="cell_dataset"
        ),
        pytest.param(grain_cells.loader, None, {"worker_buffer_size": 16}, id="loader"),
    ],
)
def test_signatures_list_the_options_of_one_dataclass(entry, names, defaults):
    fields = {f.name: f for f in dataclasses.fields(PipelineOptions)}
    names = names or list(fields)
    shown = _keywords(entry)
    assert [n for n in shown if n in fields] == names
    for name in names:
        default = fields[name].default
        expected = defaults.get(name, default)
        if default is dataclasses.MISSING:
            expected = inspect.Parameter.empty
        assert shown[name] == expected, name
    # Documented once, in the dataclass; the entry points refer to it.
    for name in fields:
        assert f"        {name}: " in PipelineOptions.__doc__
    assert "PipelineOptions" in entry.__doc__
    assert "fetch_factor: " not in entry.__doc__


def test_unknown_and_missing_keywords_are_refused_by_name(source):
    with pytest.raises(TypeError, match=r"fetch_operations\(\).*'num_epochs'"):
        grain_cells.fetch_operations(source, batch_size=5, num_epochs=2)
    with pytest.raises(TypeError, match=r"cell_dataset\(\).*'batch_sise'"):
        grain_cells.cell_dataset(source, batch_sise=5)
    with pytest.raises(TypeError, match=r"loader\(\) missing .*'batch_size'"):
        grain_cells.loader(source)
    with pytest.raises(ValueError, match="sampler= or weights="):
        grain_cells.cell_dataset(
            source,
            batch_size=5,
            weights=np.ones(len(source)),
            sampler=grain_cells.BlockSampler(source),
        )


def _rows(loader) -> list[int]:
    """The cells of every minibatch, in order."""
    return [r for b in loader for r in b["row_ids"][b["mask"]].tolist()]


def _cells(source, blocks) -> set[int]:
    _, starts, stops = source.block_ranges(blocks)
    return {r for a, b in zip(starts, stops, strict=True) for r in range(a, b)}


def test_loader_takes_weights_as_the_explicit_spelling_does(source):
    weights = np.arange(len(source), dtype=np.float64) % 3
    explicit = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.WeightedBlockSampler(source, weights, seed=4),
        operations=grain_cells.fetch_operations(source, batch_size=5, seed=4),
    )
    by_array = grain_cells.loader(source, batch_size=5, seed=4, weights=weights)
    by_function = grain_cells.loader(
        source, batch_size=5, seed=4, weights=lambda s: np.arange(len(s)) % 3
    )
    rows = _rows(explicit)
    assert rows == _rows(by_array) == _rows(by_function)
    assert not set(rows) & _cells(source, np.flatnonzero(weights == 0))
    assert by_array.stamp == explicit.stamp  # states restore across spellings


def test_loader_takes_a_sampler_or_a_function_of_its_split(source):
    sampler = grain_cells.BlockSampler(source, seed=2, shuffle=False)
    given = grain_cells.loader(source, batch_size=5, sampler=sampler, shuffle=False)
    assert _rows(given) == list(range(source.num_cells))
    split = ("a", {"a": 0.5, "b": 0.5})
    view = grain_cells.split_by_fraction(source, split[1])["a"]
    made = grain_cells.loader(
        source,
        batch_size=5,
        split=split,
        sampler=lambda s: grain_cells.WeightedBlockSampler(s, np.ones(len(s)), seed=1),
    )
    assert made.dataset.sampler.num_blocks == len(view)
    assert set(_rows(made)) <= _cells(view, np.arange(len(view)))
