"""Reading `.h5ad` objects in place from an S3-compatible store (moto, localhost).

Every file here is written by anndata, uploaded to a moto server started by
`s3_server.s3` and read back by URL; the oracle is `anndata.read_h5ad` of
the local copy, and the same file read locally by `AnnDataSource`.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import time

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from conftest import OBS, close_iterator, hdf5_opens, take, write_files

import grain_cells
from grain_cells import errors
from grain_cells.storage.remote import _store as object_store

CONFIG = dict(block_size=5, batch_size=4, fetch_factor=5)


def _counts_since(before: dict) -> dict:
    now = object_store.request_counts()
    return {k: now.get(k, 0) - before.get(k, 0) for k in ("head", "get", "check")}


def _write_rich(path, *, dense=False, compression=None) -> str:
    """X, a layer `counts` (2 X) and raw/X (3 X); value (i, j) = i * 100 + j + 1."""
    rng = np.random.default_rng(1)
    n, g = 57, 9
    mask = rng.random((n, g)) < 0.4
    values = (np.arange(n)[:, None] * 100 + np.arange(g) + 1).astype(np.float32)
    x = np.where(mask, values, 0).astype(np.float32)
    m = x if dense else sp.csr_matrix(x)
    obs = pd.DataFrame(
        {
            "kind": pd.Categorical(rng.choice(["a", "b", "c"], n)),
            "idx": np.arange(n, dtype=np.int64),
        },
        index=[f"c{i}" for i in range(n)],
    )
    var = pd.DataFrame(index=[f"g{j}" for j in range(g)])
    adata = anndata.AnnData(X=m, obs=obs, var=var, layers={"counts": m * 2})
    adata.raw = anndata.AnnData(X=m * 3, obs=obs, var=var)
    adata.write_h5ad(path, compression=compression)
    return str(path)


def _dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else np.asarray(x)


@pytest.fixture(scope="module")
def rich(tmp_path_factory, s3):
    """Local path and URL of CSR, dense and gzip-compressed rich files."""
    d = tmp_path_factory.mktemp("rich")
    out = {}
    for name, kwargs in {
        "csr": {},
        "dense": {"dense": True},
        "gzip": {"compression": "gzip"},
    }.items():
        path = _write_rich(d / f"{name}.h5ad", **kwargs)
        out[name] = (path, s3.upload(path, f"rich/{name}.h5ad"))
    return out


@pytest.fixture(scope="module")
def parts(tmp_path_factory, s3):
    """conftest's three CSR files: local paths and URLs."""
    paths = write_files(tmp_path_factory.mktemp("parts"))
    return paths, [s3.upload(p, f"parts/{i}.h5ad") for i, p in enumerate(paths)]


@pytest.mark.parametrize("kind", ["csr", "dense", "gzip"])
@pytest.mark.parametrize("layer", [None, "counts", "raw"])
def test_values_equal_local_and_anndata(rich, s3, kind, layer):
    path, url = rich[kind]
    remote = grain_cells.AnnDataSource(
        url, layer=layer, obs_columns=["kind", "idx"], storage_options=s3.options
    )
    local = grain_cells.AnnDataSource(path, layer=layer, obs_columns=["kind", "idx"])
    rows = np.random.default_rng(0).permutation(remote.num_cells)
    got, want = remote.read(rows), local.read(rows)
    adata = anndata.read_h5ad(path)
    oracle = {None: adata.X, "counts": adata.layers["counts"], "raw": adata.raw.X}
    np.testing.assert_array_equal(_dense(got.X), _dense(oracle[layer])[rows])
    np.testing.assert_array_equal(_dense(got.X), _dense(want.X))
    np.testing.assert_array_equal(got.obs["idx"], rows)
    labels = remote.categories["kind"][got.obs["kind"]]
    np.testing.assert_array_equal(labels, adata.obs["kind"].to_numpy()[rows])
    assert repr(remote).startswith(f"AnnDataSource(files=[{url!r}")


def _loader(paths, *, worker_count=0, output=None, options=None, seed=0):
    source = grain_cells.AnnDataSource(
        paths,
        block_size=CONFIG["block_size"],
        obs_columns=OBS,
        storage_options=options,
    )
    # Given the source, the sampler hints blocks ahead: remote reads take them
    # from read-ahead GETs.
    sampler = grain_cells.BlockSampler(source, seed=seed, readahead_cells=40)
    operations = grain_cells.fetch_operations(
        source,
        batch_size=CONFIG["batch_size"],
        fetch_factor=CONFIG["fetch_factor"],
        output=output,
        seed=seed,
    )
    return grain_cells.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=operations,
        worker_count=worker_count,
    )


