"""Iterator semantics users expect: close, epochs, len, obs labels, one call.

`close()` ends an iterator (it used to restart its workers on the next
`next()`), each `iter()` of a finite loader starts the next epoch in a new
order (it used to repeat the first), `len(loader)` counts an epoch's
minibatches (it was a TypeError), and `grain_cells.loader(...)` gives the
explicit spelling's minibatches and states from one call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grain
import numpy as np
import pytest
import tqdm
from processes import mapped_rings, worker_pids

import grain_cells
from grain_cells import errors

CONFIG = {"block_size": 5, "batch_size": 4, "fetch_factor": 5, "seed": 3}


def rows(batches) -> np.ndarray:
    """Row ids of the real cells, in minibatch order."""
    return np.concatenate([b["row_ids"][b["mask"]] for b in batches])


def epoch_of(loader, helpers) -> list[dict]:
    return helpers.run(loader)


def segments(pids) -> set[str]:
    """The /dev/shm names of these processes' slot rings (`gcells_<pid>_...`);
    other test runs share /dev/shm."""
    return {
        n
        for n in os.listdir("/dev/shm")
        if n.startswith("gcells_") and int(n.split("_")[1]) in pids
    }


# -- close ------------------------------------------------------------------


def test_next_after_close_raises(csr_paths, helpers):
    """Reproduces issue 24: next() after close() went on (40 more batches)."""
    *_, loader = helpers.build(csr_paths, **CONFIG)
    iterator = iter(loader)
    first = helpers.take(iterator, 3)
    state = iterator.get_state()
    iterator.close()
    with pytest.raises(RuntimeError, match="closed") as raised:
        next(iterator)  # c95fdd4: 70 more minibatches, workers restarted
    assert isinstance(raised.value, errors.IteratorClosedError)
    with pytest.raises(errors.IteratorClosedError):  # and again
        next(iterator)
    assert iterator.get_state() == state  # still says where it stopped
    with pytest.raises(errors.IteratorClosedError):
        iterator.set_state(state)
    with pytest.raises(errors.IteratorClosedError):
        iterator.start_prefetch()
    iterator.close()  # twice is harmless
    # A new iterator restored from that state goes on where the closed stopped.
    *_, again = helpers.build(csr_paths, **CONFIG)
    resumed = iter(again)
    resumed.set_state(state)
    rest = helpers.take(resumed, 2)
    whole = helpers.run(helpers.build(csr_paths, **CONFIG)[2], 5)
    np.testing.assert_array_equal(rows(first + rest), rows(whole))


def test_with_block_closes(csr_paths, helpers):
    *_, loader = helpers.build(csr_paths, **CONFIG)
    with iter(loader) as iterator:
        next(iterator)
    with pytest.raises(errors.IteratorClosedError):
        next(iterator)


def test_cell_dataset_iterator_closes(csr_paths):
    source = grain_cells.AnnDataSource(csr_paths, block_size=5)
    ds = grain_cells.cell_dataset(source, batch_size=4, fetch_factor=5)
    iterator = iter(ds)
    next(iterator)
    iterator.close()
    with pytest.raises(errors.IteratorClosedError):
        next(iterator)


@pytest.mark.slow
def test_close_frees_workers_and_shared_memory(csr_paths, helpers):
    before_pids = worker_pids()
    *_, loader = helpers.build(csr_paths, worker_count=2, **CONFIG)
    iterator = iter(loader)
    helpers.take(iterator, 6)
    mine = worker_pids() - before_pids
    assert len(mine) == 2
    assert mapped_rings() >= mine  # this process maps both workers' rings
    iterator.close()
    assert not (mapped_rings() & mine)  # unmapped at once
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (worker_pids() & mine or segments(mine)):
        time.sleep(0.1)
    assert not (worker_pids() & mine)
    assert not segments(mine)  # no name left in /dev/shm
    with pytest.raises(errors.IteratorClosedError):
        next(iterator)
    assert not (worker_pids() - before_pids)  # no worker restarted


@pytest.mark.slow
def test_close_with_a_stopped_worker_returns_and_leaves_no_process(csr_paths, helpers):
    """A SIGSTOPped worker cannot stop itself: `close` kills it after a short
    grace (it used to wait for Grain's 25 s join, or a SIGCONT)."""
    import signal

    before_pids = worker_pids()
    *_, loader = helpers.build(csr_paths, worker_count=2, num_epochs=None)
    iterator = iter(loader)
    helpers.take(iterator, 6)
    mine = worker_pids() - before_pids
    assert len(mine) == 2
    stopped = min(mine)
    os.kill(stopped, signal.SIGSTOP)
    try:
        start = time.monotonic()
        iterator.close()
        took = time.monotonic() - start
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (worker_pids() & mine or segments(mine)):
            time.sleep(0.1)
        assert took < 5, f"close took {took:.1f} s with a stopped worker"
        assert not (worker_pids() & mine), "a worker outlived close"
        assert not segments(mine), "a killed worker's names stayed"
    finally:
        for pid in worker_pids() & mine:
            os.kill(pid, signal.SIGKILL)


# -- epochs -----------------------------------------------------------------


def test_second_iter_is_the_next_epoch(csr_paths, helpers):
    """Reproduces issue 24: iterating twice gave the same order."""
    _, sampler, loader = helpers.build(csr_paths, **CONFIG)
    first, second = epoch_of(loader, helpers), epoch_of(loader, helpers)
    a, b = rows(first), rows(second)
    assert not np.array_equal(a, b)  # c95fdd4: the same order
    n = helpers.N_CELLS
    np.testing.assert_array_equal(np.sort(a), np.arange(n))  # each cell once
    np.testing.assert_array_equal(np.sort(b), np.arange(n))
    assert loader.epoch == 2
    # Epoch e is a pure function of (seed, e): a fresh loader told the epoch.
    *_, fresh = helpers.build(csr_paths, **CONFIG)
    fresh.set_epoch(1)
    np.testing.assert_array_equal(rows(epoch_of(fresh, helpers)), b)
    # Its blocks are the sampler's epoch 1 (the stream past len(sampler)).
    source = grain_cells.AnnDataSource(csr_paths, block_size=5)
    starts = source.block_ranges(sampler.epoch_order(1))[1]
    first_cells = [r for r in b if r in set(starts.tolist())]
    assert sorted(first_cells) == sorted(starts.tolist())


def test_epochs_of_cell_dataset_and_num_epochs(csr_paths, helpers):
    source = grain_cells.AnnDataSource(csr_paths, block_size=5)
    ds = grain_cells.cell_dataset(
        source, batch_size=4, fetch_factor=5, seed=3, num_epochs=2
    )
    a, b = rows(helpers.run(ds)), rows(helpers.run(ds))
    # Each iter() is two sampler epochs: every cell twice, in a new order.
    n = helpers.N_CELLS
    assert np.array_equal(np.bincount(a, minlength=n), np.full(n, 2))
    assert np.array_equal(np.bincount(b, minlength=n), np.full(n, 2))
    assert not np.array_equal(a, b)
    ds.set_epoch(1)
    np.testing.assert_array_equal(rows(helpers.run(ds)), b)


def test_endless_streams_start_at_the_beginning(csr_paths, helpers):
    source = grain_cells.AnnDataSource(csr_paths, block_size=5)
    ds = grain_cells.cell_dataset(source, batch_size=4, fetch_factor=5, num_epochs=None)
    a, b = rows(helpers.run(ds, 30)), rows(helpers.run(ds, 30))
    np.testing.assert_array_equal(a, b)
    assert ds.epoch == 0
    with pytest.raises(ValueError, match="endless"):
        ds.set_epoch(1)
    with pytest.raises(TypeError, match="endless"):
        len(ds)


def test_state_records_the_epoch(csr_paths, helpers):
    *_, loader = helpers.build(csr_paths, **CONFIG)
    epoch_of(loader, helpers)
    iterator = iter(loader)  # epoch 1
    assert iterator.epoch == 1
    helpers.take(iterator, 7)
    state = iterator.get_state()
    assert json.loads(state)["position"]["epoch"] == 1
    rest = helpers.take(iterator)
    iterator.close()
    # Restored into a new loader's first iterator: epoch 1 goes on.
    *_, other = helpers.build(csr_paths, **CONFIG)
    restored = iter(other)
    restored.set_state(state)
    assert restored.epoch == 1 and other.epoch == 2
    np.testing.assert_array_equal(rows(helpers.take(restored)), rows(rest))
    restored.close()
    # The next iter() is epoch 2.
    *_, third = helpers.build(csr_paths, **CONFIG)
    third.set_epoch(2)
    np.testing.assert_array_equal(
        rows(epoch_of(other, helpers)), rows(epoch_of(third, helpers))
    )


def test_state_without_an_epoch_is_epoch_0(csr_paths, helpers):
    """States saved before epochs existed restore as before."""
    *_, loader = helpers.build(csr_paths, **CONFIG)
    iterator = iter(loader)
    helpers.take(iterator, 6)
    state = json.loads(iterator.get_state())
    rest = rows(helpers.take(iterator))
    del state["position"]["epoch"]
    *_, other = helpers.build(csr_paths, **CONFIG)
    other.set_epoch(5)
    restored = iter(other)
    restored.set_state(json.dumps(state).encode())
    assert restored.epoch == 0
    np.testing.assert_array_equal(rows(helpers.take(restored)), rest)


@pytest.mark.parametrize("epoch", [-1, "1", 1.5])
def test_bad_epoch_in_state(csr_paths, helpers, epoch):
    *_, loader = helpers.build(csr_paths, **CONFIG)
    iterator = iter(loader)
    state = json.loads(iterator.get_state())
    state["position"]["epoch"] = epoch
    with pytest.raises(errors.CheckpointMismatchError, match=r"position\.epoch"):
        iterator.set_state(json.dumps(state).encode())


def test_grain_dataloader_spelling_repeats_its_order(csr_paths, helpers):
    """The card's plain grain.DataLoader is Grain's: iter() starts over."""
    source = grain_cells.AnnDataSource(csr_paths, block_size=5)
    loader = grain.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=3),
        operations=grain_cells.fetch_operations(source, batch_size=4, seed=3),
    )
    a = rows(helpers.take(iter(loader), 10))
    np.testing.assert_array_equal(a, rows(helpers.take(iter(loader), 10)))


