"""preshuffle's memory at scale: obs names never as Python objects (issue 33).

At 100M cells the names held as a pandas object index (and copied again by
anndata's writer) were 12 GB. These tests pin the behaviour that replaced
it: names read into one numpy StringDType array and written in windows,
and no per-cell Python objects anywhere in a run.
"""

from __future__ import annotations

import tracemalloc

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.preshuffle import _frames as _names
from grain_cells.preshuffle import _writer as windows
from grain_cells.synthetic import write_thin_atlas


def test_names_are_read_as_strings_not_objects(tmp_path, monkeypatch):
    a = write_thin_atlas(tmp_path / "a.h5ad", 3_000)
    b = write_thin_atlas(tmp_path / "b.h5ad", 2_000, first_cell=3_000)

    def no_objects(*args, **kwargs):  # the reader of object arrays
        raise AssertionError("obs names were read as Python objects")

    monkeypatch.setattr(h5py.Dataset, "asstr", no_objects)
    monkeypatch.setattr(_names, "WINDOW", 777)  # slices that straddle files
    names = _names.Names.read(
        [str(a), str(b)], np.array([0, 3_000, 5_000]), storage_options=None
    )
    assert names.values.dtype == np.dtypes.StringDType()
    assert names.values[0] == "cell_0" and names.values[3_000] == "cell_3000"
    assert names.values[-1] == "cell_4999"


def test_index_written_in_windows_reads_back_as_anndata_wrote_it(tmp_path, monkeypatch):
    src = write_thin_atlas(tmp_path / "thin.h5ad", 5_000)
    ref = grain_cells.preshuffle(
        [src], tmp_path / "ref", cells_per_file=2_000, progress=False, keep=()
    )
    monkeypatch.setattr(_names, "WINDOW", 333)
    got = grain_cells.preshuffle(
        [src], tmp_path / "got", cells_per_file=2_000, progress=False, keep=()
    )
    original = anndata.read_h5ad(src)
    for r, g in zip(ref, got, strict=True):
        want, have = anndata.read_h5ad(r), anndata.read_h5ad(g)
        pd.testing.assert_frame_equal(have.obs, want.obs)
        # As anndata reads the input's names: object under pandas 2, `str`
        # under pandas 3.
        assert have.obs_names.dtype == original.obs_names.dtype
        # The names travel with their cells.
        np.testing.assert_array_equal(
            have.X.toarray(), original[have.obs_names].X.toarray()
        )


def _read(path) -> anndata.AnnData:
    if str(path).endswith(".zarr"):
        return anndata.read_zarr(path)
    return anndata.read_h5ad(path)


@pytest.mark.parametrize("fmt", ["h5ad", "zarr"])
def test_obs_columns_keep_the_dtypes_anndata_read(tmp_path, fmt):
    # Object and pandas strings, nullable strings with a missing value,
    # categoricals, numbers and nullable integers: each part's obs reads
    # back with the dtypes anndata reads from the input (pandas 2: object
    # and `string`; pandas 3: `str` and `string`), cell for cell.
    n = 300
    obs = pd.DataFrame(
        {
            "plain": np.array([f"p{i}" for i in range(n)], dtype=object),
            "nullable": pd.array(
                [None if i % 7 == 0 else f"s{i}" for i in range(n)], dtype="string"
            ),
            "cat": pd.Categorical([f"c{i % 5}" for i in range(n)]),
            "num": np.arange(n, dtype=np.int64),
            "nullable_int": pd.array(
                [None if i % 11 == 0 else i for i in range(n)], dtype="Int32"
            ),
        },
        index=[f"cell{i}" for i in range(n)],
    )
    x = sp.random(n, 20, density=0.2, format="csr", dtype=np.float32, random_state=0)
    src = tmp_path / "in.h5ad"
    with anndata.settings.override(allow_write_nullable_strings=True):
        anndata.AnnData(X=x, obs=obs).write_h5ad(
            src, convert_strings_to_categoricals=False
        )
    want = anndata.read_h5ad(src)
    parts = grain_cells.preshuffle(
        [src], tmp_path / "out", format=fmt, cells_per_file=120, progress=False
    )
    got = [_read(p) for p in parts]
    for part in got:
        assert part.obs.dtypes.to_dict() == want.obs.dtypes.to_dict()
        assert part.obs_names.dtype == want.obs_names.dtype
        pd.testing.assert_frame_equal(part.obs, want.obs.loc[part.obs_names])
    assert sum(p.n_obs for p in got) == n


def test_csr_cuts_equal_cuts_over_a_part_long_table(monkeypatch):
    # The windows and row pointers computed piece by piece are those of the
    # part-long tables they replace, for pieces smaller and larger than a
    # window and cells larger than a window.
    rng = np.random.default_rng(1)
    for _ in range(200):
        monkeypatch.setattr(windows, "PIECE", int(rng.integers(1, 20)))
        lengths = rng.integers(0, 9, 80).astype(np.int32)
        rows = rng.permutation(80)[: int(rng.integers(0, 60))].astype(np.int32)
        value_bytes, cell_bytes = int(rng.integers(1, 9)), int(rng.integers(0, 50))
        cap = int(rng.integers(1, 400))
        indptr = np.zeros(rows.size + 1, np.int64)
        np.cumsum(lengths[rows], out=indptr[1:])
        through = indptr[1:] * value_bytes + np.arange(1, rows.size + 1) * cell_bytes
        want = windows.cuts(through, cap)
        bounds, nnz_at = windows.csr_cuts(lengths, rows, value_bytes, cell_bytes, cap)
        assert bounds == want
        assert nnz_at == [int(indptr[b]) for b in want]
        out = np.full(rows.size + 1, -1, np.int64)
        windows.write_indptr(out, lengths, rows)
        np.testing.assert_array_equal(out, indptr)


@pytest.mark.slow  # 200,000 cells under tracemalloc: ~10 s
def test_peak_memory_per_cell_is_bounded(tmp_path, monkeypatch):
    # Held per cell: the permutation and X's row lengths (4 bytes each), the
    # names (16, StringDType), the obs codes (5) and a part's codes and
    # indptr. Before (object names, lists of row pointers): 136 bytes per
    # cell here; now about 48. Windows are kept small so that the bound is
    # about per-cell memory, not the window budget.
    n = 200_000
    src = write_thin_atlas(tmp_path / "thin.h5ad", n)
    monkeypatch.setattr(_names, "WINDOW", 4_096)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        grain_cells.preshuffle(
            [src],
            tmp_path / "out",
            progress=False,
            keep=(),
            memory_budget_bytes=1 << 20,
        )
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak / n < 64, f"{peak / n:.1f} bytes per cell at the peak"