def _run(loader, n=None) -> list[dict]:
    iterator = iter(loader)
    try:
        return take(iterator, n)
    finally:
        close_iterator(iterator)


def _assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.mark.parametrize(
    "output",
    [
        pytest.param(None, id="csr"),
        pytest.param(grain_cells.PaddedSparseOutput(8), id="padded"),
        pytest.param(grain_cells.DenseOutput(), id="dense"),
    ],
)
def test_loader_batches_equal_local(parts, s3, output):
    paths, urls = parts
    got = _run(_loader(urls, output=output, options=s3.options))
    want = _run(_loader(paths, output=output))
    _assert_same(got, want)


@pytest.mark.slow  # starts workers
def test_loader_with_workers_reads_every_cell_once(parts, s3):
    paths, urls = parts
    batches = _run(_loader(urls, worker_count=2, options=s3.options))
    local = grain_cells.AnnDataSource(paths, obs_columns=OBS)
    rows, x = [], []
    for b in batches:  # CSR minibatches, padded at the end of a fetch
        keep = b["mask"]
        dense = sp.csr_matrix(
            (b["data"], b["indices"], b["indptr"]), shape=(keep.size, local.num_genes)
        ).toarray()
        rows.append(b["row_ids"][keep])
        x.append(dense[keep])
    rows = np.concatenate(rows)
    np.testing.assert_array_equal(np.sort(rows), np.arange(local.num_cells))
    np.testing.assert_array_equal(np.concatenate(x), _dense(local.read(rows).X))


def test_urls_and_paths_mix_and_split(parts, s3):
    paths, urls = parts
    mixed = grain_cells.AnnDataSource(
        [urls[0], paths[1], urls[2]], obs_columns=OBS, storage_options=s3.options
    )
    local = grain_cells.AnnDataSource(paths, obs_columns=OBS)
    rows = np.arange(mixed.num_cells)
    np.testing.assert_array_equal(
        _dense(mixed.read(rows).X), _dense(local.read(rows).X)
    )
    splits = grain_cells.split_by_fraction(mixed, {"train": 0.8, "val": 0.2})
    local_splits = grain_cells.split_by_fraction(local, {"train": 0.8, "val": 0.2})
    for name, view in splits.items():
        other = local_splits[name]
        assert view.blocks_id == other.blocks_id
        keys = np.arange(len(view))
        np.testing.assert_array_equal(
            _dense(view.read_blocks(keys).X), _dense(other.read_blocks(keys).X)
        )


def test_metadata_read_once(parts, s3):
    _, urls = parts
    before = object_store.request_counts()
    first = grain_cells.AnnDataSource(urls, obs_columns=OBS, storage_options=s3.options)
    built = _counts_since(before)
    assert built["head"] == len(urls)

    before = object_store.request_counts()
    grain_cells.AnnDataSource(urls, obs_columns=OBS, storage_options=s3.options)
    again = _counts_since(before)
    # One HEAD per object (its version names its cached entry); no GET.
    assert again == {"head": len(urls), "get": 0, "check": 0}, again

    worker = pickle.loads(pickle.dumps(first))  # what a worker process gets
    before = object_store.request_counts()
    # Opens one file: the 64 KiB block of HDF5 metadata and obs codes the
    # build did not read (no open saved them yet), its indptr, data+indices.
    worker.read_blocks([0])
    started = _counts_since(before)
    assert started["head"] == 0 and started["get"] <= 4, started
    again = pickle.loads(pickle.dumps(first))  # the next worker: metadata saved
    before = object_store.request_counts()
    again.read_blocks([0])
    started = _counts_since(before)
    assert started["head"] == 0 and started["get"] <= 3, started
    assert started["check"] <= started["get"], started


def test_metadata_is_held_only_for_open_objects(parts, s3, monkeypatch):
    """HDF5's metadata of an object stays in memory while a file of it is open.

    It stayed for every object a process had opened (~0.4 MiB per thin file:
    1.5 GiB at 2,000 files, benchmarks/RESULTS.md); a reopen finds it in the
    disk cache instead.
    """
    from grain_cells.hdf5 import _open

    paths, urls = parts
    source = grain_cells.AnnDataSource(
        urls, storage_options=s3.options, max_open_files=1, block_size=5
    )
    blocks = source.read_blocks(range(len(source)))  # every file, one open at once
    gc.collect()
    held = [key for key in list(_open._metadata) if key[0] in urls]
    assert len(held) <= 1, held
    local = grain_cells.AnnDataSource(paths, block_size=5)
    assert (blocks.X != local.read_blocks(range(len(local))).X).nnz == 0

    metadata_gets = []  # what HDF5 reads through the file object, not cached
    get = _open.RangeFile._get
    monkeypatch.setattr(
        _open.RangeFile,
        "_get",
        lambda self, off, n: metadata_gets.append((self.url, off)) or get(self, off, n),
    )
    again = pickle.loads(pickle.dumps(source))  # reopens from the disk cache
    assert (again.read_blocks(range(len(again))).X != blocks.X).nnz == 0
    assert metadata_gets == []


