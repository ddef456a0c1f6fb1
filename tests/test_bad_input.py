"""Bad input: every failure is a clear error that names the file, never wrong data.

Files are small and written with anndata (or edited with h5py). Stored values
encode their position: the value at (row i, column j) is `i * 100 + j + 1`
(plus `100 * row_offset` for the second file of a source), so any misplaced
value shows up in the comparisons.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import re
import shutil
import warnings

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from grain_cells import AnnDataSource
from grain_cells.errors import (
    AnnDataFormatError,
    CorruptDataError,
    GeneMismatchError,
    MissingColumnError,
    SourceChangedError,
    UnsupportedLayoutError,
)

N_OBS, N_VARS = 300, 30
BAD_INDPTR_ROW = 7
BAD_INDEX_ROW = 12
# Longest any single read of these tiny files may take before it counts as a hang.
HANG_S = 20


# -- helpers ------------------------------------------------------------------


def expected_x(n_obs=N_OBS, n_vars=N_VARS, *, row_offset=0, seed=0) -> sp.csr_matrix:
    """A CSR matrix whose value at (i, j) is (i + row_offset) * 100 + j + 1."""
    rng = np.random.default_rng(seed)
    mask = rng.random((n_obs, n_vars)) < 0.3
    mask[:, 0] = True  # every row has stored values
    mask[:, n_vars - 1] = True
    i, j = np.nonzero(mask)
    values = ((i + row_offset) * 100 + j + 1).astype(np.float32)
    x = sp.csr_matrix((values, (i, j)), shape=(n_obs, n_vars))
    x.sort_indices()
    return x


def make_adata(
    n_obs=N_OBS, n_vars=N_VARS, *, layout="csr", row_offset=0, var_names=None, seed=0
) -> anndata.AnnData:
    x = expected_x(n_obs, n_vars, row_offset=row_offset, seed=seed)
    if layout == "dense":
        x = x.toarray()
    elif layout == "csc":
        x = sp.csc_matrix(x)
    rng = np.random.default_rng(seed)
    obs = pd.DataFrame(
        {
            "cell_line": pd.Categorical(rng.choice(["a", "b", "c"], n_obs)),
            "n_counts": np.arange(n_obs, dtype=np.float64),
        },
        index=[f"cell{row_offset + k}" for k in range(n_obs)],
    )
    if var_names is None:
        var_names = [f"g{k}" for k in range(n_vars)]
    return anndata.AnnData(X=x, obs=obs, var=pd.DataFrame(index=var_names))


def write(path, *, compression=None, chunks=None, **kwargs):
    """Writes a valid file and returns its path.

    `chunks` rewrites X's datasets with that many elements (rows) per chunk,
    so that reads span several chunks (anndata writes these tiny ones as one).
    """
    make_adata(**kwargs).write_h5ad(path, compression=compression)
    if chunks is not None:
        with h5py.File(path, "r+") as f:
            x = f["X"]
            for ds in [x] if isinstance(x, h5py.Dataset) else list(x.values()):
                values, attrs = ds[()], dict(ds.attrs)
                name = ds.name
                del f[name]
                new = f.create_dataset(
                    name,
                    data=values,
                    compression=compression,
                    chunks=(chunks, *values.shape[1:]),
                )
                new.attrs.update(attrs)
    return path


LAYOUTS = [
    pytest.param({}, id="csr"),
    pytest.param({"compression": "gzip"}, id="csr-gzip"),
    pytest.param({"chunks": 256}, id="csr-chunked"),
    pytest.param({"compression": "gzip", "chunks": 256}, id="csr-gzip-chunked"),
    pytest.param({"layout": "dense"}, id="dense"),
    pytest.param({"layout": "dense", "chunks": 32}, id="dense-chunked"),
]
SPARSE_LAYOUTS = LAYOUTS[:4]


def as_dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def assert_reads(source, rows, expected):
    """source.read(rows) returns exactly `expected`'s rows (dense comparison)."""
    rows = np.asarray(rows)
    cells = source.read(rows)
    np.testing.assert_array_equal(cells.row_ids, rows)
    np.testing.assert_array_equal(as_dense(cells.X), as_dense(expected[rows]))


