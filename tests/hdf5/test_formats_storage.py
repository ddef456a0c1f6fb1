"""How HDF5 stores a file never changes the values read, or fails by name.

User blocks, soft and external links, virtual datasets, third-party filters,
symlinks and files held by a writer. Files are written by anndata, then
re-laid out with h5py following the HDF5 spec; the value at (row i, gene j)
is `i * 100 + j + 1`, and `anndata.read_h5ad` is the oracle wherever it reads
the file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from grain_cells import AnnDataSource, CsrOutput, DenseOutput, PaddedSparseOutput
from grain_cells.errors import (
    AnnDataFormatError,
    CorruptDataError,
    UnsupportedLayoutError,
)

N_OBS, N_VARS = 41, 9


def value_matrix(n_obs=N_OBS, n_vars=N_VARS) -> sp.csr_matrix:
    rng = np.random.default_rng(0)
    mask = rng.random((n_obs, n_vars)) < 0.5
    i, j = np.nonzero(mask)
    x = sp.csr_matrix(
        ((i * 100 + j + 1).astype(np.float32), (i, j)), shape=(n_obs, n_vars)
    )
    x.sort_indices()
    return x


def make_adata(layout="csr", with_x=True) -> anndata.AnnData:
    x = value_matrix()
    return anndata.AnnData(
        X=(x if layout == "csr" else x.toarray()) if with_x else None,
        obs=pd.DataFrame(index=[f"cell{i}" for i in range(N_OBS)]),
        var=pd.DataFrame(index=[f"g{j}" for j in range(N_VARS)]),
        shape=None if with_x else (N_OBS, N_VARS),
    )


def write(path, layout="csr", chunks=None, **kwargs):
    """An anndata file; `chunks` re-chunks X's datasets (rows per chunk)."""
    make_adata(layout).write_h5ad(path, **kwargs)
    if chunks is not None:
        with h5py.File(path, "r+") as f:
            x = f["X"]
            for ds in [x] if isinstance(x, h5py.Dataset) else list(x.values()):
                values, attrs, name = ds[()], dict(ds.attrs), ds.name
                del f[name]
                f.create_dataset(name, data=values, chunks=(chunks, *values.shape[1:]))
                f[name].attrs.update(attrs)
    return path


def as_dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def truth(path, layer=None) -> np.ndarray:
    adata = anndata.read_h5ad(path)
    return as_dense(adata.X if layer is None else adata.layers[layer])


def loader_dense(source, output) -> np.ndarray:
    """Every cell through the fetch transform, dense, by row id."""
    import grain_cells

    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=1, num_epochs=1),
        operations=grain_cells.fetch_operations(
            source, batch_size=8, fetch_factor=2, output=output, seed=1
        ),
    )
    out = np.full((source.num_cells, source.num_genes), np.nan)
    for batch in loader:
        keep = batch["mask"]
        m = keep.size
        if isinstance(output, DenseOutput):
            dense = batch["X"]
        elif isinstance(output, CsrOutput):
            dense = sp.csr_matrix(
                (batch["data"], batch["indices"], batch["indptr"]),
                shape=(m, source.num_genes),
            ).toarray()
        else:
            dense = np.zeros((m, source.num_genes))
            rows = np.repeat(np.arange(m), output.width).reshape(m, -1)
            np.add.at(dense, (rows, batch["indices"]), batch["values"])
        out[batch["row_ids"][keep]] = dense[keep]
    return out


def assert_reads_exactly(path, expected, **kwargs):
    source = AnnDataSource(path, block_size=4, **kwargs)
    rows = np.arange(N_OBS)[::-1]
    np.testing.assert_array_equal(as_dense(source.read(rows).X), expected[rows])
    for output in (CsrOutput(), PaddedSparseOutput(width=N_VARS), DenseOutput()):
        np.testing.assert_array_equal(loader_dense(source, output), expected)
    return source


