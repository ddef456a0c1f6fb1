"""Refusals before data flows: samplers longer than their source, and restored
iterator states with a field out of range (each error names the field, its
value and the valid range)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re  # noqa: F401

import grain
import numpy as np
import pytest
from grain import sharding

import grain_cells
import grain_cells.tokens
from grain_cells.errors import CheckpointMismatchError
from grain_cells.pipeline import CheckedIterator
from grain_cells.pipeline import _state_checks as state_checks
from grain_cells.pipeline._fetch import FetchConfig, SplitFetch

DATA = pathlib.Path(__file__).parent / "data"

CONFIG = {"block_size": 5, "batch_size": 4, "fetch_factor": 5, "seed": 3}


# -- 7. a sampler longer than its source ------------------------------------------


@pytest.mark.parametrize("extra", [1, 7])
@pytest.mark.parametrize("kind", ["block", "weighted"])
def test_sampler_longer_than_source_is_refused(csr_paths, extra, kind):
    source = grain_cells.AnnDataSource(csr_paths, block_size=5)
    n = len(source) + extra
    if kind == "block":
        sampler = grain_cells.BlockSampler(n, seed=0)
    else:
        sampler = grain_cells.WeightedBlockSampler(n, [1.0] * n, seed=0)
    with pytest.raises(ValueError, match=rf"num_blocks={n} .* has {len(source)}"):
        grain_cells.DataLoader(
            data_source=source,
            sampler=sampler,
            operations=grain_cells.fetch_operations(source, batch_size=4),
        )


def test_sampler_longer_than_source_is_refused_by_cell_dataset(csr_paths):
    source = grain_cells.AnnDataSource(csr_paths, block_size=5)
    sampler = grain_cells.BlockSampler(len(source) + 3)
    with pytest.raises(ValueError, match="wrap"):
        grain_cells.cell_dataset(source, batch_size=4, sampler=sampler)


def test_sampler_of_a_view_over_the_full_source_is_refused(csr_paths):
    source = grain_cells.AnnDataSource(csr_paths, block_size=5, obs_columns=["plate"])
    view = source.select(where={"plate": ["plate0"]})
    with pytest.raises(ValueError, match="wrap"):
        grain_cells.DataLoader(
            data_source=view,
            sampler=grain_cells.BlockSampler(len(source)),
            operations=grain_cells.fetch_operations(view, batch_size=4),
        )


# -- 10. every field of a restored state -------------------------------------------


def states_by_step(helpers, **change):
    """(loader, [state before minibatch i for every i], minibatches)."""
    *_, loader = helpers.build(helpers.paths, **{**CONFIG, **change})
    iterator = iter(loader)
    states, batches = [json.loads(iterator.get_state())], []
    for batch in iterator:
        batches.append(helpers.detach(batch))
        states.append(json.loads(iterator.get_state()))
    return loader, states, batches


@pytest.fixture
def h(helpers, csr_paths):
    helpers.paths = csr_paths
    return helpers


def fetch_lengths(states) -> dict[int, int]:
    """Minibatches of each fetch, by its number (from a real run).

    A state after a fetch's last minibatch points at the next fetch, so a
    fetch of `k` minibatches shows `minibatch` up to `k - 1`.
    """
    out: dict[int, int] = {}
    for s in states[:-1]:
        pos = s["position"]
        out[pos["fetch"]] = max(out.get(pos["fetch"], 0), pos["minibatch"] + 1)
    return out


def restore(loader, state) -> None:
    iter(loader).set_state(json.dumps(state).encode())


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({}, id="pad"),
        pytest.param({"remainder": "drop"}, id="drop"),
        pytest.param({"shard": sharding.ShardOptions(1, 2)}, id="shard-1-of-2"),
        pytest.param({"num_epochs": 2, "seed": 5}, id="two-epochs"),
    ],
)
def test_in_fetch_index_checked_against_that_fetch(h, change):
    loader, states, _ = states_by_step(h, **change)
    lengths = fetch_lengths(states)
    assert len(set(lengths.values())) > 1  # some fetches are shorter
    for state in states:
        restore(loader, state)  # every real state is accepted
    template = states[0]
    for n, count in lengths.items():
        state = json.loads(json.dumps(template))
        state["position"].update(fetch=n, minibatch=count)
        restore(loader, state)
        state["position"]["minibatch"] = count + 1
        with pytest.raises(CheckpointMismatchError) as e:
            restore(loader, state)
        message = str(e.value)
        assert f"position.minibatch = {count + 1}" in message
        assert f"[0, {count}]" in message


@pytest.mark.parametrize(
    "field, value, expected",
    [
        pytest.param("fetch", -1, "[0, ", id="negative-fetch"),
        pytest.param("fetch", 10**6, "[0, ", id="fetch-past-end"),
        pytest.param("fetch", "4", "'4'", id="fetch-as-string"),
        pytest.param("fetch", 4.0, "4.0", id="fetch-as-float"),
        pytest.param("fetch", True, "True", id="fetch-as-bool"),
        pytest.param("minibatch", -2, "[0, ", id="negative-in-fetch"),
        pytest.param("minibatch", None, "None", id="missing-in-fetch"),
        pytest.param("step", -1, "[0, inf]", id="negative-step"),
        pytest.param("count", 0, "[1, ", id="no-shards"),
        pytest.param("index", 3, "[0, 0]", id="index-past-count"),
        pytest.param("origin", -5, "[0, ", id="negative-origin"),
        pytest.param("pieces", [[[], 0]], "non-empty", id="empty-piece"),
        pytest.param("pieces", [[[10**6], 0]], "[0, ", id="piece-past-end"),
        pytest.param("pieces", {}, "[positions, skip]", id="pieces-dict"),
    ],
)
def test_bad_field_is_named(h, field, value, expected):
    loader, states, batches = states_by_step(h)
    state = states[7]
    state["position"][field] = value
    with pytest.raises(CheckpointMismatchError) as e:
        restore(loader, state)
    assert f"position.{field}" in str(e.value)
    assert expected in str(e.value)
    # The refused state left the iterator usable from the start.
    it = iter(loader)
    with pytest.raises(CheckpointMismatchError):
        it.set_state(json.dumps(state).encode())
    assert len(h.take(it)) == len(batches)


def test_position_missing(h):
    loader, _, _ = states_by_step(h)
    with pytest.raises(CheckpointMismatchError, match="field position = None"):
        restore(loader, {"grain_cells": loader.stamp})


def test_state_of_grain_dataloader_is_refused_by_name(h):
    """States of grain_cells < 2 (Grain's layout) say so rather than fail deep."""
    loader, _, _ = states_by_step(h)
    old = {"grain_cells": loader.stamp, "grain": {"next_index": 3}}
    with pytest.raises(CheckpointMismatchError, match="older grain_cells"):
        restore(loader, {k: v for k, v in old.items() if k != "grain_cells"})
    assert state_checks.STAMP == "grain_cells"


# -- 11. stamps: fingerprints of the configuration, and older states ---------------

OLD = json.loads((DATA / "states_5f1fd87.json").read_text())


def _load_make_states():
    spec = importlib.util.spec_from_file_location(
        "make_states", DATA / "make_states.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PIPELINES = _load_make_states().PIPELINES
# Every class whose repr a stamp of grain_cells 5f1fd87 held.
REPRS = [
    grain_cells.BlockSampler,
    grain_cells.WeightedBlockSampler,
    grain_cells.ConditionBlockSampler,
    SplitFetch,
    FetchConfig,
    grain_cells.CsrOutput,
    grain_cells.PaddedSparseOutput,
    grain_cells.DenseOutput,
    grain_cells.Layer,
    grain_cells.Obsm,
    grain_cells.tokens.RankValueTokens,
    grain_cells.tokens.ValueBinTokens,
]


def change_reprs(monkeypatch) -> None:
    """Gives every class of `REPRS` another repr."""
    for cls in REPRS:
        monkeypatch.setattr(cls, "__repr__", lambda self: "changed!", raising=True)


def set_state(iterator, state: dict) -> None:
    """`set_state` of a DataLoader's iterator (JSON bytes) or a dataset's (dict)."""
    if isinstance(iterator, CheckedIterator):
        iterator.set_state(json.dumps(state).encode())
    else:
        iterator.set_state(state)


def state_of(iterator) -> dict:
    """An iterator's state as it reads back from JSON."""
    state = iterator.get_state()
    return json.loads(state if isinstance(state, bytes) else json.dumps(state))


def same_batches(got, expected) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("reprs", ["same-reprs", "changed-reprs"])
@pytest.mark.parametrize("name", list(PIPELINES))
def test_state_of_5f1fd87_restores(csr_paths, helpers, monkeypatch, name, reprs):
    """A state saved by grain_cells 5f1fd87 (stamped by repr texts), restored
    on freshly written copies of its files, goes on where the old code went
    on and where an uninterrupted run of this code goes."""
    old = OLD["states"][name]
    assert isinstance(old["state"]["grain_cells"]["sampler"], str)  # a repr stamp
    everything = helpers.run(PIPELINES[name](csr_paths))
    if reprs == "changed-reprs":
        change_reprs(monkeypatch)
    restored = iter(PIPELINES[name](csr_paths))
    set_state(restored, old["state"])
    rest = helpers.take(restored)
    same_batches(rest, everything[OLD["skip"] :])
    assert [b["row_ids"].tolist() for b in rest[:3]] == old["next_row_ids"]


@pytest.mark.parametrize("name", list(PIPELINES))
def test_restore_survives_changed_reprs(csr_paths, helpers, monkeypatch, name):
    """The stamp records configuration, not repr: a repr may change."""
    everything = helpers.run(PIPELINES[name](csr_paths))
    iterator = iter(PIPELINES[name](csr_paths))
    helpers.take(iterator, 5)
    state = state_of(iterator)
    change_reprs(monkeypatch)
    restored = iter(PIPELINES[name](csr_paths))
    set_state(restored, state)
    same_batches(helpers.take(restored), everything[5:])


@pytest.mark.parametrize(
    "name, change, expected",
    [
        pytest.param(
            "block_csr",
            {"seed": 4},
            [
                "sampler: saved seed=3, now seed=4",
                "saved fetch.seed=3, now fetch.seed=4",
            ],
            id="seed",
        ),
        pytest.param(
            "block_csr",
            {"num_epochs": 2},
            ["sampler: saved num_epochs=1, now num_epochs=2"],
            id="num_epochs",
        ),
        pytest.param(
            "block_csr",
            {"fetch_factor": 10},
            ["operations: saved fetch.fetch_factor=5, now fetch.fetch_factor=10"],
            id="fetch_factor",
        ),
        pytest.param(
            "padded_dataset",
            {"width": 7},
            ["operations: saved output.width=6, now output.width=7"],
            id="output-width",
        ),
        pytest.param(
            "padded_dataset",
            {"numeric_obs": "native"},
            ["operations: saved ", "numeric_obs='float32'"],
            id="numeric_obs",
        ),
        pytest.param(
            "padded_dataset",
            {"extra_dtype": "float16"},
            ["operations: saved ", "extra", "'float16'"],
            id="extra-matrix",
        ),
        pytest.param(
            "weighted",
            {"first_weight": 5.0},
            ["sampler: saved weights=", "sha256:919c924dc874ed32"],
            id="weights",
        ),
        pytest.param(
            "weighted",
            {"epoch_blocks": 48},
            ["epoch_length: saved 40, now 48", "epoch_length=40, now epoch_length=48"],
            id="epoch_length",
        ),
        pytest.param(
            "condition",
            {"plate0": 3.0},
            ["sampler: saved weights=", "sha256:b40154df1076d8c1"],
            id="condition-weights",
        ),
        pytest.param(
            "condition",
            {"remainder": "drop"},
            ["operations: saved fetch.remainder='pad', now fetch.remainder='drop'"],
            id="remainder",
        ),
        pytest.param(
            "value_bins",
            {"n_bins": 7},
            ["operations: saved output.n_bins=5, now output.n_bins=7"],
            id="n_bins",
        ),
        pytest.param(
            "value_bins",
            {"mlm_probability": 0.5},
            ["operations: saved output.mlm", "=0.25, now output.mlm"],
            id="mlm",
        ),
        pytest.param(
            "rank_value",
            {"length": 9},
            ["operations: saved output.length=7, now output.length=9"],
            id="tokens-length",
        ),
    ],
)
@pytest.mark.parametrize("saved_by", ["5f1fd87", "this-version"])
def test_other_configuration_is_refused_by_name(
    csr_paths, helpers, name, change, expected, saved_by
):
    """States of 5f1fd87 and of this version name the field, saved and now."""
    if saved_by == "5f1fd87":
        state = OLD["states"][name]["state"]
    else:
        iterator = iter(PIPELINES[name](csr_paths))
        helpers.take(iterator, 7)
        state = state_of(iterator)
    other = iter(PIPELINES[name](csr_paths, **change))
    with pytest.raises(CheckpointMismatchError) as e:
        set_state(other, state)
    message = str(e.value)
    for text in expected:
        assert text in message, message
    assert "data_source" not in message, message


def test_stamp_is_a_fingerprint_of_the_configuration(csr_paths, helpers):
    *_, loader = helpers.build(csr_paths, **CONFIG)
    stamp = loader.stamp
    assert stamp["sampler"] == {
        "class": "BlockSampler",
        "num_blocks": 59,
        "shuffle": True,
        "seed": 3,
        "num_epochs": 1,
    }
    assert stamp["operations"] == {
        "fetch": {
            "batch_size": 4,
            "fetch_factor": 5,
            "block_size": 5,
            "shuffle": True,
            "seed": 3,
            "remainder": "pad",
            "numeric_obs": "native",
            "condition": None,
        },
        "output": {"class": "CsrOutput", "dtype": "float32"},
        "extra": {},
    }
    # A shard is not part of it.
    *_, sharded = helpers.build(csr_paths, **CONFIG, shard=sharding.ShardOptions(1, 2))
    assert sharded.stamp["sampler"] == stamp["sampler"]


class ReversedSampler:
    """A user's sampler: no `fingerprint()`, so stamped by its repr."""

    def __init__(self, num_blocks: int, tag: str):
        self.num_blocks, self.tag = num_blocks, tag

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, position: int) -> grain.RecordMetadata:
        return grain.RecordMetadata(position, self.num_blocks - 1 - position)

    def __repr__(self) -> str:
        return f"ReversedSampler(tag={self.tag}, shard_index=0, shard_count=1)"


class ScaledOutput:
    """A user's output: no `fingerprint()`, so stamped by its repr."""

    def __init__(self, scale: float):
        self.scale = scale

    def format(self, fetch, rows, batch_size):
        out = grain_cells.CsrOutput().format(fetch, rows, batch_size)
        out["data"] = out["data"] * self.scale
        return out

    def __repr__(self) -> str:
        return f"ScaledOutput(scale={self.scale})"


def test_user_components_are_stamped_by_repr(csr_paths, helpers):
    source = grain_cells.AnnDataSource(csr_paths, block_size=5)

    def dataset(tag="a", scale=2.0):
        return grain_cells.cell_dataset(
            source,
            batch_size=4,
            fetch_factor=5,
            sampler=ReversedSampler(len(source), tag),
            output=ScaledOutput(scale),
        )

    ds = dataset()
    assert ds.stamp["sampler"] == "ReversedSampler(tag=a)"  # shard left out
    assert ds.stamp["operations"]["output"] == "ScaledOutput(scale=2.0)"
    everything = helpers.run(ds)
    iterator = iter(ds)
    helpers.take(iterator, 6)
    state = state_of(iterator)
    restored = iter(dataset())
    restored.set_state(state)
    same_batches(helpers.take(restored), everything[6:])
    with pytest.raises(
        CheckpointMismatchError, match="sampler: saved tag=a, now tag=b"
    ):
        iter(dataset(tag="b")).set_state(state)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"operations: saved output='ScaledOutput\(scale=2.0\)', now "
        r"output='ScaledOutput\(scale=3.0\)'",
    ):
        iter(dataset(scale=3.0)).set_state(state)