# -- len --------------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({}, id="pad"),
        pytest.param({"remainder": "drop"}, id="drop"),
        pytest.param({"num_epochs": 2}, id="two-sampler-epochs"),
        pytest.param({"shard": grain.sharding.ShardOptions(1, 3)}, id="shard"),
        pytest.param({"shuffle": False}, id="in-order"),
        pytest.param({"block_size": 4, "batch_size": 8}, id="other-blocks"),
    ],
)
def test_len_is_an_epochs_minibatches(csr_paths, helpers, change):
    config = {**CONFIG, **change}
    *_, loader = helpers.build(csr_paths, **config)
    for _ in range(2):  # epoch 0, then epoch 1 (other short-block places)
        expected = len(loader)
        assert len(epoch_of(loader, helpers)) == expected


def test_len_of_a_weighted_stream(csr_paths, helpers):
    source = grain_cells.AnnDataSource(csr_paths, block_size=5, obs_columns=["plate"])
    sampler = grain_cells.WeightedBlockSampler(
        source, grain_cells.balanced_block_weights(source, "plate"), seed=1
    )
    ds = grain_cells.cell_dataset(source, batch_size=4, sampler=sampler)
    expected = len(ds)
    assert len(helpers.run(ds)) == expected


def test_len_with_a_condition_is_a_type_error(csr_paths):
    source = grain_cells.AnnDataSource(csr_paths, block_size=5, obs_columns=["plate"])
    sampler = grain_cells.ConditionBlockSampler(source, "plate", blocks_per_fetch=4)
    ds = grain_cells.cell_dataset(
        source, batch_size=4, fetch_factor=5, sampler=sampler, condition="plate"
    )
    with pytest.raises(TypeError, match="condition"):
        len(ds)


