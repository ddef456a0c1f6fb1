"""`preshuffle(..., format="zarr")`: parts written as AnnData zarr stores.

The oracle is `anndata.read_zarr` of each zarr part compared with
`anndata.read_h5ad` of the h5ad part of the same run (same inputs, seed and
parts): the two copies must hold the same cells in the same order, with X,
obs, var, layers, raw, obsm, varm and uns. Inputs are those of
`test_preshuffle_carry` (values encode row and gene, layers, raw with more
genes, obsm array and dataframe) and of `test_preshuffle` (three files,
categorical, int and string obs columns).
"""

from __future__ import annotations

import errno
import itertools
import json
import pathlib
import warnings

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import test_preshuffle
import test_preshuffle_carry
import zarr

import grain_cells
from grain_cells.preshuffle import _files as preshuffle_files
from grain_cells.preshuffle import _parts as zarr_part
from grain_cells.preshuffle import _writer as preshuffle_writer
from grain_cells.preshuffle import preshuffle

KEEP = ["layers", "raw", "obsm", "varm", "uns"]
tiny_disk = test_preshuffle.tiny_disk  # the fixture: a 4 MiB tmpfs


@pytest.fixture(scope="module")
def carry_inputs(tmp_path_factory):
    return test_preshuffle_carry.write_inputs(tmp_path_factory.mktemp("zarr_carry"))


@pytest.fixture(scope="module")
def three_inputs(tmp_path_factory):
    return test_preshuffle.write_inputs(tmp_path_factory.mktemp("zarr_three"))


def _read(path) -> anndata.AnnData:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # anndata's own
        if str(path).endswith(".zarr"):
            return anndata.read_zarr(path)
        return anndata.read_h5ad(path)


def _dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def assert_same_adata(zarr_path, h5ad_path) -> None:
    """The zarr part holds what the h5ad part holds, cell for cell."""
    z, h = _read(zarr_path), _read(h5ad_path)
    assert z.shape == h.shape
    assert sp.issparse(z.X) == sp.issparse(h.X)
    np.testing.assert_array_equal(_dense(z.X), _dense(h.X))
    pd.testing.assert_frame_equal(z.obs, h.obs)
    pd.testing.assert_frame_equal(z.var, h.var)
    assert set(z.layers.keys()) == set(h.layers.keys())
    for key in h.layers:
        assert sp.issparse(z.layers[key]) == sp.issparse(h.layers[key])
        np.testing.assert_array_equal(_dense(z.layers[key]), _dense(h.layers[key]))
    assert (z.raw is None) == (h.raw is None)
    if h.raw is not None:
        np.testing.assert_array_equal(_dense(z.raw.X), _dense(h.raw.X))
        np.testing.assert_array_equal(z.raw.var_names, h.raw.var_names)
    assert set(z.obsm.keys()) == set(h.obsm.keys())
    for key in h.obsm:
        if isinstance(h.obsm[key], pd.DataFrame):
            pd.testing.assert_frame_equal(z.obsm[key], h.obsm[key])
        else:
            np.testing.assert_array_equal(z.obsm[key], h.obsm[key])
    for key in h.varm:
        np.testing.assert_array_equal(z.varm[key], h.varm[key])
    assert z.uns.keys() == h.uns.keys()
    for key in h.uns:
        np.testing.assert_array_equal(z.uns[key], h.uns[key])


def leftovers(output_dir) -> list[str]:
    return sorted(p.name for p in pathlib.Path(output_dir).iterdir() if "tmp" in p.name)


