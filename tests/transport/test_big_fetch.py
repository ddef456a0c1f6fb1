"""Rings of more than 255 slots: a fetch of hundreds of minibatches (issue 35).

Slot numbers were one byte on the hand-back socket, so a ring held at most
255 slots; Grain materialises a whole fetch before queueing it, so a fetch
of 512 minibatches went out mostly as one-off segments after a 2 s wait.
"""

from __future__ import annotations

import gc
import pickle

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.transport import _ring as transport

N_GENES = 8


def batch(i: int) -> dict[str, np.ndarray]:
    return {"values": np.arange(100, dtype=np.float64) + i * 1e4}


def test_a_ring_of_600_slots_lends_and_takes_back_every_one():
    """600 minibatches held at once (slot numbers past one byte), all values
    right, then every slot handed back and free again."""
    ring = transport.SlotRing(max_slots=600, leases=600)
    try:
        held = [pickle.loads(pickle.dumps(ring.put(batch(i)))) for i in range(600)]
        assert len(ring._slots) == 600 and all(ring._busy)
        for i, got in enumerate(held):
            assert not got["values"].flags.owndata  # a lease of its slot
            np.testing.assert_array_equal(got["values"], batch(i)["values"])
        del held, got
        gc.collect()
        # 600 separate hand-backs fill the socket; what it could not take
        # goes with the trainer's next minibatch.
        for i in range(3):
            ring._collect(0.1)
            again = pickle.loads(pickle.dumps(ring.put(batch(i))))
            np.testing.assert_array_equal(again["values"], batch(i)["values"])
            del again
        ring._collect(0.1)
        # Ended leases go back in groups: fewer than a group wait in the view.
        view = transport._RINGS[ring.name]
        waiting = set(view.pending)
        assert len(waiting) < view.group
        busy = {i for i, b in enumerate(ring._busy) if b}
        assert busy == waiting, "slots past 255 did not come back"
        view.hand_back()
        ring._collect(0.1)
        assert not any(ring._busy), "slots past 255 did not come back"
    finally:
        ring.close()
        transport.release_dead_rings()


def _write(path, n_cells: int) -> None:
    """Row i holds i * 10 + j + 1 at a few genes j; obs "idx" is i."""
    rng = np.random.default_rng(0)
    mask = rng.random((n_cells, N_GENES)) < 0.5
    mask[:, 0] = True
    i, j = np.nonzero(mask)
    x = sp.csr_matrix(
        ((i * 10 + j + 1).astype(np.float32), (i, j)), shape=(n_cells, N_GENES)
    )
    names = [str(k) for k in range(n_cells)]
    obs = pd.DataFrame({"idx": np.arange(n_cells)}, index=names)
    anndata.AnnData(X=x, obs=obs).write_h5ad(path)


@pytest.mark.slow
def test_a_fetch_of_300_minibatches_goes_through_two_workers_rings(tmp_path):
    """Fetches of 300 minibatches with 2 workers: each minibatch arrives as a
    lease of its worker's slot (none copied out of a one-off segment), with
    every value right."""
    path = str(tmp_path / "cells.h5ad")
    n_cells = 2400
    _write(path, n_cells)
    source = grain_cells.AnnDataSource([path], block_size=4, obs_columns=["idx"])
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=1),
        operations=grain_cells.fetch_operations(source, batch_size=2, fetch_factor=300),
        worker_count=2,
    )
    truth = anndata.read_h5ad(path).X.toarray()
    seen, leased = [], 0
    with iter(loader) as iterator:
        for b in iterator:
            ids = b["row_ids"][b["mask"]]
            np.testing.assert_array_equal(b["obs/idx"][: ids.size], ids)
            x = sp.csr_matrix(
                (b["data"], b["indices"], b["indptr"]), shape=(2, N_GENES)
            ).toarray()
            np.testing.assert_array_equal(x[: ids.size], truth[ids])
            leased += not b["data"].flags.owndata
            seen.append(ids)
            del b
    assert sorted(np.concatenate(seen)) == list(range(n_cells))
    assert leased == len(seen), f"{len(seen) - leased} of {len(seen)} copied"