def test_tqdm_shows_a_total(csr_paths, helpers):
    *_, loader = helpers.build(csr_paths, **CONFIG)
    bar = tqdm.tqdm(loader, disable=True)
    assert bar.total == len(loader) > 0
    assert sum(1 for _ in bar) == bar.total


@pytest.mark.parametrize("num_epochs", [1, 2])
def test_an_iterators_len_is_what_it_has_left(csr_paths, helpers, num_epochs):
    """`len(iterator)` starts at `len(loader)` and counts down to 0, so a
    `tqdm(iter(loader))` bar ends at its total; a restored iterator counts
    from its state."""
    *_, loader = helpers.build(csr_paths, **{**CONFIG, "num_epochs": num_epochs})
    total = len(loader)
    iterator = iter(loader)
    assert len(iterator) == total > 0 and bool(iterator)
    for k in range(3):
        next(iterator)
        assert len(iterator) == total - k - 1
    state = iterator.get_state()
    bar = tqdm.tqdm(iterator, disable=True)
    assert bar.total == total - 3
    assert sum(1 for _ in bar) == bar.total
    assert len(iterator) == 0 and bool(iterator)
    again = iter(loader)
    again.set_state(state)
    assert len(again) == total - 3


def test_an_endless_iterator_has_no_len_but_is_true(csr_paths, helpers):
    *_, loader = helpers.build(csr_paths, **{**CONFIG, "num_epochs": None})
    iterator = iter(loader)
    with pytest.raises(TypeError, match="endless"):
        len(iterator)
    assert bool(iterator)
    assert tqdm.tqdm(iterator, disable=True).total is None


