"""The device feed: the loader's cells, in order, as device arrays; resume;
static shapes; densify; equal steps on two JAX processes."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import grain
import numpy as np
import portpicker
import pytest
from conftest import Truth

import grain_cells
from grain_cells.checkpoint import IteratorHandler, IteratorRestore, IteratorSave

jax = pytest.importorskip("jax")
from grain_cells.feed import device_iterator  # noqa: E402

WIDTH = 8


def make_loader(paths, worker_count=0, output=None, num_epochs=1):
    source = grain_cells.AnnDataSource(paths, block_size=8, obs_columns=["idx"])
    return grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=5, num_epochs=num_epochs),
        operations=grain_cells.fetch_operations(
            source,
            batch_size=32,
            fetch_factor=2,
            seed=5,
            output=output or grain_cells.PaddedSparseOutput(WIDTH),
        ),
        worker_count=worker_count,
    )


@pytest.fixture(scope="module")
def host_batches(csr_paths):
    """The minibatches of one epoch as the loader's own iterator yields them."""
    return [{k: np.array(v) for k, v in b.items()} for b in make_loader(csr_paths)]


def assert_same(device: dict, host: dict, keys=None):
    for key in keys or host:
        got = np.asarray(device[key])
        want = host[key]
        if want.dtype == np.int64:  # without x64, JAX holds int32
            assert np.array_equal(got.astype(np.int64), want), key
        else:
            assert got.dtype == want.dtype, key
            assert np.array_equal(got, want), key


@pytest.mark.parametrize(
    "worker_count",
    [0, pytest.param(2, marks=pytest.mark.slow)],  # workers start
)
def test_yields_the_host_minibatches_in_order(csr_paths, host_batches, worker_count):
    loader = make_loader(csr_paths, worker_count)
    with device_iterator(iter(loader)) as batches:
        got = list(batches)
    assert len(got) == len(host_batches) > 4
    for device, host in zip(got, host_batches, strict=True):
        assert isinstance(device["values"], jax.Array)
        assert_same(device, host)
    # The cells are the files' cells: every row once, values as anndata reads.
    rows = np.concatenate([h["row_ids"][h["mask"]] for h in host_batches])
    assert np.array_equal(np.sort(rows), np.arange(288))


@pytest.mark.parametrize(
    ("prefetch", "workers_after"),
    [(0, 0), (3, 0), pytest.param(1, 2, marks=pytest.mark.slow)],  # workers start
)
def test_state_is_the_last_minibatch_returned_and_restores(
    csr_paths, host_batches, prefetch, workers_after, tmp_path
):
    taken = 3
    with device_iterator(iter(make_loader(csr_paths)), prefetch=prefetch) as first:
        for _ in range(taken):
            next(first)
        handler = IteratorHandler(process_index=0, process_count=1)
        handler.save(tmp_path, args=IteratorSave(first))
        rest_of_first = list(first)
    assert_same(rest_of_first[0], host_batches[taken])
    second = device_iterator(iter(make_loader(csr_paths, workers_after)))
    with second:
        handler.restore(tmp_path, args=IteratorRestore(second))
        rest = list(second)
    assert len(rest) == len(host_batches) - taken
    for device, host in zip(rest, host_batches[taken:], strict=True):
        assert_same(device, host)


def test_state_passes_through_a_dataset_iterator():
    """A Grain dataset iterator's dict state becomes JSON bytes and back."""
    source = grain.MapDataset.range(10).map(lambda i: {"x": np.full(4, i)})
    iterator = source.to_iter_dataset().__iter__()
    feed = device_iterator(iterator)
    next(feed), next(feed)
    state = feed.get_state()
    assert isinstance(state, bytes) and json.loads(state)
    later = int(np.asarray(next(feed)["x"])[0])
    feed.set_state(state)
    assert int(np.asarray(next(feed)["x"])[0]) == later == 2


def test_densify_matches_anndata(csr_paths, host_batches):
    loader = make_loader(csr_paths)
    keys = ("values", "indices", "mask", "row_ids")
    with device_iterator(iter(loader), keys=keys, densify=12) as batches:
        got = list(batches)
    assert set(got[0]) == {"X", "mask", "row_ids"}
    source = grain_cells.AnnDataSource(csr_paths, block_size=8)
    truth = Truth(source, csr_paths)
    for device, host in zip(got, host_batches, strict=True):
        x = np.asarray(device["X"])
        real = host["mask"]
        np.testing.assert_array_equal(x[real], truth.x(host["row_ids"][real]))
        assert not x[~real].any()
    source.close()


def test_pinned_staging_gives_the_same_arrays(csr_paths, host_batches):
    with device_iterator(iter(make_loader(csr_paths)), pinned_staging=True) as b:
        device = next(b)
    assert_same(device, host_batches[0])
    assert device["values"].sharding.memory_kind == "device"


def test_csr_minibatches_are_refused_with_the_fix(csr_paths):
    feed = device_iterator(iter(make_loader(csr_paths, output=grain_cells.CsrOutput())))
    with pytest.raises(ValueError, match=r"CSR.*PaddedSparseOutput"):
        next(feed)
    feed.close()


def test_a_changed_shape_is_refused_by_entry():
    batches = iter([{"x": np.zeros((4, 3))}, {"x": np.zeros((3, 3))}])
    feed = device_iterator(batches)
    with pytest.raises(ValueError, match=r"'x' is float64\[3, 3\].*\[4, 3\]"):
        list(feed)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"prefetch": -1}, "prefetch must be a non-negative int", id="prefetch"
        ),
        pytest.param({"keys": "mask"}, "keys must be a sequence", id="keys-str"),
        pytest.param({"sharding": "data"}, "sharding must be a jax", id="sharding"),
        pytest.param({"densify": 0}, "densify must be a positive int", id="densify"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        device_iterator(iter([]), **kwargs)


def test_a_missing_key_is_named():
    feed = device_iterator(iter([{"mask": np.ones(4, bool)}]), keys=("mask", "values"))
    with pytest.raises(ValueError, match=r"no entry 'values' \(it has \['mask'\]\)"):
        next(feed)


def test_one_process_stops_without_padding():
    batches = iter([{"mask": np.ones(2, bool)}] * 3)
    feed = device_iterator(batches, equal_steps=True)
    assert len(list(feed)) == 3 and feed.padding_steps == 0


@pytest.mark.slow  # two JAX processes start and compile: seconds
def test_equal_steps_on_two_processes_with_unequal_shards(csr_paths, tmp_path):
    address = f"localhost:{portpicker.pick_unused_port()}"
    script = pathlib.Path(__file__).with_name("two_processes.py")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                address,
                str(i),
                str(tmp_path / f"{i}.json"),
                *csr_paths[:2],
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    results = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
    host = [r["host_steps"] for r in results]
    assert host[0] != host[1], host  # the shards are unequal
    for r in results:
        assert r["steps"] == max(host)
        assert r["padding"] == max(host) - r["host_steps"]
        assert r["shape"] == [32, 8]  # global: 16 rows from each process
    assert results[0]["totals"] == results[1]["totals"]
    assert sum(results[0]["totals"]) == 97 + 130
    assert sorted(results[0]["rows"]) == list(range(97))
    assert sorted(results[1]["rows"]) == list(range(130))  # each file's own rows