# --------------------------------------------------------------------------- #
# Content.
# --------------------------------------------------------------------------- #


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
@pytest.mark.parametrize(
    ("fmt", "compression"),
    [
        pytest.param("zarr", None, id="v3"),
        pytest.param("zarr", "zstd", id="v3-zstd"),
        pytest.param("zarr-v2", "gzip", id="v2-gzip"),
    ],
)
def test_zarr_copy_equals_the_h5ad_copy(carry_inputs, tmp_path, fmt, compression):
    # Many windows per matrix, three parts.
    kw = {"seed": 1, "cells_per_file": 60, "memory_budget_bytes": 2_000}
    # Small chunks: several per part (zarr v2 makes a file of each: fewer).
    kw |= {"keep": KEEP, "progress": False, "chunk_cells": 4 if fmt == "zarr" else 16}
    h5ad_parts = preshuffle(carry_inputs, tmp_path / "h5ad", **kw)
    zarr_parts = preshuffle(
        carry_inputs, tmp_path / "zarr", format=fmt, compression=compression, **kw
    )
    assert [p.name for p in zarr_parts] == [
        f"part-0000{i}.zarr" for i in range(len(h5ad_parts))
    ]
    for z, h in zip(zarr_parts, h5ad_parts, strict=True):
        assert_same_adata(z, h)
        root = zarr.open_group(z, mode="r")
        assert root.metadata.zarr_format == (3 if fmt == "zarr" else 2)
        data = root["X/data"]
        assert (data.shards is not None) == (fmt == "zarr")
        assert data.chunks[0] < data.shape[0]  # several chunks per part
    manifest = json.loads((tmp_path / "zarr" / preshuffle_files.MANIFEST).read_text())
    assert [p["file"] for p in manifest["parts"]] == [p.name for p in zarr_parts]


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
@pytest.mark.parametrize("dense", [False, True], ids=["csr", "dense"])
def test_three_inputs_strings_and_categories(three_inputs, tmp_path, dense):
    paths = three_inputs
    if dense:
        paths = test_preshuffle.write_inputs(tmp_path / "dense", dense=True)
    kw = {"cells_per_file": 100, "memory_budget_bytes": 3_000, "progress": False}
    h5ad_parts = preshuffle(paths, tmp_path / "h5ad", **kw)
    zarr_parts = preshuffle(paths, tmp_path / "zarr", format="zarr", **kw)
    for z, h in zip(zarr_parts, h5ad_parts, strict=True):
        assert_same_adata(z, h)


def test_group_by_is_contiguous(carry_inputs, tmp_path):
    kw = {"seed": 2, "group_by": "cell_type", "keep": (), "progress": False}
    h5ad_parts = preshuffle(carry_inputs, tmp_path / "h5ad", **kw)
    zarr_parts = preshuffle(carry_inputs, tmp_path / "zarr", format="zarr", **kw)
    assert_same_adata(zarr_parts[0], h5ad_parts[0])
    labels = _read(zarr_parts[0]).obs["cell_type"]
    codes = labels.cat.codes.to_numpy()
    assert (np.diff(codes) >= 0).all()  # each label's cells contiguous
    assert list(labels.cat.categories) == test_preshuffle_carry.LABELS


def test_chunks_of_zeros_are_stored(tmp_path):
    """zarr skips chunks equal to the fill value unless told: a reader could
    not tell them from missing chunks, so the writer stores them."""
    n, genes = 40, 5
    x = np.zeros((n, genes), np.float32)
    x[::13, 1] = np.arange(1, 5)
    adata = anndata.AnnData(X=x, var=pd.DataFrame(index=[f"g{j}" for j in range(5)]))
    adata.obs_names = [f"c{i}" for i in range(n)]
    adata.write_h5ad(tmp_path / "in.h5ad")
    parts = preshuffle(
        tmp_path / "in.h5ad",
        tmp_path / "out",
        format="zarr-v2",
        chunk_cells=1,
        progress=False,
    )
    x_out = zarr.open_group(parts[0], mode="r")["X"]
    assert x_out.nchunks == n
    assert x_out.nchunks_initialized == n
    np.testing.assert_array_equal(np.sort(x_out[:, 1]), np.sort(x[:, 1]))


# --------------------------------------------------------------------------- #
# Shard-aligned writes.
# --------------------------------------------------------------------------- #


class _Recorder:
    def __init__(self, array):
        self.array, self.shape, self.dtype = array, array.shape, array.dtype
        self.path, self.writes = "x", []

    def __setitem__(self, key, values):
        self.writes.append((key.start, key.stop))
        self.array[key] = values


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
@pytest.mark.parametrize("seed", range(3))
def test_appender_writes_whole_shards_once(seed):
    rng = np.random.default_rng(seed)
    n, unit = int(rng.integers(50, 200)), int(rng.integers(1, 12))
    values = rng.integers(1, 1_000, (n, 2)).astype(np.int64)
    array = zarr.create_array({}, shape=(n, 2), dtype=np.int64, chunks=(unit, 2))
    recorder = _Recorder(array)
    appender = zarr_part._Appender(recorder, unit)
    cuts = np.unique(np.r_[0, rng.integers(0, n, 12), n])
    for a, b in itertools.pairwise(cuts):
        window = values[a:b].copy()
        appender[a:b] = window
        window[:] = -1  # the writer reuses its window's arrays
    appender.check_complete()
    np.testing.assert_array_equal(array[:], values)
    for a, b in recorder.writes:
        assert a % unit == 0 and (b % unit == 0 or b == n)
    assert [a for a, _ in recorder.writes] == [0] + [b for _, b in recorder.writes[:-1]]
    with pytest.raises(RuntimeError, match="out of order"):
        zarr_part._Appender(recorder, unit)[1:2] = values[1:2]


