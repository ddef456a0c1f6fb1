"""grain_cells.checkpoint: orbax checkpoints of the data iterator that restore on
another JAX process count, and stay file-compatible with Grain's handler.

Processes are simulated in one: each old shard's iterator is saved by an
`IteratorHandler(process_index=i, process_count=P)` into one folder (as P
processes write into the checkpoint's folder), and each new shard restores
with `process_index=q, process_count=Q`. The two-process trainer runs of
`tests/test_train.py` do the same with real JAX processes.
"""

from __future__ import annotations

import json
import shutil

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
from grain import sharding

import grain_cells
from grain_cells.checkpoint import IteratorHandler, IteratorRestore, IteratorSave
from grain_cells.errors import CheckpointMismatchError

# 74 blocks of 4 cells (an even count: the epoch is the same for 1 and 2
# shards); fetches of 4 blocks, 4 minibatches of 4 cells.
CONFIG = {"block_size": 4, "batch_size": 4, "fetch_factor": 4, "seed": 7}


def shards(helpers, paths, count, num_epochs=1):
    return [
        iter(
            helpers.build(
                paths,
                **CONFIG,
                shard=sharding.ShardOptions(i, count),
                num_epochs=num_epochs,
            )[2]
        )
        for i in range(count)
    ]


def real_rows(batches) -> np.ndarray:
    if not batches:
        return np.zeros(0, np.int64)
    return np.concatenate([np.asarray(b["row_ids"])[b["mask"]] for b in batches])


def save_lock_step(helpers, paths, folder, count, steps):
    """`count` shards run `steps` minibatches each, then each saves its file."""
    olds = shards(helpers, paths, count)
    before = [helpers.take(it, steps) if steps else [] for it in olds]
    folder.mkdir()
    for i, it in enumerate(olds):
        handler = IteratorHandler(process_index=i, process_count=count)
        handler.save(folder, args=IteratorSave(it))
    return before


def restore_all(helpers, paths, folder, count):
    """Each of `count` new shards restored from `folder`: the rest of its stream."""
    out = []
    for q, it in enumerate(shards(helpers, paths, count)):
        handler = IteratorHandler(process_index=q, process_count=count)
        assert handler.restore(folder, args=IteratorRestore(it)) is it
        out.append(helpers.take(it))
    return out


@pytest.mark.parametrize("step", [0, 3, 6])
@pytest.mark.parametrize(("old", "new"), [(2, 1), (1, 2)])
def test_another_process_count_visits_the_rest_exactly_once(
    csr_paths, helpers, tmp_path, old, new, step
):
    folder = tmp_path / "data"
    before = save_lock_step(helpers, csr_paths, folder, old, step)
    names = sorted(p.name for p in folder.iterdir())
    assert names == [f"process_{i}-of-{old}.json" for i in range(old)]
    after = restore_all(helpers, csr_paths, folder, new)
    seen = np.concatenate([real_rows(b) for b in before + after])
    assert np.sort(seen).tolist() == list(range(helpers.N_CELLS))
    if step:
        assert all(after), "every new process gets a share of the rest"


def test_same_process_count_reads_its_own_file(csr_paths, helpers, tmp_path):
    folder = tmp_path / "data"
    save_lock_step(helpers, csr_paths, folder, 2, 3)
    reference = [helpers.take(it) for it in shards(helpers, csr_paths, 2)]
    restored = restore_all(helpers, csr_paths, folder, 2)
    for ref, got in zip(reference, restored, strict=True):
        assert [tuple(b["row_ids"]) for b in got] == [
            tuple(b["row_ids"]) for b in ref[3:]
        ]


def test_files_are_those_of_grains_handler(csr_paths, helpers, tmp_path):
    """Same names and bytes; each handler restores what the other saved."""
    *_, loader = helpers.build(csr_paths, **CONFIG)
    everything = helpers.run(loader)
    loader.set_epoch(0)  # each iter() is the next epoch: the same one again
    iterator = iter(loader)
    helpers.take(iterator, 5)
    # One manager binds one handler to an item: a folder per handler.
    for name, save in [
        ("ours", IteratorSave),
        ("grain", grain.checkpoint.CheckpointSave),
    ]:
        with ocp.CheckpointManager(tmp_path / name) as manager:
            manager.save(5, args=ocp.args.Composite(data=save(iterator)))
            manager.wait_until_finished()
    ours, grains = (tmp_path / name / "5" / "data" for name in ("ours", "grain"))
    names = sorted(p.name for p in ours.iterdir())
    assert names == sorted(p.name for p in grains.iterdir())
    assert "process_0-of-1.json" in names
    ours_bytes = (ours / "process_0-of-1.json").read_bytes()
    assert ours_bytes == (grains / "process_0-of-1.json").read_bytes()
    assert ours_bytes == iterator.get_state()

    for name, restore in [
        ("grain", IteratorRestore),
        ("ours", grain.checkpoint.CheckpointRestore),
    ]:
        target = iter(helpers.build(csr_paths, **CONFIG)[2])
        with ocp.CheckpointManager(tmp_path / name) as manager:
            manager.restore(5, args=ocp.args.Composite(data=restore(target)))
        got = helpers.take(target)
        assert [tuple(b["row_ids"]) for b in got] == [
            tuple(b["row_ids"]) for b in everything[5:]
        ], name


