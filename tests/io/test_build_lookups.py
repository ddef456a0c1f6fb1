"""What a cold build asks HDF5 per file (issue 33): each node once, string
lists shared, and the same metadata and layouts as before.

A build over many files inspects each one (`grain_cells.io._meta_cache`);
its checks used to look up `obs`, its `_index`, `var` and the matrix's
arrays two to four times each, and to copy every string list it decoded.
"""

from __future__ import annotations

import collections

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells import formats
from grain_cells.hdf5 import _format as hdf5_format
from grain_cells.io import _nodes

OBS = ["kind", "n"]


def _write(path, *, genes=("g0", "g1", "g2", "g3")) -> None:
    rows = np.arange(8)
    x = sp.csr_matrix(
        ((rows + 1).astype(np.float32), (rows, rows % len(genes))),
        shape=(8, len(genes)),
    )
    obs = pd.DataFrame(
        {
            "kind": pd.Categorical(["aa", "bb"][r % 2] for r in rows),
            "n": rows.astype(np.int32),
        },
        index=[f"c{r}" for r in rows],
    )
    var = pd.DataFrame(index=list(genes))
    anndata.AnnData(x, obs=obs, var=var).write_h5ad(path)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))


def _build_counting_opens(monkeypatch, paths) -> collections.Counter:
    """Builds a source; every HDF5 object it opened by name, as (file, name)."""
    seen: collections.Counter = collections.Counter()
    real = h5py.h5o.open

    def counting(loc, name, *args, **kwargs):
        if name not in (b".", b""):
            where = h5py.h5i.get_name(loc) or b"/"
            full = where.rstrip(b"/") + b"/" + name.lstrip(b"/")
            seen[h5py.h5f.get_name(loc).decode(), full.decode()] += 1
        return real(loc, name, *args, **kwargs)

    monkeypatch.setattr(h5py.h5o, "open", counting)
    source = grain_cells.AnnDataSource(paths, obs_columns=OBS)
    monkeypatch.undo()
    assert len(source.paths) == len(paths)
    return seen


def test_a_cold_build_opens_each_node_of_a_file_once(tmp_path, cache, monkeypatch):
    paths = [str(tmp_path / f"{i}.h5ad") for i in range(2)]
    for p in paths:
        _write(p)
    object_opens = _build_counting_opens(monkeypatch, paths)
    repeated = {k: n for k, n in object_opens.items() if n > 1}
    assert not repeated, f"nodes opened more than once per file: {repeated}"
    for p in paths:  # and the nodes the build needs were opened
        names = {name for path, name in object_opens if path == p}
        assert {"/obs", "/var", "/X", "/X/data", "/X/indptr", "/obs/kind"} <= names


def _index_strings(index):
    """The strings of an index: anndata >= 0.11 under pandas 3 writes a
    `nullable-string-array` group (`values`, `mask`), earlier a dataset."""
    return index["values"] if isinstance(index, h5py.Group) else index


def test_a_repeated_string_list_is_one_read_only_array(tmp_path):
    paths = [str(tmp_path / f"{i}.h5ad") for i in range(2)]
    for p in paths:
        _write(p)
    with h5py.File(paths[0], "r") as a, h5py.File(paths[1], "r") as b:
        first, second = (
            _nodes.format_of(f).strings(_index_strings(f["var/_index"])) for f in (a, b)
        )
        assert first is second
        assert not first.flags.writeable
        assert first.tolist() == ["g0", "g1", "g2", "g3"]
        # The public readers still give arrays of their own.
        names = grain_cells.io.read_var_names(a, "X")
        assert names.flags.writeable and names.tolist() == first.tolist()
        obs_names = grain_cells.io.read_obs_names(a)
        assert obs_names.flags.writeable


@pytest.mark.parametrize(
    "values",
    [
        ["short", "", "zellé", "ü" * 31, "y" * 63],
        ["y" * 63, "z" * 64, "x" * 100, "é" * 32],
    ],
)
def test_string_lists_read_as_h5py_reads_them(tmp_path, values):
    path = tmp_path / "s.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "s", data=np.array(values, dtype=object), dtype=h5py.string_dtype()
        )
    with h5py.File(path, "r") as f:
        got = hdf5_format.HDF5.strings(f["s"])
        assert got.dtype == object
        assert got.tolist() == f["s"].asstr()[()].tolist() == values


def test_the_chunk_walk_gives_what_the_sampled_lookups_give(tmp_path):
    path = tmp_path / "c.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("few", data=np.arange(100, dtype="f4"), chunks=(10,))
        f.create_dataset("rows", data=np.ones((50, 3), "f4"), chunks=(7, 3))
        f.create_dataset(
            "gzip", data=np.arange(90, dtype="i8"), chunks=(9,), compression="gzip"
        )
        f.create_dataset("many", data=np.arange(2000, dtype="i4"), chunks=(10,))
    with h5py.File(path, "r") as f:
        for name in ("few", "rows", "gzip", "many"):
            ds = f[name]
            layout = formats.of(ds).array_layout(ds)
            n_chunks = -(-ds.shape[0] // ds.chunks[0])
            picks = np.unique(np.linspace(0, n_chunks - 1, 17).astype(int))
            expected = []
            for k in picks.tolist():
                coord = (k * ds.chunks[0],) + (0,) * (ds.ndim - 1)
                info = ds.id.get_chunk_info_by_coord(coord)
                expected.append((info.byte_offset, info.size, info.filter_mask))
            assert layout[7:] == expected, name
            assert layout[4] == ds.chunks