def test_indptr_is_pinned_in_one_get(tmp_path, s3):
    """An object whose `indptr` is stored in two chunks: one GET pins both.

    Each chunk was its own GET, one round trip after the other, at every
    open of the object in every process (a build, a worker, a reopen).
    """
    n = 5000  # anndata chunks this indptr in two (2,501 entries each)
    rows = np.arange(n)
    x = sp.csr_matrix(((rows + 1).astype(np.float32), (rows, rows % 20)), shape=(n, 20))
    path = tmp_path / "two-chunks.h5ad"
    anndata.AnnData(X=x).write_h5ad(path)
    url = s3.upload(path, "pins/two-chunks.h5ad")
    grain_cells.AnnDataSource(url, storage_options=s3.options)  # metadata cached
    source = grain_cells.AnnDataSource(url, storage_options=s3.options)
    before = object_store.request_counts()
    source._file(0)  # the open a first read makes
    assert _counts_since(before) == {"head": 0, "get": 1, "check": 0}
    got = source.read([0, 2501, n - 1]).X.toarray()
    np.testing.assert_array_equal(got, x[[0, 2501, n - 1]].toarray())


def test_changed_object_raises(tmp_path, s3):
    path = _write_rich(tmp_path / "a.h5ad")
    url = s3.upload(path, "changing/a.h5ad")
    source = grain_cells.AnnDataSource(url, storage_options=s3.options)
    source.read([0, 1])
    other = _write_rich(tmp_path / "b.h5ad", dense=True)
    s3.upload(other, "changing/a.h5ad")
    with pytest.raises(errors.SourceChangedError, match=r"changing/a\.h5ad.*ETag"):
        source.verify_files()
    fresh = pickle.loads(pickle.dumps(source))  # a worker opening it now
    with pytest.raises(errors.SourceChangedError, match=r"changing/a\.h5ad"):
        fresh.read([3, 4])


def test_a_rewritten_object_is_inspected_again(tmp_path, s3):
    """A build takes an object's saved entry only for the version it was made of."""
    url = s3.upload(_write_rich(tmp_path / "a.h5ad"), "rewritten/a.h5ad")
    grain_cells.AnnDataSource(url, storage_options=s3.options)  # saves its entry
    before = object_store.request_counts()
    grain_cells.AnnDataSource(url, storage_options=s3.options)
    assert _counts_since(before) == {"head": 1, "get": 0, "check": 0}
    dense = _write_rich(tmp_path / "b.h5ad", dense=True)
    s3.upload(dense, "rewritten/a.h5ad")  # a new ETag
    before = object_store.request_counts()
    now = grain_cells.AnnDataSource(url, storage_options=s3.options)
    assert _counts_since(before)["get"] > 0  # opened, not taken from the entry
    assert not now.is_sparse
    rows = np.arange(now.num_cells)
    np.testing.assert_array_equal(now.read(rows).X, anndata.read_h5ad(dense).X)


def test_a_cold_build_opens_objects_in_processes(parts, s3, monkeypatch, tmp_path):
    """Objects not in the cache are opened in spawned processes, 2+ at a time."""
    from grain_cells.io import _build

    paths, urls = parts
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cold"))
    monkeypatch.setattr(_build, "MIN_PROCESS_OPENS", 2)
    made = []
    real = _build._pool
    monkeypatch.setattr(_build, "_pool", lambda n, r: made.append(n) or real(n, r))
    source = grain_cells.AnnDataSource(
        urls, obs_columns=OBS, storage_options=s3.options
    )
    assert made == [len(urls)]
    assert os.listdir(tmp_path / "cold" / "file-meta")  # stored by the processes
    local = grain_cells.AnnDataSource(paths, obs_columns=OBS)
    rows = np.random.default_rng(4).permutation(local.num_cells)
    got, want = source.read(rows), local.read(rows)
    np.testing.assert_array_equal(_dense(got.X), _dense(want.X))
    for c in OBS:
        np.testing.assert_array_equal(got.obs[c], want.obs[c])
    # A bad object among them is named, from the process that opened it.
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cold-again"))
    bad = s3.put_bytes("broken/bad.h5ad", b"not an hdf5 file" * 100)
    with pytest.raises(errors.AnnDataFormatError, match=r"broken/bad\.h5ad"):
        grain_cells.AnnDataSource([*urls, bad], storage_options=s3.options)
    assert made == [len(urls), len(urls) + 1]