# --------------------------------------------------------------------------- #
# Restarts, publish and cleanup.
# --------------------------------------------------------------------------- #


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
def test_interrupted_run_is_cleaned_up_and_completed(
    three_inputs, tmp_path, monkeypatch
):
    kw = {"cells_per_file": 100, "memory_budget_bytes": 6_000, "progress": False}
    kw["format"] = "zarr"
    clean = preshuffle(three_inputs, tmp_path / "clean", **kw)
    out = tmp_path / "out"
    scatter = preshuffle_writer._scatter_csr
    write_part = preshuffle_writer.Writer.write_part
    state = {"part": None, "calls": 0}

    def tracking_write_part(self, index, report):
        state["part"] = index
        return write_part(self, index, report)

    def crash_in_second_part(*args, **kwargs):
        if state["part"] == 1:
            state["calls"] += 1
            if state["calls"] == 3:  # a few windows into part 1
                raise RuntimeError("simulated crash")
        return scatter(*args, **kwargs)

    monkeypatch.setattr(preshuffle_writer.Writer, "write_part", tracking_write_part)
    monkeypatch.setattr(preshuffle_writer, "_scatter_csr", crash_in_second_part)
    with pytest.raises(RuntimeError, match="simulated crash"):
        preshuffle(three_inputs, out, **kw)
    assert sorted(p.name for p in out.iterdir()) == ["part-00000.zarr"]
    first = (out / "part-00000.zarr" / "zarr.json").stat()
    monkeypatch.setattr(preshuffle_writer, "_scatter_csr", scatter)

    # A hard crash (SIGKILL) leaves its temporary folder: the rerun removes it.
    left = out / ".part-00001.zarr.a1b2c3d4e5f6.tmp"
    (left / "X").mkdir(parents=True)
    (left / "X" / "zarr.json").write_text("{}")
    parts = preshuffle(three_inputs, out, **kw)
    assert leftovers(out) == []
    for z, c in zip(parts, clean, strict=True):
        assert_same_adata(z, c)
    again = (out / "part-00000.zarr" / "zarr.json").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
def test_damaged_or_foreign_part_is_redone_complete_ones_kept(
    three_inputs, tmp_path, monkeypatch
):
    kw = {"cells_per_file": 100, "progress": False, "format": "zarr"}
    kw["chunk_cells"] = 2
    out = tmp_path / "out"
    parts = preshuffle(three_inputs, out, **kw)
    clean = preshuffle(three_inputs, tmp_path / "clean", **kw)
    # Part 0: a folder of something else; part 1: a shard deleted.
    for child in sorted(parts[0].rglob("*"), reverse=True):
        child.unlink() if child.is_file() else child.rmdir()
    (parts[0] / "notes.txt").write_text("not a part")
    shard = next((parts[1] / "X" / "data" / "c").iterdir())
    shard.unlink()
    kept = (parts[2] / "zarr.json").stat()
    assert preshuffle(three_inputs, out, **kw) == parts
    for z, c in zip(parts, clean, strict=True):
        assert_same_adata(z, c)
    assert not (parts[0] / "notes.txt").exists()
    assert leftovers(out) == []
    again = (parts[2] / "zarr.json").stat()
    assert (again.st_ino, again.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)

    def fail(*args, **kwargs):
        raise AssertionError("nothing should be rewritten")

    monkeypatch.setattr(preshuffle_writer.Writer, "write_part", fail)
    assert preshuffle(three_inputs, out, **kw) == parts


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
def test_stale_parts_of_either_format_are_removed(three_inputs, tmp_path):
    out = tmp_path / "out"
    preshuffle(three_inputs, out, cells_per_file=100, progress=False)
    preshuffle(three_inputs, out, cells_per_file=100, format="zarr", progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "part-00000.zarr",
        "part-00001.zarr",
        "part-00002.zarr",
        "preshuffle.json",
    ]
    preshuffle(three_inputs, out, format="zarr", progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "part-00000.zarr",
        "preshuffle.json",
    ]
    preshuffle(three_inputs, out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "part-00000.h5ad",
        "preshuffle.json",
    ]


