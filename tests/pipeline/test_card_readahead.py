"""`grain_cells.DataLoader` reads ahead as far as its sampler's `readahead_cells`.

The card's spelling has no keyword of its own for it: the sampler's reaches
the fetch stage (it used to read ahead the default 16,384 cells whatever the
sampler said).
"""

from __future__ import annotations

import numpy as np
import pytest

import grain_cells


@pytest.mark.parametrize("sampler_source", [False, True], ids=["len", "source"])
def test_card_spelling_reads_ahead_as_far_as_its_sampler_says(
    csr_paths, monkeypatch, sampler_source
):
    monkeypatch.setattr(grain_cells.AnnDataSource, "hints_wanted", True)
    hinted = {}
    batches = {}
    for readahead in (0, 40):
        source = grain_cells.AnnDataSource(csr_paths, block_size=5)
        hinted[readahead] = calls = []
        source.advise = lambda keys, calls=calls: calls.append(np.asarray(keys))
        sampler = grain_cells.BlockSampler(
            source if sampler_source else len(source),
            seed=0,
            readahead_cells=readahead,
        )
        loader = grain_cells.DataLoader(
            data_source=source,
            sampler=sampler,
            operations=grain_cells.fetch_operations(
                source, batch_size=10, fetch_factor=1
            ),
        )
        batches[readahead] = [b["row_ids"] for b in loader]
    assert hinted[0] == []  # off, as the sampler was told
    assert hinted[40]  # on: 40 cells (4 fetches of 10) ahead
    ahead = np.concatenate(hinted[40])
    assert np.unique(ahead).size == ahead.size  # each block hinted once
    for a, b in zip(batches[0], batches[40], strict=True):
        np.testing.assert_array_equal(a, b)  # hints change no minibatch