LAYOUTS = [
    pytest.param({}, id="csr"),
    pytest.param({"chunks": 8}, id="csr-chunked"),
    pytest.param({"layout": "dense"}, id="dense"),
    pytest.param({"layout": "dense", "chunks": 8}, id="dense-chunked"),
]


def with_userblock(src, dst, size=512):
    """Copies every element of `src` into a new file with a user block."""
    with h5py.File(src) as a, h5py.File(dst, "w", userblock_size=size) as b:
        b.attrs.update(dict(a.attrs))
        for key in a:
            a.copy(a[key], b, key)
    with open(dst, "r+b") as f:
        f.write(b"a user block, as every .h5mu has")
    return dst


# -- 2: user blocks ---------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_userblock(tmp_path, layout):
    plain = write(tmp_path / "plain.h5ad", **layout)
    path = with_userblock(plain, tmp_path / "ub.h5ad")
    with h5py.File(path) as f:
        assert f.userblock_size == 512
    expected = truth(path)
    np.testing.assert_array_equal(expected, value_matrix().toarray())
    source = assert_reads_exactly(path, expected)
    assert source._file(0).reader.direct  # the positional path, not h5py's


# -- 3: links ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("target", ["X", "layer"])
def test_external_link(tmp_path, layout, target, monkeypatch):
    write(tmp_path / "data.h5ad", **layout)
    # The linking file has a different layout before X, so the target's
    # offsets point at other bytes in it.
    path = tmp_path / "linking.h5ad"
    adata = make_adata(with_x=False)
    adata.uns["padding"] = np.arange(5000.0)
    adata.write_h5ad(path)
    with h5py.File(path, "r+") as f:
        link = h5py.ExternalLink("data.h5ad", "/X")  # relative to the file
        if target == "X":
            f["X"] = link
        else:
            f["layers/counts"] = link
    monkeypatch.chdir("/")  # HDF5 resolves it next to the linking file
    layer = None if target == "X" else "counts"
    expected = truth(path, layer)
    np.testing.assert_array_equal(expected, value_matrix().toarray())
    assert_reads_exactly(path, expected, layer=layer)


def test_soft_link(tmp_path):
    path = write(tmp_path / "x.h5ad", chunks=8)
    with h5py.File(path, "r+") as f:
        f["layers/counts"] = h5py.SoftLink("/X")
    expected = truth(path, "counts")
    assert_reads_exactly(path, expected, layer="counts")


def test_external_link_to_missing_file(tmp_path):
    data = write(tmp_path / "data.h5ad")
    path = tmp_path / "linking.h5ad"
    make_adata(with_x=False).write_h5ad(path)
    with h5py.File(path, "r+") as f:
        f["X"] = h5py.ExternalLink("data.h5ad", "/X")
    AnnDataSource(path)  # fine while the target exists
    os.remove(data)
    with pytest.raises(AnnDataFormatError, match=re.escape(str(path))) as e:
        AnnDataSource(path)
    message = str(e.value)
    assert "X is an external link to /X in data.h5ad" in message
    assert "does not exist" in message


def test_dangling_soft_link(tmp_path):
    path = write(tmp_path / "x.h5ad")
    with h5py.File(path, "r+") as f:
        f["layers/counts"] = h5py.SoftLink("/layers/gone")
    with pytest.raises(AnnDataFormatError, match=re.escape(str(path))) as e:
        AnnDataSource(path, layer="counts")
    assert "layers/counts is a soft link to /layers/gone" in str(e.value)


# -- 4: virtual datasets -----------------------------------------------------------


