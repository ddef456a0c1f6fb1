"""Tests of `grain_cells.preshuffle`: shuffled copies of `.h5ad` files.

Inputs are small files written by anndata in which the value stored at
(global row i, gene j) is `i * 100 + j + 1`, obs has a categorical
(`cell_type`, with categories that differ between files), an int `idx` (the
global row) and a unique string `barcode`. Every test can therefore tell
exactly which input cell each output cell is.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.preshuffle import _preshuffle as preshuffle_lib
from grain_cells.preshuffle import _writer as preshuffle_writer
from grain_cells.preshuffle import preshuffle

SIZES = (97, 130, 61)
N_GENES = 12
GENES = [f"g{j}" for j in range(N_GENES)]
# Categories per file: the middle file lists them in another order and adds one.
CATEGORIES = (["B", "T", "NK"], ["NK", "Mono", "B", "T"], ["T", "B"])
# First output rows (idx) of the three files with seed 0: pins the order.
GOLDEN_SEED0 = [229, 226, 126, 161, 138, 75, 200, 5, 121, 31]


def write_inputs(directory, *, sizes=SIZES, dense=False, genes=GENES, layer=None):
    """Writes one file per size; returns their paths."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths, offset = [], 0
    for f, n in enumerate(sizes):
        rows = np.arange(offset, offset + n)
        nnz = rng.integers(0, 9, n)
        nnz[rows % 10 == 3] = 0  # some empty cells
        i = np.repeat(np.arange(n), nnz)
        j = np.concatenate(
            [np.sort(rng.choice(N_GENES, k, replace=False)) for k in nnz]
        ).astype(np.int64)
        values = ((i + offset) * 100 + j + 1).astype(np.float32)
        x = sp.csr_matrix((values, (i, j)), shape=(n, N_GENES))
        x.sort_indices()
        cats = CATEGORIES[f % len(CATEGORIES)]
        obs = pd.DataFrame(
            {
                "cell_type": pd.Categorical(rng.choice(cats, n), categories=cats),
                "idx": rows.astype(np.int64),
                "barcode": np.array([f"BC{r:05d}" for r in rows], dtype=object),
            },
            index=[f"cell{r}" for r in rows],
        )
        matrix = x.toarray() if dense else x
        adata = anndata.AnnData(
            X=None if layer else matrix, obs=obs, var=pd.DataFrame(index=genes)
        )
        if layer:
            adata.layers[layer] = matrix
        path = directory / f"in{f}.h5ad"
        adata.write_h5ad(path, convert_strings_to_categoricals=False)
        paths.append(str(path))
        offset += n
    return paths


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Input paths per (number of files, dense)."""
    root = tmp_path_factory.mktemp("inputs")
    out = {}
    for dense in (False, True):
        paths = write_inputs(root / ("dense" if dense else "csr"), dense=dense)
        out[(3, dense)] = paths
        out[(1, dense)] = write_inputs(
            root / ("dense1" if dense else "csr1"), sizes=(sum(SIZES),), dense=dense
        )
    return out


def read_back(paths) -> anndata.AnnData:
    """The parts (or inputs) concatenated, read by anndata."""
    parts = [anndata.read_h5ad(p) for p in paths]
    return anndata.concat(parts, merge="same") if len(parts) > 1 else parts[0]


def dense_x(adata) -> np.ndarray:
    x = adata.X
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def assert_same_cells(output_paths, input_paths):
    """Outputs hold exactly the inputs' cells (rows and obs), in any order."""
    out, ref = read_back(output_paths), read_back(input_paths)
    assert out.n_obs == ref.n_obs
    order = np.argsort(out.obs["idx"].to_numpy())
    np.testing.assert_array_equal(out.obs["idx"].to_numpy()[order], ref.obs["idx"])
    np.testing.assert_array_equal(dense_x(out)[order], dense_x(ref))
    np.testing.assert_array_equal(out.obs_names[order], ref.obs_names)
    for column in ("cell_type", "barcode"):
        np.testing.assert_array_equal(
            out.obs[column].astype(str).to_numpy()[order],
            ref.obs[column].astype(str).to_numpy(),
        )
    np.testing.assert_array_equal(out.var_names, GENES)


def manifest(output_dir) -> dict:
    with open(pathlib.Path(output_dir) / preshuffle_lib.MANIFEST) as f:
        return json.load(f)


