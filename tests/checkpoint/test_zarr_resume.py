"""Resume and restore on zarr stores, and which data a checkpoint restores on.

Over zarr copies of the conftest files (`tests/zarr_copies.py`): a state
restores exactly (the rest of the run, array for array), under another
worker count and under another process count through the orbax handler
(every remaining cell once). The training example killed with SIGKILL and
resumed on a zarr store ends with the parameters, bit for bit, of an
uninterrupted run on the `.h5ad` file the store was copied from:
tests/examples/test_train.py, which shares that module's reference run.

Which data a state restores on (the identity rule,
`grain_cells.io._identity.source_identity`): the source is identified
by content, not path, so a state restores on a copy of its files or stores
anywhere, and is refused (`CheckpointMismatchError` naming `data_source`) on
other data. A `.h5ad` file and a zarr store are identified by their bytes
(file sizes, storage layout, sampled values), which differ between the two
formats even for the same cells: a state saved on a `.h5ad` file is refused
on its zarr copy, and the other way round. Convert the data and restart the
epoch, or keep training on the format the checkpoint was saved on.
"""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest
from absl import flags
from conftest import write_files
from zarr_copies import copy_as, layout_params

from grain_cells.checkpoint import IteratorHandler, IteratorRestore, IteratorSave
from grain_cells.errors import CheckpointMismatchError

CONFIG = {"block_size": 4, "batch_size": 4, "fetch_factor": 4, "seed": 7}


@pytest.fixture(scope="module")
def stores(csr_paths, tmp_path_factory):
    made = {}

    def get(layout, paths=csr_paths, name="csr"):
        if (layout, name) not in made:
            folder = tmp_path_factory.mktemp(f"{name}-{layout}")
            made[layout, name] = copy_as(paths, folder, layout)
        return made[layout, name]

    return get


def loader(helpers, paths, workers=0, **kw):
    return helpers.build(paths, **{**CONFIG, **kw}, worker_count=workers)[2]


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        for key in b:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def state_at(helpers, paths, step, workers=0):
    iterator = iter(loader(helpers, paths, workers))
    helpers.take(iterator, step)
    state = iterator.get_state()
    helpers.close_iterator(iterator)
    return state


def rest_after(helpers, paths, state, workers=0):
    iterator = iter(loader(helpers, paths, workers))
    iterator.set_state(state)
    try:
        return helpers.take(iterator)
    finally:
        helpers.close_iterator(iterator)


@pytest.mark.parametrize(
    "layout",
    # One layout: resume is format-neutral above the reader, and v2 and zip
    # reads are covered by the loader tests (the suite's time is bounded).
    layout_params("zarr-v3-sharded"),
)
def test_resume_is_exact(stores, helpers, layout):
    paths = stores(layout)
    everything = helpers.run(loader(helpers, paths))
    for step in (3, 11):  # inside the first fetch, and mid-epoch
        rest = rest_after(helpers, paths, state_at(helpers, paths, step))
        assert_same_batches(rest, everything[step:])


@pytest.mark.slow  # starts workers twice (~20 s on 2 busy cores)
def test_restore_under_another_worker_count(stores, helpers):
    flags.FLAGS.mark_as_parsed()
    paths = stores("zarr-v3-sharded")
    everything = helpers.run(loader(helpers, paths))
    saved = state_at(helpers, paths, 5, workers=2)
    assert_same_batches(rest_after(helpers, paths, saved), everything[5:])
    restored = rest_after(helpers, paths, state_at(helpers, paths, 7), workers=2)
    assert_same_batches(restored, everything[7:])


def _real_rows(batches):
    if not batches:
        return np.zeros(0, np.int64)
    return np.concatenate([np.asarray(b["row_ids"])[b["mask"]] for b in batches])


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
@pytest.mark.parametrize(("old", "new"), [(2, 1), (1, 2)])
def test_another_process_count_visits_the_rest_once(
    stores, helpers, tmp_path, old, new
):
    from grain import sharding

    paths = stores("zarr-v3-sharded")

    def shards(count):
        return [
            iter(loader(helpers, paths, shard=sharding.ShardOptions(i, count)))
            for i in range(count)
        ]

    olds = shards(old)
    before = [helpers.take(it, 3) for it in olds]
    folder = tmp_path / "data"
    folder.mkdir()
    for i, it in enumerate(olds):
        IteratorHandler(process_index=i, process_count=old).save(
            folder, args=IteratorSave(it)
        )
    after = []
    for q, it in enumerate(shards(new)):
        handler = IteratorHandler(process_index=q, process_count=new)
        handler.restore(folder, args=IteratorRestore(it))
        after.append(helpers.take(it))
    seen = np.concatenate([_real_rows(b) for b in before + after])
    assert np.sort(seen).tolist() == list(range(helpers.N_CELLS))


# -- which data a state restores on ----------------------------------------------


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
def test_state_restores_on_a_copy_of_the_stores_elsewhere(stores, helpers, tmp_path):
    """Identity by content: a plain copy (new mtimes, new paths) restores."""
    paths = stores("zarr-v3")
    copies = []
    for p in paths:
        dst = tmp_path / pathlib.Path(p).name
        shutil.copytree(p, dst, copy_function=shutil.copy)
        copies.append(str(dst))
    everything = helpers.run(loader(helpers, paths))
    rest = rest_after(helpers, copies, state_at(helpers, paths, 6))
    assert_same_batches(rest, everything[6:])


@pytest.fixture(scope="module")
def other_data(tmp_path_factory):
    """Files of the same shape and genes with other values (another seed)."""
    return write_files(tmp_path_factory.mktemp("other"), seed=1)


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
def test_h5ad_state_refused_on_a_zarr_copy_of_other_data(
    stores, csr_paths, other_data, helpers
):
    state = state_at(helpers, csr_paths, 3)
    with pytest.raises(CheckpointMismatchError, match="data_source"):
        rest_after(helpers, stores("zarr-v3-sharded", other_data, "other"), state)


def test_h5ad_state_refused_on_a_zarr_copy_of_the_same_data(stores, csr_paths, helpers):
    """The rule: identity is of the bytes, and zarr's bytes are not h5ad's."""
    state = state_at(helpers, csr_paths, 3)
    with pytest.raises(CheckpointMismatchError, match="data_source"):
        rest_after(helpers, stores("zarr-v3-sharded"), state)
    zarr_state = state_at(helpers, stores("zarr-v2"), 3)
    with pytest.raises(CheckpointMismatchError, match="data_source"):
        rest_after(helpers, csr_paths, zarr_state)