def test_dataset_iterator_state_is_json_like_grains(csr_paths, tmp_path):
    source = grain_cells.AnnDataSource(csr_paths, block_size=4)
    ds = grain_cells.cell_dataset(source, batch_size=4, fetch_factor=4, seed=1)
    it = iter(ds)
    next(it)
    IteratorHandler(process_index=0, process_count=1).save(
        tmp_path, args=IteratorSave(it)
    )
    text = (tmp_path / "process_0-of-1.json").read_text()
    assert text == json.dumps(it.get_state(), indent=4)
    expected = next(it)["row_ids"].tolist()
    other = iter(grain_cells.cell_dataset(source, batch_size=4, fetch_factor=4, seed=1))
    IteratorHandler(process_index=1, process_count=2).restore(
        tmp_path, args=IteratorRestore(other)
    )
    assert other.get_state()["position"]["count"] == 1  # a 1-shard dataset
    assert next(other)["row_ids"].tolist() == expected


# -- refusals -----------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_two_once(csr_paths, helpers, tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved_two") / "data"
    save_lock_step(helpers, csr_paths, folder, 2, 3)
    return folder


@pytest.fixture
def saved_two(saved_two_once, tmp_path):
    """Two processes' states at step 3, in a folder of this test's own."""
    return shutil.copytree(saved_two_once, tmp_path / "data")


def restore_one(helpers, paths, folder):
    (it,) = shards(helpers, paths, 1)
    IteratorHandler(process_index=0, process_count=1).restore(
        folder, args=IteratorRestore(it)
    )


def test_missing_process_file_is_named(csr_paths, helpers, saved_two):
    (saved_two / "process_1-of-2.json").unlink()
    with pytest.raises(CheckpointMismatchError) as e:
        restore_one(helpers, csr_paths, saved_two)
    assert str(saved_two) in str(e.value)
    assert "saved by 2 processes, but process_1-of-2.json missing" in str(e.value)


def test_states_at_different_steps_are_refused(csr_paths, helpers, saved_two):
    late = shards(helpers, csr_paths, 2)[1]
    helpers.take(late, 4)
    IteratorHandler(process_index=1, process_count=2).save(
        saved_two, args=IteratorSave(late)
    )
    with pytest.raises(CheckpointMismatchError) as e:
        restore_one(helpers, csr_paths, saved_two)
    message = str(e.value)
    assert str(saved_two) in message
    assert "step: 3 in process_0-of-2.json, 4 in process_1-of-2.json" in message


def test_states_of_another_pipeline_are_refused(csr_paths, helpers, saved_two):
    other = iter(
        helpers.build(
            csr_paths,
            **{**CONFIG, "seed": 8},
            shard=sharding.ShardOptions(1, 2),
        )[2]
    )
    helpers.take(other, 3)
    IteratorHandler(process_index=1, process_count=2).save(
        saved_two, args=IteratorSave(other)
    )
    with pytest.raises(CheckpointMismatchError, match=r"pipeline \(stamp\)"):
        restore_one(helpers, csr_paths, saved_two)


def test_plain_grain_states_restore_on_their_count_only(saved_two, csr_paths, helpers):
    for i in range(2):
        (saved_two / f"process_{i}-of-2.json").write_text(
            json.dumps({"version": 2, "last_seen_indices": {"0": 7}})
        )
    with pytest.raises(CheckpointMismatchError, match="not a grain_cells state"):
        restore_one(helpers, csr_paths, saved_two)


def test_no_state_and_mixed_counts_are_named(csr_paths, helpers, saved_two, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointMismatchError, match="no data iterator state"):
        restore_one(helpers, csr_paths, empty)
    (saved_two / "process_0-of-3.json").write_text("{}")
    with pytest.raises(
        CheckpointMismatchError, match=r"several process counts \[2, 3\]"
    ):
        (it,) = shards(helpers, csr_paths, 4)[:1]
        IteratorHandler(process_index=0, process_count=4).restore(
            saved_two, args=IteratorRestore(it)
        )


def test_handler_arguments_are_checked():
    with pytest.raises(ValueError, match="together"):
        IteratorHandler(process_index=0)
    with pytest.raises(ValueError, match=r"process_index must lie in \[0, 2\), got 2"):
        IteratorHandler(process_index=2, process_count=2)