def leftovers(output_dir) -> list[str]:
    return sorted(p.name for p in pathlib.Path(output_dir).iterdir() if "tmp" in p.name)


# --------------------------------------------------------------------------- #
# Content.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("compression", [None, "gzip"], ids=["raw", "gzip"])
@pytest.mark.parametrize("dense", [False, True], ids=["csr", "dense"])
@pytest.mark.parametrize("cells_per_file", [None, 100], ids=["1part", "3parts"])
@pytest.mark.parametrize("n_inputs", [1, 3], ids=["1input", "3inputs"])
def test_output_holds_exactly_the_input_cells(
    inputs, tmp_path, n_inputs, cells_per_file, dense, compression
):
    paths = inputs[(n_inputs, dense)]
    parts = preshuffle(
        paths,
        tmp_path / "out",
        cells_per_file=cells_per_file,
        compression=compression,
        progress=False,
    )
    expected_parts = 1 if cells_per_file is None else 3
    assert [p.name for p in parts] == [
        f"part-{i:05d}.h5ad" for i in range(expected_parts)
    ]
    assert_same_cells(parts, paths)
    assert leftovers(tmp_path / "out") == []
    umask = os.umask(0)
    os.umask(umask)
    assert parts[0].stat().st_mode & 0o777 == 0o666 & ~umask

    # Categoricals keep the union of the inputs' categories, in every part.
    union = list(dict.fromkeys(c for cats in CATEGORIES[:n_inputs] for c in cats))
    if n_inputs == 1:
        union = CATEGORIES[0]
    for p in parts:
        cats = anndata.read_h5ad(p).obs["cell_type"].cat.categories
        assert list(cats) == union

    # The layout: CSR stays CSR with int64 indptr, dense stays dense.
    with h5py.File(parts[0], "r") as f:
        if dense:
            assert isinstance(f["X"], h5py.Dataset)
        else:
            assert f["X"].attrs["encoding-type"] == "csr_matrix"
            assert f["X/indptr"].dtype == np.int64
            assert f["X/indices"].dtype == np.int32
            assert f["X/data"].compression == compression
            assert f["X/indptr"].compression is None

    # AnnDataSource reads the parts, on the positional fast path when
    # uncompressed, with the same values as anndata.
    source = grain_cells.AnnDataSource(parts, obs_columns=["idx", "cell_type"])
    assert source._file(0).reader.direct == (compression is None)
    cells = source.read(np.arange(source.num_cells))
    x = cells.X.toarray() if sp.issparse(cells.X) else cells.X
    np.testing.assert_array_equal(x, dense_x(read_back(parts)))
    np.testing.assert_array_equal(np.sort(cells.obs["idx"]), np.arange(sum(SIZES)))


def test_backed_mode_reads_the_output(inputs, tmp_path):
    parts = preshuffle(inputs[(3, False)], tmp_path, progress=False)
    backed = anndata.read_h5ad(parts[0], backed="r")
    try:
        assert backed.shape == (sum(SIZES), N_GENES)
        rows = backed.obs["idx"].to_numpy()[:5]
        np.testing.assert_array_equal(
            backed.X[:5].toarray(),
            dense_x(read_back(inputs[(3, False)]))[rows],
        )
    finally:
        backed.file.close()


def test_obs_columns_and_layer(tmp_path):
    paths = write_inputs(tmp_path / "in", sizes=(40, 30), layer="counts")
    parts = preshuffle(
        paths, tmp_path / "out", layer="counts", obs_columns=["idx"], progress=False
    )
    out = read_back(parts)
    assert list(out.obs.columns) == ["idx"]
    order = np.argsort(out.obs["idx"].to_numpy())
    ref = anndata.concat([anndata.read_h5ad(p) for p in paths])
    np.testing.assert_array_equal(dense_x(out)[order], ref.layers["counts"].toarray())


# --------------------------------------------------------------------------- #
# Order.
# --------------------------------------------------------------------------- #


def output_idx(parts) -> np.ndarray:
    return np.concatenate([anndata.read_h5ad(p).obs["idx"].to_numpy() for p in parts])


