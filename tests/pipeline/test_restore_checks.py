"""Refusals before data flows: samplers longer than their source, and restored
iterator states with a field out of range (each error names the field, its
value and the valid range)."""

from __future__ import annotations

import json
import re  # noqa: F401

import grain  # noqa: F401
import pytest
from grain import sharding

import grain_cells
from grain_cells.errors import CheckpointMismatchError
from grain_cells.pipeline import _state_checks as state_checks

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
