"""Refusals before data flows: samplers longer than their source, and restored
iterator states with a field out of range (each error names the field, its
value and the valid range)."""

from __future__ import annotations

import json
import re

import grain
import pytest
from grain import sharding

import grain_cells
from grain_cells import CheckpointMismatchError, state_checks

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
    """Minibatches of each fetch, by its first record (from a real run)."""
    out: dict[int, int] = {}
    for s in states:
        g = s["grain"]
        p = g["parent"]["next_index"]
        out[p] = max(out.get(p, 0), g["next_index_in_buffer"])
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
    for p, count in lengths.items():
        state = {"grain_cells": loader.stamp}
        state["grain"] = {"parent": {"next_index": p}, "next_index_in_buffer": count}
        restore(loader, state)
        state["grain"]["next_index_in_buffer"] = count + 1
        with pytest.raises(CheckpointMismatchError) as e:
            restore(loader, state)
        message = str(e.value)
        assert f"grain.next_index_in_buffer = {count + 1}" in message
        assert f"[0, {count}]" in message


@pytest.mark.parametrize(
    "field, value, expected",
    [
        pytest.param("next_index", -1, "[0, ", id="negative-position"),
        pytest.param("next_index", 10**6, "[0, ", id="position-past-end"),
        pytest.param("next_index", "4", "'4'", id="position-as-string"),
        pytest.param("next_index", 4.0, "4.0", id="position-as-float"),
        pytest.param("next_index", True, "True", id="position-as-bool"),
        pytest.param("next_index_in_buffer", -2, "[0, ", id="negative-in-fetch"),
        pytest.param("next_index_in_buffer", None, "None", id="missing-in-fetch"),
        pytest.param("parent", [], "grain.parent.next_index = None", id="parent-list"),
    ],
)
def test_bad_field_is_named(h, field, value, expected):
    loader, states, batches = states_by_step(h)
    state = states[7]
    if field == "next_index":
        state["grain"]["parent"][field] = value
        name = "grain.parent.next_index"
    else:
        state["grain"][field] = value
        name = f"grain.{field}"
    with pytest.raises(CheckpointMismatchError) as e:
        restore(loader, state)
    assert name in str(e.value)
    assert expected in str(e.value)
    # The refused state left the iterator usable from the start.
    it = iter(loader)
    with pytest.raises(CheckpointMismatchError):
        it.set_state(json.dumps(state).encode())
    assert len(h.take(it)) == len(batches)


def test_grain_part_missing(h):
    loader, _, _ = states_by_step(h)
    with pytest.raises(CheckpointMismatchError, match="field grain = None"):
        restore(loader, {"grain_cells": loader.stamp})


def worker_state(k0=4, k1=3, **top):
    state = {
        "next_index_in_cycle": 1,
        "next_index_in_datasets": 2,
        "iterators_in_use_indices": [0, 1],
        "iterators_in_use_states": [
            {"parent": {"next_index": 0}, "next_index_in_buffer": k0},
            {"parent": {"next_index": 0}, "next_index_in_buffer": k1},
        ],
        "exhausted": [0, 0],
        "future_states": {},
    }
    state.update(top)
    return state


@pytest.mark.parametrize(
    "state, name",
    [
        pytest.param(worker_state(k1=9), "iterators_in_use_states[1]", id="in-fetch"),
        pytest.param(
            worker_state(next_index_in_datasets=3), "next_index_in_datasets", id="next"
        ),
        pytest.param(
            worker_state(next_index_in_cycle=2), "next_index_in_cycle", id="cycle"
        ),
        pytest.param(
            worker_state(iterators_in_use_indices=[0, 5]), "in_use_indices[1]", id="ix"
        ),
        pytest.param(worker_state(exhausted=[0, 2]), "exhausted", id="exhausted"),
        pytest.param(
            worker_state(iterators_in_use_states=[{}]), "in_use_states", id="count"
        ),
        pytest.param(worker_state(future_states={"0": -3}), "future_states", id="neg"),
    ],
)
def test_worker_state_fields(h, state, name):
    source, sampler, _ = h.build(h.paths, worker_count=2, **CONFIG)
    kwargs = {
        "sampler": sampler,
        "data_source": source,
        "operations": grain_cells.fetch_operations(
            source, batch_size=4, fetch_factor=5, seed=3
        ),
        "worker_count": 2,
    }
    state_checks.check_state(worker_state(), **kwargs)  # the valid one passes
    with pytest.raises(CheckpointMismatchError, match=re.escape(name)):
        state_checks.check_state(state, **kwargs)


def test_plain_grain_pipeline_state_types_checked(h):
    """Without the batched fetch, fields are checked for type and sign."""
    source, sampler, _ = h.build(h.paths, **CONFIG)
    kwargs = {"sampler": sampler, "data_source": source, "worker_count": 0}
    ops = [grain.transforms.Batch(2)]
    state_checks.check_state({"next_index": 3}, operations=ops, **kwargs)
    with pytest.raises(
        CheckpointMismatchError, match=re.escape("grain.next_index = -3")
    ):
        state_checks.check_state({"next_index": -3}, operations=ops, **kwargs)