def test_order_is_shuffled_seeded_and_mixes_inputs(inputs, tmp_path):
    paths = inputs[(3, False)]
    a = output_idx(preshuffle(paths, tmp_path / "a", seed=0, progress=False))
    b = output_idx(
        preshuffle(paths, tmp_path / "b", seed=0, cells_per_file=50, progress=False)
    )
    c = output_idx(preshuffle(paths, tmp_path / "c", seed=1, progress=False))
    np.testing.assert_array_equal(a, b)  # same seed, any split into parts
    assert not np.array_equal(a, c)
    assert not np.array_equal(a, np.sort(a))
    assert a[: len(GOLDEN_SEED0)].tolist() == GOLDEN_SEED0
    # Cells of every input within the first 50 output cells.
    bounds = np.cumsum(SIZES)
    files = np.searchsorted(bounds, a[:50], side="right")
    assert set(files.tolist()) == {0, 1, 2}


# --------------------------------------------------------------------------- #
# Interruptions.
# --------------------------------------------------------------------------- #


def assert_same_parts(parts, reference):
    assert [p.name for p in parts] == [p.name for p in reference]
    for p, r in zip(parts, reference, strict=True):
        got, want = anndata.read_h5ad(p), anndata.read_h5ad(r)
        np.testing.assert_array_equal(dense_x(got), dense_x(want))
        pd.testing.assert_frame_equal(got.obs, want.obs)


@pytest.fixture(scope="module")
def clean_run(inputs, tmp_path_factory):
    """A reference run: 3 inputs, 3 parts, seed 0."""
    out = tmp_path_factory.mktemp("clean")
    return preshuffle(inputs[(3, False)], out, cells_per_file=100, progress=False)


def test_crash_mid_write_then_rerun_completes(inputs, clean_run, tmp_path, monkeypatch):
    paths = inputs[(3, False)]
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
        # A budget of ~60 cells per window: several windows per part.
        preshuffle(
            paths, out, cells_per_file=100, memory_budget_bytes=6_000, progress=False
        )
    assert sorted(p.name for p in out.iterdir()) == ["part-00000.h5ad"]
    first = (out / "part-00000.h5ad").stat()
    monkeypatch.setattr(preshuffle_writer, "_scatter_csr", scatter)
    assert state["calls"] == 3

    # A hard crash would leave its temporary file behind: the rerun removes it.
    (out / ".part-00001.h5ad.x1y2z3.tmp").write_bytes(b"partial")
    (out / ".preshuffle.json.x1y2z3.tmp").write_bytes(b"{")
    parts = preshuffle(
        paths, out, cells_per_file=100, memory_budget_bytes=6_000, progress=False
    )
    assert_same_parts(parts, clean_run)
    assert leftovers(out) == []
    again = (out / "part-00000.h5ad").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    assert [p["file"] for p in manifest(out)["parts"]] == [p.name for p in parts]


def test_rerun_skips_complete_parts(inputs, tmp_path, monkeypatch):
    paths = inputs[(3, False)]
    parts = preshuffle(paths, tmp_path, cells_per_file=100, progress=False)

    def fail(*args, **kwargs):
        raise AssertionError("nothing should be rewritten")

    monkeypatch.setattr(preshuffle_writer.Writer, "write_part", fail)
    assert preshuffle(paths, tmp_path, cells_per_file=100, progress=False) == parts