def path_re(path) -> str:
    return re.escape(os.fspath(path))


def with_deadline(fn, *args):
    """Runs fn(*args) in a thread; fails the test instead of hanging."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args).result(timeout=HANG_S)
    except concurrent.futures.TimeoutError:
        pytest.fail(f"{fn} did not return within {HANG_S} s")
    finally:
        pool.shutdown(wait=False)


def x_byte_ranges(path) -> list[tuple[int, int]]:
    """(first, end) file bytes of every stored piece of the file's X."""
    out = []
    with h5py.File(path, "r") as f:
        x = f["X"]
        datasets = [x] if isinstance(x, h5py.Dataset) else [x[k] for k in x]
        for ds in datasets:
            if ds.chunks is None:
                out.append(
                    (ds.id.get_offset(), ds.id.get_offset() + ds.id.get_storage_size())
                )
            else:
                ds.id.chunk_iter(
                    lambda c: out.append((c.byte_offset, c.byte_offset + c.size))
                )
    return out


# Where to cut a file, as a function of (file size, X's byte ranges).
CUTS = [
    pytest.param(lambda size, x: size // 2, id="half"),
    pytest.param(lambda size, x: size - 4096, id="last-4KB"),
    # One byte into X's first / last stored piece (dataset or chunk): most, or
    # a little, of X's values are gone (a chunk's tail can be padding).
    pytest.param(lambda size, x: min(s for s, _ in x) + 1, id="X-first-piece"),
    pytest.param(lambda size, x: max(s for s, _ in x) + 1, id="X-last-piece"),
]


# -- 1, 2, 4, 15: not a readable file -------------------------------------------


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.h5ad"
    with pytest.raises(FileNotFoundError, match=path_re(missing)):
        AnnDataSource(missing)
    good = write(tmp_path / "good.h5ad")
    with pytest.raises(FileNotFoundError, match=path_re(missing)):
        AnnDataSource([good, missing])


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"cell,gene,count\n0,0,1\n", id="text"),
        pytest.param(b"", id="empty"),
        pytest.param(bytes(range(256)) * 64, id="binary"),
    ],
)
def test_not_hdf5(tmp_path, content):
    path = tmp_path / "x.h5ad"
    path.write_bytes(content)
    with pytest.raises(AnnDataFormatError, match=path_re(path)) as e:
        AnnDataSource(path)
    assert "not an HDF5 file" in str(e.value)


def test_directory(tmp_path):
    path = tmp_path / "store.h5ad"
    path.mkdir()
    with pytest.raises(AnnDataFormatError, match=path_re(path)) as e:
        AnnDataSource(path)
    assert "is a directory but not a zarr store" in str(e.value)


def test_hdf5_but_not_anndata(tmp_path):
    path = tmp_path / "x.h5"
    with h5py.File(path, "w") as f:
        f["random"] = np.random.default_rng(0).random((10, 5))
    with pytest.raises(AnnDataFormatError, match=path_re(path)) as e:
        AnnDataSource(path)
    assert "not AnnData" in str(e.value)
    assert "['random']" in str(e.value)


# -- 3: truncated files ---------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cut", CUTS)
def test_truncated_before_build(tmp_path, layout, cut):
    path = write(tmp_path / "x.h5ad", **layout)
    os.truncate(path, cut(os.path.getsize(path), x_byte_ranges(path)))

    def build_and_read():
        source = AnnDataSource(path)
        return source.read(np.arange(source.num_cells))

    with pytest.raises(AnnDataFormatError, match=path_re(path)) as e:
        with_deadline(build_and_read)
    assert "truncated" in str(e.value)


