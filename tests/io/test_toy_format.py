"""A format added from outside the package reads through the whole pipeline.

`toy_format` (a folder of `.npy` CSR arrays) is registered here and nowhere
else: `grain_cells.loader`, `AnnDataSource` and the fetch transform read
it, and a list may mix it with `.h5ad` files (issue 36, the seam).
"""

from __future__ import annotations

import anndata
import numpy as np
import pytest
import scipy.sparse as sp
import toy_format

import grain_cells
from grain_cells import formats
from grain_cells.io._h5ad import open_file

N_CELLS, N_GENES = 200, 30


def _matrix(n: int, first_row: int = 0) -> sp.csr_matrix:
    """Row i (global) holds genes i % G and (7i + 3) % G, valued 1000 i + gene."""
    rows = np.arange(first_row, first_row + n)
    genes = np.stack([rows % N_GENES, (7 * rows + 3) % N_GENES], axis=1)
    x = sp.lil_matrix((n, N_GENES), dtype=np.float32)
    for k, i in enumerate(rows):
        for g in set(genes[k].tolist()):
            x[k, g] = 1000 * i + g
    return x.tocsr()


@pytest.fixture
def toy():
    formats.register(toy_format.FORMAT)
    yield toy_format
    formats.unregister(toy_format.FORMAT)


def _toy(tmp_path, n=N_CELLS, first_row=0, name="a"):
    rows = np.arange(first_row, first_row + n)
    return toy_format.write_toy(
        tmp_path / f"{name}{toy_format.SUFFIX}",
        _matrix(n, first_row),
        obs={
            "row": rows.astype(np.int64),
            "plate": np.array([f"p{i // 50}" for i in rows]),
        },
    )


def _rows(batch) -> tuple[sp.csr_matrix, np.ndarray]:
    mask = batch["mask"]
    x = sp.csr_matrix(
        (batch["data"], batch["indices"], batch["indptr"]), shape=(mask.size, N_GENES)
    )
    return x[mask], batch["obs/row"][mask]


def test_registry_finds_the_toy_format_first(toy, tmp_path):
    path = _toy(tmp_path)
    assert formats.for_path(path) is toy.FORMAT
    assert formats.registered()[0] is toy.FORMAT
    assert formats.registered()[-1].name == "hdf5"  # the fallback, asked last
    with open_file(path) as f:
        assert formats.of(f) is toy.FORMAT


def test_loader_reads_every_cell_with_its_values(toy, tmp_path):
    path = _toy(tmp_path)
    loader = grain_cells.loader(
        path, batch_size=32, obs_columns=["row", "plate"], seed=3, block_size=8
    )
    seen = []
    for batch in loader:
        x, rows = _rows(batch)
        np.testing.assert_array_equal(x.toarray(), _matrix(N_CELLS)[rows].toarray())
        seen.extend(rows.tolist())
    assert sorted(seen) == list(range(N_CELLS))
    assert seen != sorted(seen)  # shuffled


def test_source_reads_categories_and_matches_an_h5ad_of_the_same_cells(toy, tmp_path):
    path = _toy(tmp_path)
    h5 = tmp_path / "same.h5ad"
    a = anndata.AnnData(X=_matrix(N_CELLS))
    a.obs_names = [f"cell{i}" for i in range(N_CELLS)]
    a.var_names = [f"gene{j}" for j in range(N_GENES)]
    a.obs["row"] = np.arange(N_CELLS, dtype=np.int64)
    a.obs["plate"] = [f"p{i // 50}" for i in range(N_CELLS)]
    a.write_h5ad(h5)
    sources = [
        grain_cells.AnnDataSource(p, block_size=8, obs_columns=["plate"])
        for p in (path, h5)
    ]
    assert list(sources[0].var_names) == list(sources[1].var_names)
    assert list(sources[0].categories["plate"]) == ["p0", "p1", "p2", "p3"]
    # Checkpoints tell the formats apart (Format.recorded_format).
    assert sources[0].file_identity(0).content()["format"] == "toy"
    assert "format" not in sources[1].file_identity(0).content()
    batches = [
        list(grain_cells.loader(s, batch_size=40, seed=5, shuffle=True))
        for s in sources
    ]
    for b_toy, b_h5 in zip(*batches, strict=True):
        for key in ("data", "indices", "indptr", "mask", "obs/plate"):
            np.testing.assert_array_equal(b_toy[key], b_h5[key])


def test_a_list_mixes_the_toy_format_with_h5ad_files(toy, tmp_path):
    first = _toy(tmp_path, n=120)
    h5 = tmp_path / "rest.h5ad"
    a = anndata.AnnData(X=_matrix(N_CELLS - 120, first_row=120))
    a.var_names = [f"gene{j}" for j in range(N_GENES)]
    a.obs["row"] = np.arange(120, N_CELLS, dtype=np.int64)
    a.obs["plate"] = [f"p{i // 50}" for i in range(120, N_CELLS)]
    a.write_h5ad(h5)
    loader = grain_cells.loader(
        [first, h5], batch_size=32, obs_columns=["row"], seed=1, block_size=8
    )
    seen = []
    for batch in loader:
        x, rows = _rows(batch)
        np.testing.assert_array_equal(x.toarray(), _matrix(N_CELLS)[rows].toarray())
        seen.extend(rows.tolist())
    assert sorted(seen) == list(range(N_CELLS))


def test_unregistered_toy_folder_is_not_opened(tmp_path):
    path = _toy(tmp_path)
    assert formats.for_path(path).name != "toy"


def test_every_reader_follows_the_range_reader_protocol(toy, tmp_path):
    """One contract, every format: hdf5, zarr and the toy's readers."""
    a = anndata.AnnData(X=_matrix(N_CELLS))
    a.write_h5ad(tmp_path / "a.h5ad")
    a.write_zarr(tmp_path / "a.zarr")
    want = _matrix(N_CELLS).indices[10:30]
    for path in (tmp_path / "a.h5ad", tmp_path / "a.zarr", _toy(tmp_path)):
        with open_file(path) as f:
            fmt = formats.of(f)
            reader = fmt.range_reader(f["X/indices"], str(path), None)
            assert isinstance(reader, formats.RangeReader), fmt.name
            out = np.empty(20, reader.dtype)
            reader.read(np.array([10, 20]), np.array([20, 30]), out)
            np.testing.assert_array_equal(out, want)