def test_truncated_or_foreign_file_at_final_name_is_redone(inputs, clean_run, tmp_path):
    paths = inputs[(3, False)]
    out = tmp_path / "out"
    preshuffle(paths, out, cells_per_file=100, progress=False)
    # Truncated part 1, part 0 replaced by a file without the completion
    # marker, part 2 by a complete part of another run (seed 1).
    part1 = out / "part-00001.h5ad"
    with open(part1, "r+b") as f:
        f.truncate(part1.stat().st_size // 2)
    shutil.copy(paths[0], out / "part-00000.h5ad")
    other = preshuffle(
        paths, tmp_path / "seed1", seed=1, cells_per_file=100, progress=False
    )
    shutil.copy(other[2], out / "part-00002.h5ad")

    parts = preshuffle(paths, out, cells_per_file=100, progress=False)
    assert_same_parts(parts, clean_run)
    assert leftovers(out) == []


def test_completion_marker_records_the_arguments(inputs, tmp_path):
    paths = inputs[(3, False)]
    parts = preshuffle(paths, tmp_path, cells_per_file=100, seed=3, progress=False)
    with h5py.File(parts[1], "r") as f:
        marker = json.loads(f.attrs[preshuffle_lib.MARKER_ATTR])
    assert marker["part"] == 1 and marker["parts"] == 3
    assert marker["fingerprint"]["seed"] == 3
    inputs = marker["fingerprint"]["inputs"]  # by content, not path
    assert [i["cells"] for i in inputs] == [97, 130, 61]
    assert [i["bytes"] for i in inputs] == [os.path.getsize(p) for p in paths]
    assert all(len(i["layout"]) == len(i["sample"]) == 16 for i in inputs)
    assert paths[0] not in json.dumps(marker)


def test_fewer_parts_on_rerun_removes_stale_parts(inputs, tmp_path):
    paths = inputs[(3, False)]
    preshuffle(paths, tmp_path, cells_per_file=100, progress=False)
    parts = preshuffle(paths, tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.glob("part-*.h5ad")) == ["part-00000.h5ad"]
    assert_same_cells(parts, paths)


# --------------------------------------------------------------------------- #
# Memory.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dense", [False, True], ids=["csr", "dense"])
def test_small_memory_budget_uses_many_windows(inputs, tmp_path, dense):
    paths = inputs[(3, dense)]
    big = preshuffle(paths, tmp_path / "big", cells_per_file=150, progress=False)
    small = preshuffle(
        paths,
        tmp_path / "small",
        cells_per_file=150,
        memory_budget_bytes=5_000,
        progress=False,
    )
    assert [p["windows"] for p in manifest(tmp_path / "big")["parts"]] == [1, 1]
    stats = manifest(tmp_path / "small")["parts"]
    assert min(p["windows"] for p in stats) >= 3, stats
    # Two windows are in flight at once (one assembled, one written).
    assert 2 * max(p["largest_window_bytes"] for p in stats) <= 5_000
    assert_same_parts(small, big)
    assert_same_cells(small, paths)


def test_budget_below_one_cell_still_works(inputs, tmp_path):
    paths = inputs[(3, False)]
    parts = preshuffle(paths, tmp_path, memory_budget_bytes=1, progress=False)
    assert manifest(tmp_path)["parts"][0]["windows"] == sum(SIZES)
    assert_same_cells(parts, paths)


# --------------------------------------------------------------------------- #
# Errors.
# --------------------------------------------------------------------------- #


def test_inputs_with_different_var_names(tmp_path):
    a = write_inputs(tmp_path / "a", sizes=(20,))
    b = write_inputs(tmp_path / "b", sizes=(20,), genes=[*GENES[:-1], "other"])
    with pytest.raises(grain_cells.errors.GeneMismatchError, match="other") as info:
        preshuffle([*a, *b], tmp_path / "out", progress=False)
    assert a[0] in str(info.value) and b[0] in str(info.value)
    assert not (tmp_path / "out").exists()


def test_output_dir_is_a_file(inputs, tmp_path):
    target = tmp_path / "taken"
    target.write_text("x")
    with pytest.raises(NotADirectoryError, match=str(target)):
        preshuffle(inputs[(3, False)], target, progress=False)


def test_no_inputs(tmp_path):
    with pytest.raises(ValueError, match="inputs is empty"):
        preshuffle([], tmp_path, progress=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"compression": "zstd"}, "compression", id="compression"),
        pytest.param({"cells_per_file": 0}, "cells_per_file", id="cells_per_file"),
        pytest.param({"seed": -1}, "seed", id="seed"),
        pytest.param({"memory_budget_bytes": 0}, "memory_budget", id="budget"),
        pytest.param({"chunk_cells": 1.5}, "chunk_cells", id="chunk_cells"),
    ],
)
def test_bad_arguments(inputs, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        preshuffle(inputs[(3, False)], tmp_path, progress=False, **kwargs)


def test_missing_obs_column_names_the_file(inputs, tmp_path):
    paths = inputs[(3, False)]
    with pytest.raises(grain_cells.errors.MissingColumnError, match="nope") as info:
        preshuffle(paths, tmp_path, obs_columns=["idx", "nope"], progress=False)
    assert paths[0] in str(info.value)


def test_input_that_is_an_output_part_is_refused(inputs, tmp_path):
    parts = preshuffle(inputs[(3, False)], tmp_path, progress=False)
    with pytest.raises(ValueError, match="is an input and also output part"):
        preshuffle(parts, tmp_path, progress=False)


def test_progress_line_on_stderr(inputs, tmp_path, capsys):
    preshuffle(inputs[(3, False)], tmp_path, progress=True)
    err = capsys.readouterr().err
    assert "preshuffle: 100%" in err and f"{sum(SIZES)}/{sum(SIZES)} [" in err
    assert "cells/s]" in err and err.endswith("\n")
    preshuffle(inputs[(3, False)], tmp_path, progress=True)  # nothing left to do
    assert capsys.readouterr().err == (
        f"preshuffle: 1 of 1 part(s) already complete in {tmp_path}\n"
    )
    preshuffle(inputs[(3, False)], tmp_path / "quiet", progress=False)
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- #
# Restarts by content, gene alignment, full disk.
# --------------------------------------------------------------------------- #


def negate_in_place_keep_mtime(path):
    """Rewrites X's values (same size and layout), then restores the mtime."""
    st = os.stat(path)
    with h5py.File(path, "r+") as f:
        data = f["X/data"]
        data[...] = -data[...]
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size


def test_input_changed_with_mtime_restored_is_redone(tmp_path):
    paths = write_inputs(tmp_path / "in", sizes=(40, 30))
    out = tmp_path / "out"
    preshuffle(paths, out, cells_per_file=35, progress=False)
    negate_in_place_keep_mtime(paths[1])  # as `cp -p` of changed data would
    parts = preshuffle(paths, out, cells_per_file=35, progress=False)
    got = read_back(parts)
    ref = read_back(paths)
    order = np.argsort(got.obs["idx"].to_numpy())
    np.testing.assert_array_equal(dense_x(got)[order], dense_x(ref))
    assert dense_x(ref)[40:].min() < 0  # the new values, not the stale ones


def test_inputs_moved_to_another_folder_are_not_redone(tmp_path, monkeypatch):
    paths = write_inputs(tmp_path / "in", sizes=(40, 30))
    out = tmp_path / "out"
    parts = preshuffle(paths, out, cells_per_file=35, progress=False)
    moved = shutil.copytree(tmp_path / "in", tmp_path / "moved")
    new_paths = [str(moved / os.path.basename(p)) for p in paths]

    def fail(*args, **kwargs):
        raise AssertionError("nothing should be rewritten")

    monkeypatch.setattr(preshuffle_writer.Writer, "write_part", fail)
    assert preshuffle(new_paths, out, cells_per_file=35, progress=False) == parts


def write_other_genes(a_path, b_path):
    """File b: a's cells renamed, its genes reversed and g5 renamed "other"."""
    adata = anndata.read_h5ad(a_path)
    b = adata[:, ::-1].copy()
    b.var_names = ["other" if g == "g5" else g for g in b.var_names]
    b.obs_names = [f"b_{n}" for n in b.obs_names]
    b.obs["idx"] = b.obs["idx"] + 1000
    b.obs["barcode"] = [f"b_{v}" for v in b.obs["barcode"]]
    b.write_h5ad(b_path, convert_strings_to_categoricals=False)
    return str(b_path)


@pytest.mark.parametrize(
    "join, genes",
    [
        pytest.param("inner", None, id="inner"),
        pytest.param("outer", None, id="outer"),
        pytest.param("outer", ["g3", "other", "g1"], id="outer-genes"),
        pytest.param("inner", ["g7", "g0"], id="inner-genes"),
    ],
)
def test_gene_alignment(tmp_path, join, genes):
    (a,) = write_inputs(tmp_path / "a", sizes=(30,))
    b = write_other_genes(a, tmp_path / "b.h5ad")
    parts = preshuffle(
        [a, b], tmp_path / "out", join=join, genes=genes, seed=1, progress=False
    )
    got = anndata.read_h5ad(parts[0])
    source = grain_cells.AnnDataSource([a, b], join=join, genes=genes)
    np.testing.assert_array_equal(got.var_names, source.var_names)
    if genes is not None:
        assert list(got.var_names) == genes
    elif join == "inner":
        assert list(got.var_names) == [g for g in GENES if g != "g5"]
    else:
        assert list(got.var_names) == [*GENES, "other"]
    assert got.X.has_sorted_indices
    ref = anndata.concat(
        [anndata.read_h5ad(a), anndata.read_h5ad(b)], join="outer", merge="same"
    )
    ref = ref[got.obs_names, list(got.var_names)]
    np.testing.assert_array_equal(dense_x(got), dense_x(ref))
    assert got.n_obs == 60


def test_gene_alignment_changes_the_fingerprint(tmp_path):
    (a,) = write_inputs(tmp_path / "a", sizes=(30,))
    b = write_other_genes(a, tmp_path / "b.h5ad")
    out = tmp_path / "out"
    preshuffle([a, b], out, join="inner", progress=False)
    (outer,) = preshuffle([a, b], out, join="outer", progress=False)
    assert anndata.read_h5ad(outer).n_vars == N_GENES + 1


def test_gene_mismatch_error_suggests_join_which_works(tmp_path):
    (a,) = write_inputs(tmp_path / "a", sizes=(30,))
    b = write_other_genes(a, tmp_path / "b.h5ad")
    with pytest.raises(grain_cells.errors.GeneMismatchError, match="join="):
        preshuffle([a, b], tmp_path / "out", progress=False)
    preshuffle([a, b], tmp_path / "out", join="inner", progress=False)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 4 MiB tmpfs (needs root; skipped where mounting is not permitted)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def write_big_inputs(directory, n=20000, genes=200):
    """One CSR input of 3.2 MB of values: a quarter of it fits in 4 MiB, not two."""
    directory.mkdir(parents=True, exist_ok=True)
    x = sp.random(n, genes, density=0.1, format="csr", dtype=np.float32, rng=0)
    obs = pd.DataFrame({"idx": np.arange(n)}, index=[f"c{i}" for i in range(n)])
    var = pd.DataFrame(index=[f"g{j}" for j in range(genes)])
    path = directory / "big.h5ad"
    anndata.AnnData(X=x, obs=obs, var=var).write_h5ad(path)
    return [str(path)]


def test_disk_full_raises_cleanly_and_keeps_complete_parts(tmp_path, tiny_disk):
    paths = write_big_inputs(tmp_path / "in")
    out = tiny_disk / "out"
    with pytest.raises(OSError) as e:
        preshuffle(paths, out, cells_per_file=5000, progress=False)
    assert e.value.errno == errno.ENOSPC
    message = str(e.value)
    assert str(out) in message and "bytes" in message and "free" in message
    names = sorted(p.name for p in out.iterdir())
    assert leftovers(out) == []  # no temporary left
    assert preshuffle_lib.MANIFEST not in names  # the run does not look done
    # The parts written before the disk filled are kept, and complete.
    assert 0 < len(names) < 4
    assert names == [f"part-{i:05d}.h5ad" for i in range(len(names))]
    for name in names:
        got = anndata.read_h5ad(out / name)
        assert got.n_obs == 5000
        ref = anndata.read_h5ad(paths[0])[got.obs_names]
        np.testing.assert_array_equal(dense_x(got), dense_x(ref))


@pytest.mark.slow  # a subprocess: ~4 s
def test_disk_full_in_a_subprocess_exits_normally(tmp_path, tiny_disk):
    """No SIGBUS/SIGSEGV at exit, even when HDF5 itself meets the full disk
    (here the space reservation is bypassed)."""
    paths = write_big_inputs(tmp_path / "in")
    script = (
        "import sys\n"
        "from grain_cells import preshuffle\n"
        "try:\n"
        "    preshuffle([sys.argv[1]], sys.argv[2], progress=False)\n"
        "except OSError as e:\n"
        "    print('ENOSPC' if e.errno == 28 else e)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", script, paths[0], str(tiny_disk / "out")],
        capture_output=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().strip() == "ENOSPC"
    assert list((tiny_disk / "out").iterdir()) == []


@pytest.mark.parametrize("alphabet", ["abc0123456789", "細胞型δ"], ids=["ascii", "cjk"])
def test_names_disk_bound_holds_for_any_utf8(tmp_path, alphabet):
    """A part's reservation counts obs names once; the bound must hold for
    names of up to 4 UTF-8 bytes per character, as h5py stores them."""
    from grain_cells.preshuffle import _frames as _names

    rng = np.random.default_rng(0)
    n = 20_000
    chars = rng.integers(1, 40, n)
    names = np.array(
        ["".join(rng.choice(list(alphabet), k)) for k in chars],
        dtype=np.dtypes.StringDType(),
    )
    bound = _names.Names(names, float(chars.mean())).disk_bytes(n)
    empty, full = tmp_path / "empty.h5", tmp_path / "full.h5"
    with h5py.File(empty, "w") as f:
        f.create_dataset("_index", (0,), dtype=h5py.string_dtype())
    with h5py.File(full, "w") as f:
        d = f.create_dataset("_index", (n,), dtype=h5py.string_dtype())
        d[:] = names.astype(object)
    assert full.stat().st_size - empty.stat().st_size <= bound