def test_full_disk_is_refused_before_writing(three_inputs, tmp_path, monkeypatch):
    usage = preshuffle_files.shutil.disk_usage

    def no_space(path):
        return usage(path)._replace(free=1_000)

    monkeypatch.setattr(preshuffle_files.shutil, "disk_usage", no_space)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="not enough disk space") as e:
        preshuffle(three_inputs, out, format="zarr", progress=False)
    assert e.value.errno == errno.ENOSPC
    assert str(out) in str(e.value)
    assert list(out.iterdir()) == []


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
def test_disk_full_mid_write_removes_the_temporary(tmp_path, tiny_disk, monkeypatch):
    """The free-space check bypassed: zarr meets the full disk itself."""
    monkeypatch.setattr(preshuffle_files, "reserve_space", lambda *a: None)
    paths = test_preshuffle.write_big_inputs(tmp_path / "in")
    out = tiny_disk / "out"
    with pytest.raises(OSError) as e:
        preshuffle(paths, out, cells_per_file=5000, format="zarr", progress=False)
    assert e.value.errno == errno.ENOSPC
    assert "the disk filled up while writing part" in str(e.value)
    names = sorted(p.name for p in out.iterdir())
    assert leftovers(out) == []  # no temporary folder left
    assert 0 < len(names) < 4  # parts written before the disk filled are kept
    assert names == [f"part-{i:05d}.zarr" for i in range(len(names))]
    for name in names:
        got = _read(out / name)
        ref = _read(paths[0])[got.obs_names]
        np.testing.assert_array_equal(_dense(got.X), _dense(ref.X))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"format": "parquet"}, "format must be one of", id="format"),
        pytest.param(
            {"format": "zarr", "compression": "lzf"},
            r"compression must be one of \[None, 'gzip', 'zstd'\] for format='zarr'",
            id="lzf",
        ),
        pytest.param({"compression": "zstd"}, "for format='h5ad'", id="zstd-h5ad"),
    ],
)
def test_bad_arguments(three_inputs, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        preshuffle(three_inputs, tmp_path, progress=False, **kwargs)


def test_bucket_output_is_refused_for_zarr(three_inputs):
    with pytest.raises(ValueError, match="writes to a local folder"):
        preshuffle(three_inputs, "s3://bucket/shuffled", format="zarr", progress=False)


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
@pytest.mark.parametrize("fmt", ["h5ad", "zarr"])
def test_zarr_parts_as_inputs_carry_everything(carry_inputs, tmp_path, fmt):
    """Zarr and h5ad copies hold the same cells: shuffled again with one
    seed, they give the same copy, layers, raw, obsm, varm and uns included."""
    kw = {"seed": 1, "cells_per_file": 100, "keep": KEEP, "progress": False}
    h5ad_parts = preshuffle(carry_inputs, tmp_path / "h5ad", **kw)
    zarr_parts = preshuffle(carry_inputs, tmp_path / "zarr", format="zarr", **kw)
    kw = {"seed": 5, "progress": False, "format": fmt}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from_zarr = preshuffle(zarr_parts, tmp_path / "from_zarr", **kw)
    assert not [w for w in caught if "leaves out" in str(w.message)]  # kept all
    from_h5ad = preshuffle(h5ad_parts, tmp_path / "from_h5ad", keep=KEEP, **kw)
    assert_same_adata(from_zarr[0], from_h5ad[0])
    layers = test_preshuffle_carry.layer_names(_read(from_zarr[0]))
    assert layers == {"counts", "dense"}


# --------------------------------------------------------------------------- #
# Read back by grain_cells.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("fmt", ["zarr", "zarr-v2"])
def test_copy_reads_through_the_source_and_the_loader(three_inputs, tmp_path, fmt):
    parts = preshuffle(
        three_inputs,
        tmp_path / "out",
        cells_per_file=100,
        chunk_cells=8,
        format=fmt,
        progress=False,
    )
    oracle = anndata.concat([_read(p) for p in parts])
    x = _dense(oracle.X)
    source = grain_cells.AnnDataSource(parts, block_size=16, obs_columns=["idx"])
    assert source.num_cells == oracle.n_obs
    loader = grain_cells.loader(
        source,
        batch_size=32,
        output=grain_cells.DenseOutput(),
        seed=1,
        worker_count=0,
    )
    seen = []
    for batch in loader:
        rows = batch["row_ids"][batch["mask"]]
        np.testing.assert_array_equal(batch["X"][batch["mask"]], x[rows])
        np.testing.assert_array_equal(
            batch["obs/idx"][batch["mask"]], oracle.obs["idx"].to_numpy()[rows]
        )
        seen.append(rows)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(len(x)))


def test_a_zarr_part_as_input_of_its_own_folder_is_refused(three_inputs, tmp_path):
    parts = preshuffle(three_inputs, tmp_path, format="zarr", progress=False)
    with pytest.raises(ValueError, match="is an input and also output part"):
        preshuffle(parts, tmp_path, format="zarr", seed=1, progress=False)
    assert _read(parts[0]).n_obs == sum(test_preshuffle.SIZES)  # still whole