# -- obs labels -------------------------------------------------------------


def test_obs_frame_gives_labels(csr_paths, helpers):
    *_, loader = helpers.build(csr_paths, **CONFIG)
    truth = helpers.Truth(loader.dataset.source, csr_paths)
    for batch in helpers.run(loader, 6):
        frame = loader.obs_frame(batch)
        ids = batch["row_ids"][batch["mask"]]
        np.testing.assert_array_equal(frame.index.to_numpy(), ids)
        for column in ("plate", "cell_type"):
            assert list(frame[column].astype(object)) == list(truth.obs(ids, column))
        np.testing.assert_array_equal(frame["idx"].to_numpy(), ids)


# -- grain_cells.loader -----------------------------------------------------


def test_one_call_is_the_explicit_spelling(csr_paths, helpers):
    one = grain_cells.loader(
        csr_paths,
        batch_size=4,
        fetch_factor=5,
        block_size=5,
        seed=3,
        obs_columns=["plate", "cell_type", "idx"],
    )
    *_, explicit = helpers.build(csr_paths, **CONFIG)
    assert len(one) == len(explicit)
    a, b = helpers.run(one, 9), helpers.run(explicit, 9)
    assert [sorted(x) for x in a] == [sorted(x) for x in b]
    for x, y in zip(a, b, strict=True):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
    # States are interchangeable: the stamps are equal.
    assert one.stamp == explicit.stamp
    iterator = iter(one)
    helpers.take(iterator, 4)
    state = iterator.get_state()
    rest = rows(helpers.take(iterator))
    restored = iter(explicit)
    restored.set_state(state)
    np.testing.assert_array_equal(rows(helpers.take(restored)), rest)


def test_one_call_split(csr_paths, helpers):
    fractions = {"train": 0.75, "val": 0.25}
    train = grain_cells.loader(
        csr_paths, batch_size=4, block_size=5, split=("train", fractions), seed=1
    )
    val = grain_cells.loader(
        csr_paths, batch_size=4, block_size=5, split=("val", fractions), seed=2
    )
    source = grain_cells.AnnDataSource(csr_paths, block_size=5)
    views = grain_cells.split_by_fraction(source, fractions)
    for loader, name in ((train, "train"), (val, "val")):
        got = np.sort(rows(helpers.run(loader)))
        want = np.sort(
            rows(helpers.run(grain_cells.cell_dataset(views[name], batch_size=4)))
        )
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"split": "train"}, "name, fractions", id="split-not-a-pair"),
        pytest.param(
            {"split": ("test", {"a": 0.5, "b": 0.5})},
            "names no split",
            id="no-such-split",
        ),
        pytest.param({"batch_size": 0}, "batch_size", id="batch-size"),
    ],
)
def test_one_call_refuses(csr_paths, kwargs, match):
    with pytest.raises(ValueError, match=match):
        grain_cells.loader(csr_paths, **{"batch_size": 4, "block_size": 5, **kwargs})