def write_virtual(tmp_path) -> tuple[str, list[str]]:
    """A file whose dense X is a VDS over two source files of row halves."""
    x = value_matrix().toarray()
    half = N_OBS // 2
    sources = []
    for k, rows in enumerate([slice(0, half), slice(half, N_OBS)]):
        name = str(tmp_path / f"part{k}.h5")
        with h5py.File(name, "w") as f:
            f["values"] = x[rows]
        sources.append(name)
    path = tmp_path / "virtual.h5ad"
    make_adata(with_x=False).write_h5ad(path)
    layout = h5py.VirtualLayout(shape=x.shape, dtype=x.dtype)
    layout[:half] = h5py.VirtualSource(sources[0], "values", shape=(half, N_VARS))
    layout[half:] = h5py.VirtualSource(
        sources[1], "values", shape=(N_OBS - half, N_VARS)
    )
    with h5py.File(path, "r+") as f:
        f.create_virtual_dataset("X", layout, fillvalue=0)
        f["X"].attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
    return path, sources


def test_virtual_dataset_reads_its_sources(tmp_path):
    path, _ = write_virtual(tmp_path)
    expected = truth(path)
    np.testing.assert_array_equal(expected, value_matrix().toarray())
    assert_reads_exactly(path, expected)


def test_virtual_dataset_with_a_missing_source(tmp_path):
    path, sources = write_virtual(tmp_path)
    os.remove(sources[1])
    assert not truth(path)[-1].any()  # what HDF5 (and anndata) would return
    with pytest.raises(CorruptDataError, match=re.escape(str(path))) as e:
        AnnDataSource(path)
    assert sources[1] in str(e.value) and "virtual dataset" in str(e.value)


# -- filters from hdf5plugin ---------------------------------------------------------


@pytest.mark.parametrize("name", ["Zstd", "LZ4"])
@pytest.mark.parametrize("layout", ["csr", "dense"])
def test_hdf5plugin_filters(tmp_path, name, layout):
    hdf5plugin = pytest.importorskip("hdf5plugin")
    path = write(tmp_path / "x.h5ad", layout, compression=getattr(hdf5plugin, name)())
    with h5py.File(path) as f:
        x = f["X"] if layout == "dense" else f["X/data"]
        codes = [x.id.get_create_plist().get_filter(0)[0]]
    assert codes == [{"Zstd": 32015, "LZ4": 32004}[name]]
    expected = truth(path)
    np.testing.assert_array_equal(expected, value_matrix().toarray())
    assert_reads_exactly(path, expected)