def test_checkpoint_restores_with_a_fresh_source(parts, s3):
    _, urls = parts
    everything = _run(_loader(urls, options=s3.options))
    iterator = iter(_loader(urls, options=s3.options))
    take(iterator, 3)
    state = iterator.get_state()
    close_iterator(iterator)
    assert json.loads(state)["grain_cells"]
    restored = iter(_loader(urls, options=s3.options))  # nothing shared
    restored.set_state(state)
    _assert_same(take(restored), everything[3:])
    close_iterator(restored)


def test_preshuffle_from_bucket(parts, s3, tmp_path, monkeypatch):
    paths, urls = parts
    for key, value in s3.env().items():  # credentials from the environment
        monkeypatch.setenv(key, value)
    out = grain_cells.preshuffle(urls, tmp_path / "out", seed=3, progress=False)
    want = grain_cells.preshuffle(paths, tmp_path / "ref", seed=3, progress=False)
    assert len(out) == len(want)
    for a, b in zip(out, want, strict=True):
        x, y = anndata.read_h5ad(a), anndata.read_h5ad(b)
        np.testing.assert_array_equal(_dense(x.X), _dense(y.X))
        pd.testing.assert_frame_equal(x.obs, y.obs)


def test_missing_object_and_bad_option(s3):
    with pytest.raises(FileNotFoundError, match=r"s3://cells/nope\.h5ad"):
        grain_cells.AnnDataSource("s3://cells/nope.h5ad", storage_options=s3.options)
    with pytest.raises(ValueError, match="no_such_key"):
        grain_cells.AnnDataSource(
            "s3://cells/nope.h5ad", storage_options={**s3.options, "no_such_key": 1}
        )


def test_read_ahead_serves_hinted_blocks(parts, s3):
    paths, urls = parts
    source = grain_cells.AnnDataSource(urls, block_size=4, storage_options=s3.options)
    local = grain_cells.AnnDataSource(paths, block_size=4)
    keys = np.random.default_rng(2).permutation(len(source))[:20]
    source.read(source.cell_offsets[:-1])  # opens the files (indptr pinned)
    before = object_store.request_counts()
    source.advise(keys)  # returns at once; the GETs run in the background
    hinted = _gets_settle(before, poll_s=0.5)  # until they have all been sent
    assert hinted.get("get", 0) >= 1
    got = source.read_blocks(keys)
    assert _counts_since(before) == hinted  # every piece came from read-ahead
    np.testing.assert_array_equal(_dense(got.X), _dense(local.read_blocks(keys).X))
    # An unhinted read still sends its own GETs and gets the same values.
    other = np.setdiff1d(np.arange(len(source)), keys)[:5]
    np.testing.assert_array_equal(
        _dense(source.read_blocks(other).X), _dense(local.read_blocks(other).X)
    )
    assert _counts_since(before)["get"] > hinted["get"]


def test_gene_join_over_urls(tmp_path, s3):
    full = _write_rich(tmp_path / "full.h5ad")
    adata = anndata.read_h5ad(full)
    part = str(tmp_path / "part.h5ad")
    adata[:20, ::2].copy().write_h5ad(part)  # every other gene
    paths = [full, part]
    urls = [s3.upload(p, f"join/{i}.h5ad") for i, p in enumerate(paths)]
    for join in ("inner", "outer"):
        remote = grain_cells.AnnDataSource(urls, join=join, storage_options=s3.options)
        local = grain_cells.AnnDataSource(paths, join=join)
        np.testing.assert_array_equal(remote.var_names, local.var_names)
        rows = np.arange(remote.num_cells)
        np.testing.assert_array_equal(
            _dense(remote.read(rows).X), _dense(local.read(rows).X)
        )


def test_anonymous_and_http_urls(rich, s3):
    path, _ = rich["csr"]
    url = s3.upload(path, "public/csr.h5ad")
    s3.client.put_object_acl(Bucket=s3.bucket, Key="public/csr.h5ad", ACL="public-read")
    want = _dense(grain_cells.AnnDataSource(path).read(np.arange(10)).X)
    anon = {"endpoint_url": s3.endpoint, "region": "us-east-1", "anon": True}
    http = f"{s3.endpoint}/{s3.bucket}/public/csr.h5ad"  # path-style URL
    for source in (
        grain_cells.AnnDataSource(url, storage_options=anon),
        grain_cells.AnnDataSource(http),
    ):
        np.testing.assert_array_equal(_dense(source.read(np.arange(10)).X), want)