def test_one_call_with_a_source_refuses_source_arguments(csr_paths):
    source = grain_cells.AnnDataSource(csr_paths, block_size=5, obs_columns=["plate"])
    loader = grain_cells.loader(source, batch_size=5, obs_columns=["plate"])
    assert loader.dataset.source is source
    with pytest.raises(ValueError, match=r"\['block_size', 'layer'\]"):
        grain_cells.loader(source, batch_size=5, block_size=8, layer="counts")


def test_shard_change_in_a_later_epoch(csr_paths, helpers):
    """2 shards at epoch 1 -> 1 shard: the rest of epoch 1, each cell once."""
    config = {**CONFIG, "block_size": 4}  # 74 blocks: equal epochs for 1 and 2

    def shard_iterators(count, epoch):
        out = []
        for i in range(count):
            shard = grain.sharding.ShardOptions(i, count)
            *_, loader = helpers.build(csr_paths, shard=shard, **config)
            loader.set_epoch(epoch)
            out.append(iter(loader))
        return out

    olds = shard_iterators(2, 1)
    before = [helpers.take(it, 3) for it in olds]
    *_, loader = helpers.build(csr_paths, **config)
    one = iter(loader)  # epoch 0 until restored
    one.set_state(olds[0].get_state())
    assert one.epoch == 1 and loader.epoch == 2
    after = helpers.take(one)
    seen = np.concatenate([rows(b) for b in [*before, after]])
    np.testing.assert_array_equal(np.sort(seen), np.arange(helpers.N_CELLS))
    # And it is epoch 1's cells, not epoch 0's: epoch 0 from the same state
    # (its epoch edited) continues differently.
    state = json.loads(olds[0].get_state())
    state["position"]["epoch"] = 0
    *_, other = helpers.build(csr_paths, **config)
    zero = iter(other)
    zero.set_state(json.dumps(state).encode())
    assert not np.array_equal(rows(helpers.take(zero)), rows(after))


def test_processes_saved_in_different_epochs_are_refused(csr_paths, helpers, tmp_path):
    """A hand-over to another process count needs one lock-step save."""
    from grain_cells.checkpoint import IteratorHandler, IteratorRestore, IteratorSave

    config = {**CONFIG, "block_size": 4}
    folder = tmp_path / "data"
    folder.mkdir()
    for i, epoch in enumerate((0, 1)):
        shard = grain.sharding.ShardOptions(i, 2)
        *_, loader = helpers.build(csr_paths, shard=shard, **config)
        loader.set_epoch(epoch)
        iterator = iter(loader)
        helpers.take(iterator, 3)
        handler = IteratorHandler(process_index=i, process_count=2)
        handler.save(folder, args=IteratorSave(iterator))
    *_, loader = helpers.build(csr_paths, **config)
    handler = IteratorHandler(process_index=0, process_count=1)
    with pytest.raises(
        errors.CheckpointMismatchError,
        match=r"epoch: 0 in process_0-of-2\.json, 1 in process_1-of-2\.json",
    ):
        handler.restore(folder, args=IteratorRestore(iter(loader)))


SCRIPT = """
import sys, tqdm, grain_cells
if __name__ == "__main__":
    loader = grain_cells.loader(sys.argv[1:], batch_size=4, block_size=4,
                                num_epochs=None, worker_count=2)
    bar = iter(tqdm.tqdm(loader, disable=True))
    next(bar)
    print("left running")
"""


@pytest.mark.slow
def test_exit_with_a_running_iterator_is_quiet(csr_paths, tmp_path):
    """An iterator left running in a tqdm bar at exit closes without noise."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(script), *csr_paths],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "left running"
    assert "Exception ignored" not in done.stderr, done.stderr