@pytest.mark.slow  # a fresh interpreter imports jax and grain
@pytest.mark.parametrize("importable", [True, False])
def test_filter_plugin_in_a_fresh_process(tmp_path, importable):
    """hdf5plugin is imported on demand; without it the error names it."""
    hdf5plugin = pytest.importorskip("hdf5plugin")
    path = write(tmp_path / "x.h5ad", compression=hdf5plugin.Zstd())
    script = textwrap.dedent(
        f"""
        import sys
        if not {importable}:
            sys.modules["hdf5plugin"] = None  # as if not installed
        import grain_cells
        assert "hdf5plugin" not in sys.modules or not {importable}
        try:
            source = grain_cells.AnnDataSource({str(path)!r})
            print(source.read([{N_OBS - 1}]).X.toarray().tolist())
        except grain_cells.errors.UnsupportedLayoutError as e:
            print(e)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "HDF5_PLUGIN_PATH"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    message = done.stdout
    if importable:
        assert message.strip() == str(value_matrix()[N_OBS - 1].toarray().tolist())
        return
    assert str(path) in message, done.stderr
    assert "HDF5 filter 32015 (zstd)" in message
    assert "pip install hdf5plugin" in message


def test_unsupported_layout_is_not_reported_as_truncation():
    assert issubclass(UnsupportedLayoutError, AnnDataFormatError)


# -- paths and locks -----------------------------------------------------------------


def test_symlink_loop(tmp_path):
    a, b = tmp_path / "a.h5ad", tmp_path / "b.h5ad"
    os.symlink(b, a)
    os.symlink(a, b)
    with pytest.raises(AnnDataFormatError, match=re.escape(str(a))) as e:
        AnnDataSource(a)
    assert "loop of symbolic links" in str(e.value)


def test_dangling_symlink(tmp_path):
    a = tmp_path / "a.h5ad"
    os.symlink(tmp_path / "gone.h5ad", a)
    with pytest.raises(FileNotFoundError, match=re.escape(str(a))) as e:
        AnnDataSource(a)
    assert f"symbolic link to {tmp_path / 'gone.h5ad'}" in str(e.value)


def test_file_held_by_a_writer(tmp_path):
    path = write(tmp_path / "x.h5ad")
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, h5py\n"
            f"f = h5py.File({str(path)!r}, 'a')\n"
            "print('open', flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "HDF5_USE_FILE_LOCKING": "TRUE"},
    )
    try:
        assert writer.stdout.readline().strip() == "open"
        with pytest.raises(AnnDataFormatError, match=re.escape(str(path))) as e:
            AnnDataSource(path)
        assert "another process holds it open for writing" in str(e.value)
    finally:
        writer.communicate("", timeout=60)
    AnnDataSource(path)  # readable once the writer is gone


@pytest.mark.slow  # starts worker processes
def test_userblock_and_external_link_in_worker_processes(tmp_path):
    """Workers open the files themselves: same rules, same values."""
    import grain_cells

    write(tmp_path / "data.h5ad", "dense", chunks=8)
    plain = tmp_path / "linking.h5ad"
    make_adata(with_x=False).write_h5ad(plain)
    with h5py.File(plain, "r+") as f:
        f["X"] = h5py.ExternalLink("data.h5ad", "/X")
    dense = write(tmp_path / "dense.h5ad", "dense")
    paths = [plain, with_userblock(dense, tmp_path / "ub.h5ad")]
    source = AnnDataSource(paths, block_size=4)
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=1, num_epochs=1),
        operations=grain_cells.fetch_operations(
            source, batch_size=8, fetch_factor=2, output=DenseOutput(), seed=1
        ),
        worker_count=2,
    )
    got = np.full((source.num_cells, N_VARS), np.nan)
    iterator = iter(loader)
    try:
        for batch in iterator:
            keep = np.array(batch["mask"])
            got[np.array(batch["row_ids"])[keep]] = np.array(batch["X"])[keep]
    finally:
        iterator.close()
    expected = value_matrix().toarray()
    np.testing.assert_array_equal(got, np.concatenate([expected, expected]))


def test_file_left_open_by_a_crashed_writer(tmp_path):
    plain = write(tmp_path / "plain.h5ad")
    path = tmp_path / "x.h5ad"
    with h5py.File(plain) as a, h5py.File(path, "w", libver="latest") as b:
        b.attrs.update(dict(a.attrs))
        for key in a:
            a.copy(a[key], b, key)
    # A writer of a superblock-v3 file SIGKILLed before it closed the file
    # leaves HDF5's "open for write" flag set.
    crashed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal, h5py\n"
            f"f = h5py.File({str(path)!r}, 'a', libver='latest')\n"
            "f.flush()\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n",
        ],
        timeout=60,
    )
    assert crashed.returncode == -9
    with pytest.raises(AnnDataFormatError, match=re.escape(str(path))) as e:
        AnnDataSource(path)
    assert "its writer did not close it" in str(e.value)
    assert "h5clear -s" in str(e.value)


def test_layout_digest_ignores_unwritten_chunks_filter_masks(tmp_path):
    """HDF5 answers a never-written chunk's lookup with no offset and an
    uninitialised filter mask (32586 in one process, 32697 in another): the
    layout digest recorded it, so one file's identity could differ between
    processes (a false "changed" error, a checkpoint that will not restore)."""
    from grain_cells import formats

    path = tmp_path / "partly.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", shape=(100,), chunks=(10,), dtype="f4")[0:10] = 1
    with h5py.File(path, "r") as f:
        layout = formats.for_path(str(path)).array_layout(f["x"])
    sampled = layout[7:]
    assert sampled[0] is not None and sampled[0][2] == 0  # the written chunk
    assert sampled[1:] and all(entry is None for entry in sampled[1:]), sampled