@pytest.mark.parametrize(
    "keep", [lambda size: size // 2, lambda size: 1000], ids=["half", "1000-bytes"]
)
def test_truncated_is_not_reported_as_a_lock(tmp_path, keep):
    """HDF5 refuses to open a file shorter than its superblock's end-of-file
    address: the message says so with both sizes and asks for a new copy,
    never the file-lock advice (which changes nothing)."""
    path = write(tmp_path / "x.h5ad")
    size = os.path.getsize(path)
    os.truncate(path, keep(size))
    with pytest.raises(AnnDataFormatError, match=path_re(path)) as e:
        AnnDataSource(path)
    message = str(e.value)
    assert f"the file is truncated: its superblock records {size:,} bytes" in message
    assert f"only {keep(size):,} bytes are on disk" in message
    assert "copy the file again" in message
    assert "HDF5_USE_FILE_LOCKING" not in message
    assert "holds it open" not in message


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("opened", [False, True], ids=["lazy", "opened"])
def test_truncated_after_build(tmp_path, layout, cut, opened):
    """Truncated under a built source: its next read fails, or is still right."""
    path = write(tmp_path / "x.h5ad", **layout)
    expected = expected_x()
    source = AnnDataSource(path, obs_columns=["cell_line"])
    if opened:  # this process holds handles from before the cut
        assert_reads(source, [0], expected)
    x_ranges = x_byte_ranges(path)
    new_size = cut(os.path.getsize(path), x_ranges)
    os.truncate(path, new_size)
    rows = np.arange(N_OBS)
    try:
        cells = with_deadline(source.read, rows)
    except AnnDataFormatError as e:
        assert os.fspath(path) in str(e)
        assert "truncated" in str(e)
    else:
        # Only from handles opened before the cut, and only when the bytes
        # the read needs survived it (or sit in HDF5's chunk cache).
        assert opened
        np.testing.assert_array_equal(as_dense(cells.X), expected.toarray())
        if max(start for start, _ in x_ranges) >= new_size:
            # X lost bytes: only decompressed chunks HDF5 cached when the first
            # read read the whole (single-chunk) dataset can explain a success.
            assert layout.get("compression") == "gzip" and "chunks" not in layout
    source.close()


# -- 5, 6: no X, or X in a layout this reader refuses -----------------------------


def test_no_x_at_all(tmp_path):
    path = tmp_path / "x.h5ad"
    anndata.AnnData(shape=(10, 20)).write_h5ad(path)
    with pytest.raises(MissingColumnError, match=path_re(path)) as e:
        AnnDataSource(path)
    assert "has no X" in str(e.value)
    assert "Matrices in this file: none" in str(e.value)


def test_no_x_but_a_layer(tmp_path):
    path = tmp_path / "x.h5ad"
    full = make_adata()
    adata = anndata.AnnData(obs=full.obs, var=full.var, layers={"counts": full.X})
    adata.write_h5ad(path)
    with h5py.File(path, "r") as f:
        assert "X" not in f
    with pytest.raises(MissingColumnError, match=path_re(path)) as e:
        AnnDataSource(path)
    assert "has no X" in str(e.value)
    assert "layers/counts" in str(e.value)
    with pytest.raises(MissingColumnError, match=r"has no layers/nope.*layers/counts"):
        AnnDataSource(path, layer="nope")

    source = AnnDataSource(path, layer="counts")
    assert source.num_cells == N_OBS
    assert_reads(source, [299, 0, 7, 7, 150], expected_x())


def test_csc(tmp_path):
    path = write(tmp_path / "x.h5ad", layout="csc")
    with pytest.raises(UnsupportedLayoutError, match=path_re(path)) as e:
        AnnDataSource(path)
    assert "csc_matrix" in str(e.value)
    assert "tocsr()" in str(e.value)


@pytest.mark.parametrize(
    "frame, message",
    [
        pytest.param("obs", f"X has {N_OBS} rows but obs has {N_OBS - 1}", id="obs"),
        pytest.param(
            "var", f"X has {N_VARS} columns but its var has {N_VARS - 1}", id="var"
        ),
    ],
)
def test_matrix_and_frame_disagree(tmp_path, frame, message):
    path = write(tmp_path / "x.h5ad")
    with h5py.File(path, "r+") as f:
        # Whatever encoding this anndata wrote the index in (a string array,
        # or a nullable-string-array group with anndata 0.13 and pandas 3).
        values = anndata.io.read_elem(f[f"{frame}/_index"])[:-1]
        del f[f"{frame}/_index"]
        anndata.io.write_elem(f[frame], "_index", values)
    with pytest.raises(AnnDataFormatError, match=path_re(path)) as e:
        AnnDataSource(path)
    assert message in str(e.value)


# -- 7, 8: stored values that contradict the format -------------------------------


@pytest.mark.parametrize("layout", SPARSE_LAYOUTS)
def test_indptr_decreasing(tmp_path, layout):
    path = write(tmp_path / "x.h5ad", **layout)
    r = BAD_INDPTR_ROW
    with h5py.File(path, "r+") as f:
        indptr = f["X/indptr"]
        indptr[r + 1] = indptr[r] - 1
    source = AnnDataSource(path, block_size=4)  # only indptr's ends are checked
    expected = expected_x()

    def fails(read, *args):
        with pytest.raises(CorruptDataError, match=path_re(path)) as e:
            read(*args)
        assert f"corrupt at row {r}:" in str(e.value)

    fails(source.read, [r])
    fails(source.read, [250, r, 3])
    fails(source.read, np.arange(N_OBS))
    fails(source.read_ranges, [0], [20])
    fails(source.read_blocks, [r // 4])
    # Rows whose indptr entries are intact still read correctly (rows r and
    # r + 1 share the bad entry).
    good = np.r_[0:r, r + 2 : N_OBS]
    assert_reads(source, good, expected)
    assert_reads(source, good[::-1], expected)


@pytest.mark.parametrize(
    "end, what",
    [
        pytest.param(0, "first", id="indptr[0]=1"),
        pytest.param(-1, "last", id="indptr[-1]=nnz-1"),
    ],
)
def test_indptr_ends(tmp_path, end, what):
    path = write(tmp_path / "x.h5ad")
    with h5py.File(path, "r+") as f:
        indptr = f["X/indptr"]
        nnz = f["X/data"].shape[0]
        indptr[end] = 1 if what == "first" else nnz - 1
    with pytest.raises(CorruptDataError, match=path_re(path)) as e:
        AnnDataSource(path)
    assert f"expected 0 to {nnz}" in str(e.value)


@pytest.mark.parametrize("layout", SPARSE_LAYOUTS)
@pytest.mark.parametrize("bad_column", [N_VARS, 10**6, -1])
def test_index_out_of_range(tmp_path, layout, bad_column):
    path = write(tmp_path / "x.h5ad", **layout)
    r = BAD_INDEX_ROW
    with h5py.File(path, "r+") as f:
        start, stop = f["X/indptr"][r : r + 2]
        assert stop - start >= 2
        f["X/indices"][start + 1] = bad_column
    expected = expected_x()
    genes = [f"g{k}" for k in range(0, N_VARS, 2)]
    for kwargs in ({}, {"genes": genes}):
        source = AnnDataSource(path, **kwargs)
        for rows in ([r], [r - 1, r, r + 1], [200, r], np.arange(N_OBS)):
            with pytest.raises(CorruptDataError, match=path_re(path)) as e:
                source.read(rows)
            assert f"holds column {bad_column} in row {r};" in str(e.value)
    source = AnnDataSource(path)
    good = np.r_[0:r, r + 1 : N_OBS]
    assert_reads(source, good, expected)


# -- 9, 13, 14: asking for what is not there ------------------------------------


def test_missing_obs_column(tmp_path):
    path = write(tmp_path / "x.h5ad")
    with pytest.raises(MissingColumnError, match=path_re(path)) as e:
        AnnDataSource(path, obs_columns=["cell_line", "nope"])
    assert "'nope'" in str(e.value)
    assert "['cell_line', 'n_counts']" in str(e.value)


@pytest.mark.parametrize(
    "var_names, where",
    [
        pytest.param(
            [f"g{k}" if k != 5 else "x5" for k in range(N_VARS)],
            ["position 5:", "g5", "x5"],
            id="renamed",
        ),
        pytest.param(
            [f"g{k}" for k in range(N_VARS + 1)],
            [f"{N_VARS} genes in", f"{N_VARS + 1} in"],
            id="extra-gene",
        ),
        pytest.param(
            [f"g{k}" for k in reversed(range(N_VARS))],
            ["position 0:", "g0", f"g{N_VARS - 1}"],
            id="reordered",
        ),
    ],
)
def test_gene_mismatch(tmp_path, var_names, where):
    first = write(tmp_path / "a.h5ad")
    second = write(tmp_path / "b.h5ad", n_vars=len(var_names), var_names=var_names)
    with pytest.raises(GeneMismatchError, match=path_re(second)) as e:
        AnnDataSource([first, second])
    assert os.fspath(first) in str(e.value)
    for part in where:
        assert part in str(e.value)


def test_missing_genes(tmp_path):
    path = write(tmp_path / "x.h5ad")
    with pytest.raises(MissingColumnError, match=path_re(path)) as e:
        AnnDataSource(path, genes=["g1", "nope", "g2", "also_nope"])
    assert "2 of the requested genes" in str(e.value)
    assert "['nope', 'also_nope']" in str(e.value)


@pytest.mark.parametrize(
    "genes, error, message",
    [
        pytest.param([0, N_VARS], IndexError, f"[0, {N_VARS})", id="position"),
        pytest.param([-1], IndexError, f"[0, {N_VARS})", id="negative"),
        pytest.param(np.ones(N_VARS - 1, bool), ValueError, "mask", id="mask"),
        pytest.param(["g1", "g1"], ValueError, "more than once", id="duplicate"),
    ],
)
def test_bad_gene_subset(tmp_path, genes, error, message):
    path = write(tmp_path / "x.h5ad")
    with pytest.raises(error, match=re.escape(message)):
        AnnDataSource(path, genes=genes)


# -- 10, 11, 15: bad arguments ----------------------------------------------------


def test_row_out_of_range(tmp_path):
    path = write(tmp_path / "x.h5ad")
    source = AnnDataSource(path, block_size=16)
    n = source.num_cells
    for rows in ([n], [-1], [0, 5, n + 10]):
        with pytest.raises(IndexError, match=f"the source has {n} cells") as e:
            source.read(rows)
        assert os.fspath(path) in str(e.value)
    with pytest.raises(IndexError, match=f"this source has {len(source)} blocks"):
        source[len(source)]
    with pytest.raises(IndexError, match="out of range"):
        source[-1]
    with pytest.raises(IndexError, match=f"the source has {n} cells"):
        source.read_ranges([n - 1], [n + 1])
    with pytest.raises(IndexError, match="out of range"):
        source.read_blocks([len(source)])
    with pytest.raises(TypeError, match="integers"):
        source.read([0.5])


def test_range_straddles_files(tmp_path):
    a = write(tmp_path / "a.h5ad")
    b = write(tmp_path / "b.h5ad", row_offset=N_OBS)
    source = AnnDataSource([a, b])
    with pytest.raises(IndexError, match="straddle two files"):
        source.read_ranges([N_OBS - 2], [N_OBS + 2])
    # read() splits runs at file boundaries itself.
    both = sp.vstack([expected_x(), expected_x(row_offset=N_OBS)]).tocsr()
    assert_reads(source, np.arange(N_OBS - 2, N_OBS + 2), both)


@pytest.mark.parametrize("paths", [[], ()], ids=["list", "tuple"])
def test_empty_path_list(paths):
    with pytest.raises(ValueError, match="paths is empty"):
        AnnDataSource(paths)


@pytest.mark.parametrize("block_size", [0, -1, 1.5])  # None: the default
def test_bad_block_size(tmp_path, block_size):
    path = write(tmp_path / "x.h5ad")
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        AnnDataSource(path, block_size=block_size)


def test_unsupported_obs_dtype(tmp_path):
    path = tmp_path / "x.h5ad"
    adata = make_adata()
    adata.obs["phase"] = np.arange(N_OBS) * (1 + 1j)
    adata.write_h5ad(path)
    with pytest.raises(UnsupportedLayoutError, match=path_re(path)) as e:
        AnnDataSource(path, obs_columns=["phase"])
    assert "'phase'" in str(e.value)
    assert "complex128" in str(e.value)


def test_unreadable_obs_column(tmp_path):
    path = write(tmp_path / "x.h5ad")
    with h5py.File(path, "r+") as f:
        del f["obs/cell_line/codes"]
    with pytest.raises(AnnDataFormatError, match=path_re(path)) as e:
        AnnDataSource(path, obs_columns=["cell_line"])
    assert "'cell_line'" in str(e.value)
    AnnDataSource(path, obs_columns=["n_counts"])  # other columns still work


def test_obs_codes_out_of_range_refused_at_first_read(tmp_path):
    """A source takes a categorical column's kind from its metadata, so it
    does not read the codes to build; codes outside the categories are
    refused when they are first read, before any value reaches the user."""
    path = write(tmp_path / "x.h5ad")
    with h5py.File(path, "r+") as f:
        f["obs/cell_line/codes"][3] = len(f["obs/cell_line/categories"]) + 5
    source = AnnDataSource(path, obs_columns=["cell_line"])
    with pytest.raises(AnnDataFormatError, match=path_re(path)) as e:
        source.read(np.arange(N_OBS))
    assert "'cell_line'" in str(e.value)
    assert "codes need to be between -1 and len(categories)-1" in str(e.value)
    AnnDataSource(path, obs_columns=["n_counts"]).read(np.arange(N_OBS))


def test_obs_column_wrong_length(tmp_path):
    path = write(tmp_path / "x.h5ad")
    with h5py.File(path, "r+") as f:
        values = f["obs/n_counts"][:-1]
        del f["obs/n_counts"]
        f["obs/n_counts"] = values
        f["obs/n_counts"].attrs.update(
            {"encoding-type": "array", "encoding-version": "0.2.0"}
        )
    with pytest.raises(AnnDataFormatError, match=path_re(path)) as e:
        AnnDataSource(path, obs_columns=["n_counts"])
    assert "'n_counts'" in str(e.value)
    assert f"has {N_OBS - 1} values; obs's index has {N_OBS} cells" in str(e.value)


# -- 12: files that change under a source ----------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"n_obs": N_OBS - 10}, id="fewer-cells"),
        pytest.param({"n_vars": N_VARS + 1}, id="more-genes"),
        pytest.param({"seed": 1}, id="other-nnz"),
        pytest.param({"layout": "dense"}, id="dense"),
    ],
)
@pytest.mark.parametrize("when", ["unopened", "closed"])
def test_source_changed(tmp_path, change, when):
    path = write(tmp_path / "x.h5ad")
    source = AnnDataSource(path, obs_columns=["cell_line"])
    if when == "closed":  # read, then give the handles back
        assert_reads(source, [0, 1], expected_x())
        source.close()
    pickled = pickle.dumps(source)
    write(path, **change)
    copy = pickle.loads(pickled)
    copy_after = pickle.loads(pickle.dumps(source))
    for s in (source, copy, copy_after):
        with pytest.raises(SourceChangedError, match=path_re(path)) as e:
            s.read([0])
        assert "changed since the AnnDataSource was built" in str(e.value)
        with pytest.raises(SourceChangedError, match=path_re(path)):
            s.read([1])  # still failing: nothing half-open was cached
    source.close()


# -- errors do not poison later reads --------------------------------------------


def test_errors_do_not_poison_state(tmp_path):
    good_path = write(tmp_path / "good.h5ad")
    bad_path = write(tmp_path / "bad.h5ad", row_offset=N_OBS)
    with h5py.File(bad_path, "r+") as f:
        start = f["X/indptr"][BAD_INDEX_ROW]
        f["X/indices"][start] = 10**6
    expected = sp.vstack([expected_x(), expected_x(row_offset=N_OBS)]).tocsr()
    source = AnnDataSource(
        [good_path, bad_path], obs_columns=["cell_line"], block_size=8
    )
    n = source.num_cells
    sample = np.array([0, 299, 5, 6, 7, 150, 300, 599, 301])
    bad_row = N_OBS + BAD_INDEX_ROW
    failing = [
        (IndexError, lambda: source.read([n])),
        (IndexError, lambda: source.read([-1])),
        (IndexError, lambda: source[len(source)]),
        (TypeError, lambda: source.read(np.array([0.5]))),
        (ValueError, lambda: source.read_ranges([0, 5], [10, 15])),
        (IndexError, lambda: source.read_ranges([N_OBS - 1], [N_OBS + 1])),
        (CorruptDataError, lambda: source.read([bad_row])),
        (CorruptDataError, lambda: source.read(np.arange(n))),  # large, both files
        (CorruptDataError, lambda: source.read([bad_row, 3, 4])),
        (CorruptDataError, lambda: source.read_ranges([N_OBS], [N_OBS + 40])),
    ]
    assert_reads(source, sample, expected)
    for error, call in failing:
        with pytest.raises(error):
            call()
        assert_reads(source, sample, expected)
        assert_reads(source, np.arange(N_OBS), expected)
        good_rows = np.r_[0:bad_row, bad_row + 1 : n]
        assert_reads(source, good_rows, expected)
        cells = source.read_ranges([10, N_OBS + 20], [18, N_OBS + 30])
        np.testing.assert_array_equal(
            as_dense(cells.X), expected[np.r_[10:18, N_OBS + 20 : N_OBS + 30]].toarray()
        )
    source.close()


def test_failed_open_is_retried_not_cached(tmp_path):
    """A file that fails to open fails every read; once restored from a backup
    it is another file (new times), which the source refuses by name and a
    new source reads."""
    path = write(tmp_path / "x.h5ad")
    backup = tmp_path / "backup.h5ad"
    shutil.copy2(path, backup)
    source = AnnDataSource(path)
    os.truncate(path, os.path.getsize(path) // 2)
    for _ in range(2):
        with pytest.raises(AnnDataFormatError, match=path_re(path)):
            source.read([0])
    shutil.copy2(backup, path)  # even with its mtime restored
    with pytest.raises(SourceChangedError, match="inode changed"):
        source.read([0])
    source.close()
    fresh = AnnDataSource(path)
    assert_reads(fresh, np.arange(N_OBS), expected_x())
    fresh.close()


@pytest.mark.parametrize(
    "name, hint",
    [
        ("*.h5ad", "paths are not globs: pass sorted(glob.glob("),
        ("part?.h5ad", "paths are not globs"),
        ("a.h5ad ", "white space"),
    ],
)
def test_a_missing_path_says_why_it_may_be_missing(tmp_path, name, hint):
    with pytest.raises(FileNotFoundError, match=re.escape(hint)):
        AnnDataSource(str(tmp_path / name))


def test_a_missing_path_under_the_home_tilde_says_it_is_not_expanded():
    with pytest.raises(FileNotFoundError, match="'~' is not expanded"):
        AnnDataSource("~/no-such-grain-cells-file.h5ad")


def test_a_path_listed_twice_warns_that_its_cells_repeat(tmp_path):
    a = write(tmp_path / "a.h5ad")
    b = write(tmp_path / "b.h5ad")
    with pytest.warns(
        UserWarning, match=r"a\.h5ad is listed 2 times in paths \(at \[0, 2\]"
    ):
        source = AnnDataSource([a, b, str(a)])  # (a glob's list plus a path, say)
    assert source.num_cells == 3 * N_OBS  # a warning, not a refusal: still read
    source.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AnnDataSource([a, b]).close()