def _gets_settle(before: dict, poll_s: float = 0.1) -> dict:
    """Request counts since `before`, once background GETs were sent and stopped."""
    seen, deadline = _counts_since(before), time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        now = _counts_since(before)
        if now == seen and now.get("get"):
            break
        seen = now
    return seen


def test_a_hint_larger_than_the_budget_still_reads_ahead(tmp_path, s3, monkeypatch):
    # A hint that overflows the read-ahead budget is cut to what fits: its
    # requests go out, and later hints keep working (a hint's own unsent
    # requests once stopped eviction and stayed held, never sent).
    from grain_cells.storage.remote import _reader

    n, genes = 3_000, 200  # blocks of 4 rows: ~3 KB pieces, 120 KB apart
    x = np.arange(n, dtype=np.float32)[:, None] * 1000 + np.arange(genes) + 1
    path = str(tmp_path / "wide.h5ad")
    anndata.AnnData(sp.csr_matrix(x)).write_h5ad(path)
    url = s3.upload(path, "budget/wide.h5ad")
    monkeypatch.setattr(_reader, "READAHEAD_BYTES", 20_000)  # a few requests
    source = grain_cells.AnnDataSource(url, block_size=4, storage_options=s3.options)
    keys = np.random.default_rng(3).permutation(len(source))
    source.read_blocks(keys[:1])  # opens the file (indptr pinned)
    for hint in (keys[1:21], keys[21:41]):
        before = object_store.request_counts()
        source.advise(hint)
        assert _gets_settle(before).get("get", 0) >= 1
        rows = (hint[:, None] * 4 + np.arange(4)).ravel()
        np.testing.assert_array_equal(_dense(source.read_blocks(hint).X), x[rows])


def test_a_reopen_reads_through_the_objects_byte_layouts(parts, s3, monkeypatch):
    """An object a process has opened is reopened from its byte layouts: no
    HDF5 open, no HEAD (its reads are bound to the version by `If-Match`).

    Each reopen was a whole HDF5 open (metadata from the disk cache, `indptr`
    pinned) with the open-file bound closing objects in turn; a rewrite
    between reopens is still refused at the read.
    """
    paths, _ = parts
    urls = [s3.upload(p, f"reopen/{i}.h5ad") for i, p in enumerate(paths)]
    source = grain_cells.AnnDataSource(
        urls, storage_options=s3.options, max_open_files=1, block_size=5
    )
    first = source.read_blocks(range(len(source)))  # every object, one open at once
    opens = hdf5_opens(monkeypatch)
    before = object_store.request_counts()
    again = source.read_blocks(range(len(source)))  # each object reopened
    assert opens == [] and _counts_since(before)["head"] == 0
    local = grain_cells.AnnDataSource(paths, block_size=5)
    oracle = local.read_blocks(range(len(local))).X
    np.testing.assert_array_equal(_dense(again.X), _dense(oracle))
    np.testing.assert_array_equal(_dense(first.X), _dense(oracle))

    s3.upload(_write_rich(paths[0] + ".other.h5ad"), "reopen/0.h5ad")
    with pytest.raises(errors.SourceChangedError, match=r"reopen/0\.h5ad"):
        source.read_blocks(range(len(source)))


def test_a_workers_first_open_reads_the_objects_entry_not_hdf5(parts, s3, monkeypatch):
    """A process's first open of an object the build saved an entry for (its
    byte layouts and obs columns' places) reads that entry: no HDF5 open;
    `indptr` and the obs codes come in one batch of GETs.
    """
    paths, _ = parts
    urls = [s3.upload(p, f"first/{i}.h5ad") for i, p in enumerate(paths)]
    built = grain_cells.AnnDataSource(
        urls, obs_columns=OBS, storage_options=s3.options, block_size=5
    )
    opens = hdf5_opens(monkeypatch)
    worker = pickle.loads(pickle.dumps(built))  # what a worker process gets
    before = object_store.request_counts()
    got = worker.read_blocks(range(len(worker)))
    counts = _counts_since(before)
    assert opens == [] and counts["head"] == 0, (opens, counts)
    local = grain_cells.AnnDataSource(paths, obs_columns=OBS, block_size=5)
    want = local.read_blocks(range(len(local)))
    np.testing.assert_array_equal(_dense(got.X), _dense(want.X))
    for c in OBS:
        np.testing.assert_array_equal(got.obs[c], want.obs[c])
