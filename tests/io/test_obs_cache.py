"""obs columns mapped from one cache file per (file, column) (`io/_obs_cache`).

Two files of `MIN_CELLS + 5` and `MIN_CELLS + 11` cells (just large enough
to be cached), written by anndata: `cell_type` lists its categories in
another order in the second file, `donor` is a string column, `idx` (int32)
is the global row, and `score` (float) is only in the first file, so it is
filled with NaN in the second (`obs_missing="fill"`). Expected values come
from `anndata.read_h5ad`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap
import threading

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells import synthetic
from grain_cells.io import _obs_cache as obs_cache
from grain_cells.io._file_set import FileSet, OpenFiles
from grain_cells.io._h5ad import open_file
from grain_cells.io._obs import read_obs_column

SIZES = (obs_cache.MIN_CELLS + 5, obs_cache.MIN_CELLS + 11)
COLUMNS = ("cell_type", "donor", "idx", "score")
TYPES = ["B", "T", "NK", "Mono"]


def _write(path, f: int, offset: int, seed: int = 0) -> str:
    n = SIZES[f]
    rng = np.random.default_rng(seed + f)
    rows = np.arange(offset, offset + n)
    labels = TYPES[::-1] if f else TYPES
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(rng.choice(labels, n), categories=labels),
            "donor": rng.choice(["d1", "d2", "d3"], n).astype(object),
            "idx": rows.astype(np.int32),
        },
        index=[f"c{r}" for r in rows],
    )
    if f == 0:
        obs["score"] = rows / 4.0
    x = sp.csr_matrix(
        (rows.astype(np.float32) + 1, rows % 3, np.arange(n + 1)), shape=(n, 3)
    )
    anndata.AnnData(x, obs=obs).write_h5ad(path)
    return str(path)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    folder = tmp_path_factory.mktemp("obs_cache")
    return [
        _write(folder / "a.h5ad", 0, 0),
        _write(folder / "b.h5ad", 1, SIZES[0]),
    ]


@pytest.fixture(scope="module")
def truth(paths):
    return pd.concat([anndata.read_h5ad(p).obs for p in paths])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "obs"
    monkeypatch.setenv("GRAIN_CELLS_OBS_CACHE", str(folder))
    return folder


def _inspect(paths) -> FileSet:
    return FileSet.inspect(
        paths,
        element="X",
        obs_names=COLUMNS,
        genes=None,
        join="exact",
        obs_missing="fill",
    )


def _in_memory(files: FileSet, i: int) -> dict[str, np.ndarray]:
    """What `open_member` kept before the cache: each column read whole."""
    out = {}
    with open_file(files.paths[i]) as f:
        for c in files.obs_names:
            spec = files.obs[c]
            column = read_obs_column(f, c) if spec.present[i] else None
            out[c] = spec.file_values(i, column, SIZES[i])
    return out


def _mapped(values: np.ndarray) -> bool:
    return isinstance(values.base, np.memmap) and not values.flags.owndata


def _check_equal_truth(source, rows, obs, truth):
    expected = truth.iloc[rows]
    for c in ("cell_type", "donor"):
        labels = np.asarray(source.categories[c])[obs[c]]
        np.testing.assert_array_equal(labels, expected[c].astype(str))
    np.testing.assert_array_equal(obs["idx"], rows)
    np.testing.assert_array_equal(obs["score"], expected["score"].to_numpy())


def test_mapped_values_equal_the_in_memory_ones(paths, cache):
    files = _inspect(paths)
    handles = OpenFiles(files, read_threads=0)
    for i in range(2):
        want = _in_memory(files, i)
        got = handles.file(i).obs
        for c in COLUMNS:
            assert got[c].dtype == want[c].dtype, c
            np.testing.assert_array_equal(got[c], want[c])
            # The missing score column stays a broadcast; every other is mapped.
            assert _mapped(got[c]) == (c != "score" or i == 0), (i, c)
    assert len(list(cache.glob("*.npy"))) == 7
    assert not list(cache.glob("*.tmp"))
    handles.close()


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_loader_values_equal_anndata(paths, truth, cache, helpers, workers):
    source = grain_cells.AnnDataSource(
        paths, block_size=512, obs_columns=list(COLUMNS), obs_missing="fill"
    )
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=3),
        operations=grain_cells.fetch_operations(
            source, batch_size=1024, fetch_factor=4, seed=3
        ),
        worker_count=workers,
    )
    for batch in helpers.run(loader, 12):
        real = batch["mask"]
        obs = {c: batch[f"obs/{c}"][real] for c in COLUMNS}
        _check_equal_truth(source, batch["row_ids"][real], obs, truth)
    # A many-file fetch takes its obs rows from the source's joined columns:
    # one entry per column, shared by every process (none per file).
    assert len(list(cache.glob("*.npy"))) == len(COLUMNS)
    column = source.obs_values("cell_type")
    labels = np.asarray(source.categories["cell_type"])[column]
    np.testing.assert_array_equal(labels, truth["cell_type"].astype(str))


def test_two_sources_share_one_entry(paths, cache):
    a = OpenFiles(_inspect(paths), read_threads=0)
    b = OpenFiles(_inspect(paths), read_threads=0)
    one, two = a.file(1).obs, b.file(1).obs
    for c in ("cell_type", "donor", "idx"):
        assert one[c].base.filename == two[c].base.filename
    assert len(list(cache.glob("*.npy"))) == 3
    a.close()
    b.close()


def test_racing_openers_read_each_column_once(paths, cache, monkeypatch):
    """Openers that miss at once take turns: one reads, the others map."""
    files = _inspect(paths[:1])
    reads = []
    real = obs_cache._h5ad.read_obs_column

    def counted(f, name):
        reads.append(name)
        return real(f, name)

    monkeypatch.setattr(obs_cache._h5ad, "read_obs_column", counted)
    start = threading.Barrier(4)

    def open_one(_):
        start.wait()
        return OpenFiles(files, read_threads=0).file(0).obs

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(open_one, range(4)))
    assert sorted(reads) == sorted(COLUMNS)
    want = _in_memory(files, 0)
    for obs in got:
        for c in COLUMNS:
            np.testing.assert_array_equal(obs[c], want[c])
            assert _mapped(obs[c])


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: p.write_bytes(p.read_bytes()[:-100]), id="short"),
        pytest.param(lambda p: p.write_bytes(p.read_bytes() + b"x"), id="long"),
        pytest.param(lambda p: p.write_bytes(b"not an npy file"), id="garbage"),
        pytest.param(lambda p: p.write_bytes(b""), id="empty"),
        pytest.param(
            lambda p: np.save(p, np.zeros(SIZES[0], np.float64)), id="foreign"
        ),
        pytest.param(
            lambda p: p.write_bytes(p.read_bytes()[:-40] + b"0" * 40), id="stamp"
        ),
        pytest.param(lambda p: np.save(p, np.zeros(7, np.int8)), id="other-length"),
    ],
)
def test_a_damaged_entry_is_rebuilt(paths, cache, caplog, damage):
    files = _inspect(paths[:1])
    OpenFiles(files, read_threads=0).file(0)
    entries = sorted(cache.glob("*.npy"))
    good = {p: p.read_bytes() for p in entries}
    for p in entries:
        damage(p)
    with caplog.at_level(logging.WARNING, "grain_cells"):
        got = OpenFiles(files, read_threads=0).file(0).obs
    assert "rebuilding" in caplog.text
    want = _in_memory(files, 0)
    for c in COLUMNS:
        assert got[c].dtype == want[c].dtype
        np.testing.assert_array_equal(got[c], want[c])
        assert _mapped(got[c])
    assert {p: p.read_bytes() for p in entries} == good


def test_a_rewritten_file_gets_a_new_entry(paths, tmp_path, cache):
    path = tmp_path / "a.h5ad"
    _write(path, 0, 0, seed=0)
    OpenFiles(_inspect([str(path)]), read_threads=0).file(0)
    before = set(cache.glob("*.npy"))
    _write(path, 0, 0, seed=7)  # other cell types and donors, same shape
    files = _inspect([str(path)])
    got = OpenFiles(files, read_threads=0).file(0).obs
    after = set(cache.glob("*.npy"))
    assert len(after - before) == len(COLUMNS)
    new = anndata.read_h5ad(path).obs
    for c in ("cell_type", "donor"):
        labels = np.asarray(files.obs[c].categories)[got[c]]
        np.testing.assert_array_equal(labels, new[c].astype(str))


def test_an_unwritable_folder_falls_back_to_memory(paths, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRAIN_CELLS_OBS_CACHE", str(blocker / "obs"))
        files = _inspect(paths)
        with caplog.at_level(logging.WARNING, "grain_cells"):
            got = [OpenFiles(files, read_threads=0).file(i).obs for i in (0, 1)]
    assert "cannot write" in caplog.text
    for i in (0, 1):
        want = _in_memory(files, i)
        for c in COLUMNS:
            assert got[i][c].dtype == want[c].dtype
            np.testing.assert_array_equal(got[i][c], want[c])
            assert not _mapped(got[i][c])


def test_off_and_small_files_stay_in_memory(paths, csr_paths, cache, monkeypatch):
    small = FileSet.inspect(
        csr_paths,
        element="X",
        obs_names=("plate", "idx"),
        genes=None,
        join="exact",
        obs_missing="error",
    )
    got = OpenFiles(small, read_threads=0).file(0).obs
    assert not any(_mapped(v) for v in got.values())
    monkeypatch.setenv("GRAIN_CELLS_OBS_CACHE", "off")
    got = OpenFiles(_inspect(paths), read_threads=0).file(0).obs
    assert not any(_mapped(v) for v in got.values())
    assert not cache.exists()


def test_the_default_folder_is_under_grain_cells_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("GRAIN_CELLS_OBS_CACHE", raising=False)
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path))
    assert obs_cache.cache_folder() == tmp_path / "obs"


_ANON = textwrap.dedent(
    """
    import pickle
    import sys
    import h5py  # imported before measuring: imports cost anonymous memory
    import grain_cells.hdf5
    from grain_cells.io._file_set import OpenFiles

    def anon_kib():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1])

    with open(sys.argv[1], "rb") as fh:
        files = pickle.load(fh)  # as a worker gets it: never inspected here
    handles = OpenFiles(files, read_threads=0)
    before = anon_kib()
    obs = handles.file(0).obs
    total = sum(int(v[::4096].sum()) for v in obs.values())  # touch every array
    print(anon_kib() - before, sum(v.nbytes for v in obs.values()))
    """
)


@pytest.mark.slow  # writes a 2M-cell file and starts three processes (~15 s)
def test_a_worker_maps_obs_instead_of_holding_it(tmp_path, cache):
    """A process (a worker) that opens a 2M-cell file holds no obs codes.

    Its anonymous memory grows at the open by what HDF5 keeps of the file
    (~10 MiB here, bounded by HDF5's metadata cache) plus, without the
    cache (as before it), the four columns' codes: 5 bytes per cell, 9.5 MiB.
    """
    path = synthetic.write_thin_atlas(tmp_path / "thin.h5ad", 2_000_000)
    files = FileSet.inspect(
        [str(path)],
        element="X",
        obs_names=("plate", "donor", "cell_type", "batch"),
        genes=None,
        join="exact",
        obs_missing="error",
    )
    (tmp_path / "files.pickle").write_bytes(pickle.dumps(files))
    root = pathlib.Path(grain_cells.__file__).parents[1]
    grown = []
    for folder in ("off", cache, cache):  # the first cached run writes it
        env = {
            **os.environ,
            "PYTHONPATH": str(root),
            "GRAIN_CELLS_OBS_CACHE": str(folder),
        }
        run = [sys.executable, "-c", _ANON, str(tmp_path / "files.pickle")]
        out = subprocess.run(run, check=True, env=env, capture_output=True, text=True)
        kib, nbytes = map(int, out.stdout.split())
        assert nbytes == 5 * 2_000_000
        grown.append(kib)
    held = nbytes / 1024
    assert grown[2] < grown[0] - 0.8 * held, grown
    # The process that writes the entries reads each column whole once; its
    # heap may keep part of that.
    assert grown[1] < grown[0], grown


def test_objects_in_a_bucket_are_keyed_by_their_etag(paths, tmp_path, s3, cache):
    url = s3.upload(paths[0], "obs_cache/a.h5ad")

    def opened():
        files = FileSet.inspect(
            [url],
            element="X",
            obs_names=COLUMNS,
            genes=None,
            join="exact",
            obs_missing="fill",
            storage_options=s3.options,
        )
        handles = OpenFiles(files, read_threads=0)
        try:
            return files, dict(handles.file(0).obs)
        finally:
            handles.close()

    files, got = opened()
    want = _in_memory(_inspect(paths[:1]), 0)
    for c in COLUMNS:
        assert _mapped(got[c])
        np.testing.assert_array_equal(got[c], want[c])
    assert len(list(cache.glob("*.npy"))) == len(COLUMNS)
    # The same key overwritten with other cells: a new ETag, new entries.
    other = _write(tmp_path / "other.h5ad", 0, 0, seed=7)
    s3.upload(other, "obs_cache/a.h5ad")
    files, got = opened()
    assert len(list(cache.glob("*.npy"))) == 2 * len(COLUMNS)
    new = anndata.read_h5ad(other).obs
    for c in ("cell_type", "donor"):
        labels = np.asarray(files.obs[c].categories)[got[c]]
        np.testing.assert_array_equal(labels, new[c].astype(str))


def test_zarr_stores_are_mapped_too(paths, tmp_path, cache):
    store = tmp_path / "a.zarr"
    anndata.read_h5ad(paths[0]).write_zarr(store)
    files = _inspect([str(store)])
    got = OpenFiles(files, read_threads=0).file(0).obs
    want = _in_memory(_inspect(paths[:1]), 0)
    for c in COLUMNS:
        assert _mapped(got[c])
        assert got[c].dtype == want[c].dtype
        np.testing.assert_array_equal(got[c], want[c])


# -- a collection of small files: one joined entry per column ---------------

SMALL = 14_000  # 5 files: each below MIN_CELLS, together above it


def _write_small(folder, k: int, seed: int = 0) -> str:
    """File `k`: `idx` is the global row; cell types listed in another order
    in every file; only file 0 lacks `score`."""
    rng = np.random.default_rng(seed * 100 + k)
    rows = np.arange(k * SMALL, (k + 1) * SMALL)
    order = TYPES[k % 4 :] + TYPES[: k % 4]
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(rng.choice(order, SMALL), categories=order),
            "donor": rng.choice(["d1", "d2", f"d{k + 3}"], SMALL).astype(object),
            "idx": rows.astype(np.int32),
        },
        index=[f"c{r}" for r in rows],
    )
    if k:
        obs["score"] = rows / 4.0
    x = sp.csr_matrix((np.ones(SMALL, np.float32), rows % 3, np.arange(SMALL + 1)))
    path = folder / f"s{k}.h5ad"
    anndata.AnnData(x, obs=obs).write_h5ad(path)
    return str(path)


@pytest.fixture(scope="module")
def small_paths(tmp_path_factory):
    folder = tmp_path_factory.mktemp("joined")
    return [_write_small(folder, k) for k in range(5)]


def _source(paths):
    return grain_cells.AnnDataSource(
        paths, obs_columns=list(COLUMNS), obs_missing="fill"
    )


def _labels(source, column: str) -> np.ndarray:
    return np.asarray(source.categories[column])[source.obs_values(column)]


def test_a_collection_column_is_one_mapped_entry_equal_to_anndata(small_paths, cache):
    truth = pd.concat([anndata.read_h5ad(p).obs for p in small_paths])
    source = _source(small_paths)
    for c in ("cell_type", "donor"):
        got = source.obs_values(c)
        assert _mapped(got) and not got.flags.writeable
        np.testing.assert_array_equal(_labels(source, c), truth[c].astype(str))
    np.testing.assert_array_equal(source.obs_values("idx"), np.arange(5 * SMALL))
    np.testing.assert_array_equal(source.obs_values("score"), truth["score"].to_numpy())
    assert len(list(cache.glob("*.npy"))) == 4  # one per column, not per file


def test_a_second_source_reads_a_collection_column_opening_no_file(
    small_paths, cache, monkeypatch
):
    """A split or class weights on 10^5 files must not open them all again."""
    want = _labels(_source(small_paths), "cell_type")
    source = _source(small_paths)
    import h5py

    def refuse(*args, **kwargs):
        raise AssertionError(f"opened {args[:1]}")

    monkeypatch.setattr(h5py.File, "__init__", refuse)
    np.testing.assert_array_equal(_labels(source, "cell_type"), want)
    views = grain_cells.split_by_obs(source, "cell_type", {"val": ["NK"]})
    assert views["val"].num_selected_cells == int((want == "NK").sum())


def test_a_rewritten_collection_file_gets_a_new_joined_entry(tmp_path, cache):
    folder = tmp_path / "c"
    folder.mkdir()
    paths = [_write_small(folder, k) for k in range(5)]
    _labels(_source(paths), "cell_type")
    _write_small(folder, 3, seed=9)  # other labels, same shape
    truth = pd.concat([anndata.read_h5ad(p).obs for p in paths])
    np.testing.assert_array_equal(
        _labels(_source(paths), "cell_type"), truth["cell_type"].astype(str)
    )
    assert len(list(cache.glob("*.npy"))) == 2


def test_a_small_collection_is_joined_in_memory(small_paths, cache):
    source = _source(small_paths[:2])  # 28,000 cells: below MIN_CELLS
    truth = pd.concat([anndata.read_h5ad(p).obs for p in small_paths[:2]])
    np.testing.assert_array_equal(
        _labels(source, "cell_type"), truth["cell_type"].astype(str)
    )
    assert not list(cache.glob("*.npy"))
