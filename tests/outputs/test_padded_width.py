"""`PaddedSparseOutput`: a width fitted from the data, truncation never silent.

Files written by anndata where cell i stores a known number of values (its
count encodes the row) and the value at (i, j) is `i * 10_000 + j + 1`, so
every kept value names its cell and gene; expected arrays come from
`anndata.read_h5ad`.
"""

from __future__ import annotations

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells import PaddedSparseOutput, errors
from grain_cells.outputs import _padded

N_GENES = 2000


def write_cells(path, counts, *, seed=0) -> str:
    """Cell i stores `counts[i]` values at random genes: `i * 10_000 + j + 1`."""
    rng = np.random.default_rng(seed)
    rows = np.repeat(np.arange(len(counts)), counts)
    cols = np.concatenate(
        [np.sort(rng.choice(N_GENES, k, replace=False)) for k in counts]
    )
    x = sp.csr_matrix(
        ((rows * 10_000 + cols + 1).astype(np.float32), (rows, cols)),
        shape=(len(counts), N_GENES),
    )
    obs = pd.DataFrame(
        {"kind": pd.Categorical(["a", "b"] * (len(counts) // 2))},
        index=[f"c{i}" for i in range(len(counts))],
    )
    var = pd.DataFrame(index=[f"g{j}" for j in range(N_GENES)])
    anndata.AnnData(X=x, obs=obs, var=var, layers={"counts": x * 2}).write_h5ad(path)
    return str(path)


def batches_of(source, output, **kwargs) -> tuple[list[dict], int]:
    """Every minibatch of one unshuffled pass, and the width used."""
    ds = grain_cells.cell_dataset(
        source, batch_size=16, fetch_factor=2, shuffle=False, output=output, **kwargs
    )
    it = iter(ds)
    try:
        out = [{k: np.array(v) for k, v in b.items()} for b in it]
    finally:
        it.close()
    return out, ds.split.config.output.width


def check_against_anndata(batches, path, width) -> None:
    """Kept values are each cell's `width` largest (all when it fits)."""
    x = anndata.read_h5ad(path).X.tocsr()
    for b in batches:
        for r in np.flatnonzero(b["mask"]):
            row = x[b["row_ids"][r]]
            assert b["nnz"][r] == row.nnz
            assert b["truncated"][r] == (row.nnz > width)
            keep = np.argsort(-row.data, kind="stable")[:width]
            n = keep.size
            got = sorted(zip(b["indices"][r, :n], b["values"][r, :n], strict=True))
            want = sorted(zip(row.indices[keep], row.data[keep], strict=True))
            assert got == want


def test_silent_truncation_is_reported(tmp_path):
    """The issue's reproduction: 64 cells of ~1,200 values, width=512.

    At c95fdd4 every cell was cut to 512 values without a word.
    """
    counts = np.full(64, 1200) + np.arange(64)
    path = write_cells(tmp_path / "wide.h5ad", counts)
    source = grain_cells.AnnDataSource(path, block_size=16)
    with pytest.warns(
        errors.TruncationWarning,
        match=r"PaddedSparseOutput\(width=512\): 16 of 16 cells of a minibatch have "
        r"more stored values than width \(up to 12\d\d, cell \d+\); each keeps its "
        r"512 largest values",
    ) as seen:
        batches, width = batches_of(source, PaddedSparseOutput(width=512))
    assert len(seen) == 1  # once, not once per minibatch
    assert width == 512
    assert sum(int(b["truncated"].sum()) for b in batches) == 64
    check_against_anndata(batches, path, 512)


def test_strict_refusal_names_cell_count_and_width(tmp_path):
    counts = np.full(40, 3)
    counts[37] = 20
    path = write_cells(tmp_path / "one_wide.h5ad", counts)
    source = grain_cells.AnnDataSource(path, block_size=8)
    with pytest.raises(
        errors.TruncationError,
        match=r"cell 37 \(global row id\) has 20 stored values, more than "
        r"PaddedSparseOutput\(width=8\) holds \(truncate='error'\)",
    ):
        batches_of(source, PaddedSparseOutput(width=8, truncate="error"))


@pytest.mark.parametrize(
    ("quantile", "expected"),
    [
        # 300 cells storing 2i + 1 values: the 0.999 quantile ("higher") is
        # the widest cell, 599 -> 640; the median cell (299) -> 384.
        pytest.param(0.999, 640, id="default-quantile"),
        pytest.param(1.0, 640, id="max"),
        pytest.param(0.5, 384, id="median"),
    ],
)
def test_width_fitted_from_the_data(tmp_path, quantile, expected):
    counts = 2 * np.arange(300) + 1
    path = write_cells(tmp_path / "ramp.h5ad", counts)
    source = grain_cells.AnnDataSource(path, block_size=16)
    truth = np.diff(anndata.read_h5ad(path).X.indptr)  # the oracle's counts
    rule = max(128, -(-int(np.quantile(truth, quantile, method="higher")) // 128) * 128)
    assert rule == expected
    output = PaddedSparseOutput(quantile=quantile)
    assert output.fit_to_source(source).width == expected
    # The median's width cuts 108 of the 300 cells, fewer than the half a
    # fit at quantile=0.5 leaves out by design: no TruncationWarning (a
    # fitted width warns only when it cuts clearly more; issue 34).
    batches, width = batches_of(source, output)
    assert width == expected
    assert all(b["values"].shape == (16, expected) for b in batches)
    check_against_anndata(batches, path, expected)


def test_width_counts_the_selected_genes_only(tmp_path):
    counts = np.full(32, 600)
    path = write_cells(tmp_path / "genes.h5ad", counts)
    genes = [f"g{j}" for j in range(0, N_GENES, 10)]  # a tenth: ~60 per cell
    source = grain_cells.AnnDataSource(path, block_size=16, genes=genes)
    assert PaddedSparseOutput().fit_to_source(source).width == 128
    full = grain_cells.AnnDataSource(path, block_size=16)
    assert PaddedSparseOutput().fit_to_source(full).width == 640


def test_layer_width_fitted_from_the_layer(tmp_path):
    counts = np.r_[np.full(16, 100), np.full(16, 300)]
    path = write_cells(tmp_path / "layer.h5ad", counts)
    source = grain_cells.AnnDataSource(path, block_size=16)
    extra = {"counts": grain_cells.Layer("counts", PaddedSparseOutput())}
    ds = grain_cells.cell_dataset(
        source, batch_size=16, fetch_factor=1, shuffle=False, extra=extra
    )
    assert ds.split.extra["counts"].spec.output.width == 384
    assert ds.split.fingerprint()["extra"]["counts"]["output"]["width"] == 384
    b = next(iter(ds))
    assert b["counts/values"].shape == (16, 384)
    assert not b["counts/truncated"].any()


def test_sample_is_evenly_spaced_blocks(tmp_path):
    counts = np.full(9000, 2)
    path = write_cells(tmp_path / "many.h5ad", counts)
    source = grain_cells.AnnDataSource(path, block_size=16)  # 563 blocks
    starts, stops = _padded.sample_ranges(source)
    assert starts.size == _padded.SAMPLE_CELLS // 16 == 256
    assert starts[0] == 0 and stops[-1] == 9000  # first and last blocks
    assert (np.diff(starts) >= 16).all()  # no block twice
    again = _padded.sample_ranges(grain_cells.AnnDataSource(path, block_size=16))
    np.testing.assert_array_equal(starts, again[0])  # deterministic


def test_restore_refits_the_same_width_and_refuses_another(tmp_path):
    counts = 2 * np.arange(96) + 200
    path = write_cells(tmp_path / "restore.h5ad", counts)
    source = grain_cells.AnnDataSource(path, block_size=8)

    def dataset(output):
        return grain_cells.cell_dataset(
            source, batch_size=8, fetch_factor=2, seed=3, output=output
        )

    it = iter(dataset(PaddedSparseOutput()))
    for _ in range(3):
        next(it)
    state = it.get_state()
    rest = [b["values"].copy() for b in it]
    it.close()
    # A new pipeline refits (same sample, same width) and goes on identically.
    again = iter(dataset(PaddedSparseOutput()))
    again.set_state(state)
    got = [b["values"].copy() for b in again]
    again.close()
    assert len(got) == len(rest)
    for a, b in zip(got, rest, strict=True):
        np.testing.assert_array_equal(a, b)
    assert rest[0].shape[1] == 512  # the widest cell stores 390 values
    other = iter(dataset(PaddedSparseOutput(width=640)))
    with pytest.raises(errors.CheckpointMismatchError, match="width"):
        other.set_state(state)
    other.close()


@pytest.mark.slow
def test_workers_receive_the_fitted_width(tmp_path):
    counts = 2 * np.arange(96) + 200
    path = write_cells(tmp_path / "workers.h5ad", counts)
    source = grain_cells.AnnDataSource(path, block_size=8)
    one, w0 = batches_of(source, PaddedSparseOutput(), worker_count=0)
    two, w2 = batches_of(source, PaddedSparseOutput(), worker_count=2)
    assert w0 == w2 == 512
    assert len(one) == len(two)
    for a, b in zip(one, two, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param(
            {"width": 0}, r"width must be a positive int, got width=0", id="w0"
        ),
        pytest.param({"width": 1.5}, r"got width=1\.5 \(float\)", id="w-float"),
        pytest.param(
            {"quantile": 0}, r"quantile must lie in \(0, 1\], got quantile=0", id="q0"
        ),
        pytest.param({"quantile": "x"}, r"got quantile='x'", id="q-str"),
        pytest.param({"truncate": "cut"}, r"got truncate='cut'", id="truncate"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PaddedSparseOutput(**kwargs)


def test_unfitted_output_formatted_by_hand_says_how():
    fetch = grain_cells.outputs.Fetch(np.ones((2, 3), np.float32), np.arange(2), 3)
    with pytest.raises(ValueError, match=r"fit_to_source\(source\)"):
        PaddedSparseOutput().format(fetch, np.arange(2), 2)
