"""`preshuffle` from a bucket into a bucket (moto on localhost).

The oracle is the same run with local inputs and a local output folder:
every part read back from the bucket (downloaded, `anndata.read_h5ad`)
equals its local twin, and so do the minibatches of a loader reading the
parts in place by URL, with 0 and 2 workers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from conftest import OBS, run, write_files

import grain_cells
from grain_cells.preshuffle import _preshuffle as preshuffle_output
from grain_cells.preshuffle import _writer as preshuffle_writer
from grain_cells.storage.remote import _versions as object_writes

pytest.importorskip("obstore", reason="obstore is not installed")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, s3):
    """conftest's three CSR files: local paths and URLs."""
    paths = write_files(tmp_path_factory.mktemp("ps-in"))
    return paths, [s3.upload(p, f"ps-in/{i}.h5ad") for i, p in enumerate(paths)]


def _download(s3, url: str, path) -> str:
    key = url.split(f"s3://{s3.bucket}/", 1)[1]
    s3.client.download_file(s3.bucket, key, str(path))
    return str(path)


def _dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def _batches(paths, worker_count, options=None) -> list[dict]:
    source = grain_cells.AnnDataSource(
        paths, block_size=8, obs_columns=OBS, storage_options=options
    )
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=1),
        operations=grain_cells.fetch_operations(
            source, batch_size=8, fetch_factor=4, seed=1
        ),
        worker_count=worker_count,
    )
    return run(loader)


def _etags(s3, prefix: str) -> dict[str, str]:
    listed = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix)
    return {o["Key"]: o["ETag"] for o in listed.get("Contents", [])}


@pytest.fixture(scope="module")
def shuffled(inputs, s3, tmp_path_factory):
    """One run bucket -> bucket and its local twin: `(urls, paths, staging, tmp)`."""
    paths, urls = inputs
    tmp = tmp_path_factory.mktemp("ps-out")
    kwargs = dict(cells_per_file=100, seed=5, progress=False)
    staging = tmp / "staging"
    got = grain_cells.preshuffle(
        urls,
        f"s3://{s3.bucket}/shuffled/",
        storage_options=s3.options,
        staging_dir=staging,
        **kwargs,
    )
    want = grain_cells.preshuffle(paths, tmp / "local", **kwargs)
    return got, [str(p) for p in want], staging, tmp


def test_bucket_to_bucket_equals_local_run(shuffled, s3):
    got, want, staging, tmp = shuffled
    assert got == [f"s3://{s3.bucket}/shuffled/part-{i:05d}.h5ad" for i in range(3)]
    assert os.listdir(staging) == []  # each part deleted after its upload
    for i, (url, path) in enumerate(zip(got, want, strict=True)):
        remote = anndata.read_h5ad(_download(s3, url, tmp / f"{i}.h5ad"))
        local = anndata.read_h5ad(path)
        np.testing.assert_array_equal(_dense(remote.X), _dense(local.X))
        pd.testing.assert_frame_equal(remote.obs, local.obs)
        pd.testing.assert_frame_equal(remote.var, local.var)
    body = s3.client.get_object(Bucket=s3.bucket, Key="shuffled/preshuffle.json")
    manifest = json.loads(body["Body"].read())
    local_manifest = json.loads((tmp / "local" / "preshuffle.json").read_text())
    assert manifest["fingerprint"] == local_manifest["fingerprint"]
    assert [p["file"] for p in manifest["parts"]] == [os.path.basename(p) for p in want]


@pytest.mark.parametrize("worker_count", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_loader_reads_the_bucket_parts_in_place(shuffled, s3, worker_count):
    got, want, _, _ = shuffled
    remote_batches = _batches(got, worker_count, s3.options)
    local_batches = _batches(want, worker_count)
    assert len(remote_batches) == len(local_batches) > 0
    for a, b in zip(remote_batches, local_batches, strict=True):
        for key in b:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_rerun_keeps_complete_parts_and_drops_stale_ones(
    inputs,
    s3,
    tmp_path,
    monkeypatch,
):
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))
    paths, _ = inputs  # local inputs, bucket output
    out = f"s3://{s3.bucket}/rerun"
    kwargs = dict(seed=2, progress=False, output_storage_options=s3.options)
    grain_cells.preshuffle(paths, out, cells_per_file=120, **kwargs)
    first = _etags(s3, "rerun/")
    assert sorted(first) == [
        "rerun/part-00000.h5ad",
        "rerun/part-00001.h5ad",
        "rerun/part-00002.h5ad",
        "rerun/preshuffle.json",
    ]
    calls = []
    monkeypatch.setattr(
        preshuffle_output,
        "put_file",
        lambda *a: calls.append(a) or pytest.fail("upload"),
    )
    grain_cells.preshuffle(paths, out, cells_per_file=120, **kwargs)
    assert calls == []  # every part found complete in the bucket
    assert _etags(s3, "rerun/") == first
    monkeypatch.undo()
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))
    parts = grain_cells.preshuffle(paths, out, cells_per_file=200, **kwargs)
    assert sorted(_etags(s3, "rerun/")) == [
        "rerun/part-00000.h5ad",
        "rerun/part-00001.h5ad",
        "rerun/preshuffle.json",
    ]
    rows = [
        anndata.read_h5ad(_download(s3, u, tmp_path / f"r{i}.h5ad")).obs["idx"]
        for i, u in enumerate(parts)
    ]
    total = sum(len(r) for r in rows)
    assert total == grain_cells.AnnDataSource(paths).num_cells


def test_large_part_goes_up_in_several_parts(s3, tmp_path, monkeypatch):
    """A part larger than an upload part is a multipart upload (S3 ETag '-N')."""
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(object_writes, "UPLOAD_PART_BYTES", 5 << 20)  # S3's minimum
    n, g = 1500, 1000  # ~6 MB dense float32: two upload parts
    x = (np.arange(n)[:, None] * 1000 + np.arange(g)).astype(np.float32)
    path = tmp_path / "dense.h5ad"
    anndata.AnnData(
        X=x,
        obs=pd.DataFrame({"idx": np.arange(n)}, index=[f"c{i}" for i in range(n)]),
        var=pd.DataFrame(index=[f"g{j}" for j in range(g)]),
    ).write_h5ad(path)
    (url,) = grain_cells.preshuffle(
        str(path),
        f"s3://{s3.bucket}/big",
        output_storage_options=s3.options,
        progress=False,
    )
    etag = s3.client.head_object(Bucket=s3.bucket, Key="big/part-00000.h5ad")["ETag"]
    assert etag.strip('"').endswith("-2"), etag
    back = anndata.read_h5ad(_download(s3, url, tmp_path / "back.h5ad"))
    idx = back.obs["idx"].to_numpy()
    np.testing.assert_array_equal(np.sort(idx), np.arange(n))
    np.testing.assert_array_equal(back.X, x[idx])


def test_missing_bucket_and_refused_writes(inputs, s3, s3_auth, tmp_path):
    paths, _ = inputs
    staging = tmp_path / "staging"
    with pytest.raises(
        FileNotFoundError, match=r"s3://nobucket/out.*bucket 'nobucket' does not exist"
    ):
        grain_cells.preshuffle(
            paths,
            "s3://nobucket/out",
            output_storage_options=s3.options,
            staging_dir=staging,
            progress=False,
        )
    assert os.listdir(staging) == []  # failed before any part was written
    denied = {
        "endpoint_url": s3_auth.endpoint,
        "region": "us-east-1",
        **s3_auth.denied_keys,
    }
    with pytest.raises(PermissionError, match=r"s3://cells/out.*refused.*write access"):
        grain_cells.preshuffle(
            paths, "s3://cells/out", output_storage_options=denied, progress=False
        )


def test_a_part_uploads_while_the_next_is_written(inputs, s3, tmp_path, monkeypatch):
    """Part i's upload runs beside part i + 1's write; the run returns after all."""
    paths, _ = inputs
    events = []
    put, write = object_writes.put_file, preshuffle_writer.Writer.write_part

    def slow_put(url, path, options):
        time.sleep(0.3)  # an upload slower than writing the next small part
        put(url, path, options)
        events.append(("uploaded", int(url[-10:-5])))

    def recording_write(self, index, report):
        events.append(("write", index))
        return write(self, index, report)

    monkeypatch.setattr(preshuffle_output, "put_file", slow_put)
    monkeypatch.setattr(preshuffle_writer.Writer, "write_part", recording_write)
    got = grain_cells.preshuffle(
        paths,
        f"s3://{s3.bucket}/overlap",
        output_storage_options=s3.options,
        cells_per_file=100,
        progress=False,
    )
    assert len(got) == 3
    assert events.index(("write", 1)) < events.index(("uploaded", 0))
    assert events.index(("write", 2)) < events.index(("uploaded", 1))
    assert events[-1] == ("uploaded", 2)  # waited for the last upload


def test_a_failed_upload_stops_the_run(inputs, s3, tmp_path, monkeypatch):
    paths, _ = inputs
    staging = tmp_path / "staging"

    def failing_put(url, path, options):
        raise OSError(f"{url}: upload failed (injected)")

    monkeypatch.setattr(preshuffle_output, "put_file", failing_put)
    with pytest.raises(OSError, match=r"part-00000\.h5ad: upload failed"):
        grain_cells.preshuffle(
            paths,
            f"s3://{s3.bucket}/failing",
            output_storage_options=s3.options,
            cells_per_file=100,
            staging_dir=staging,
            progress=False,
        )
    assert os.listdir(staging) == []  # staged parts removed
    assert not _etags(s3, "failing/")  # nothing published, no manifest


_KILLED_RUN = """
import json, os, signal, sys
import grain_cells
from grain_cells.preshuffle import _preshuffle as preshuffle_output

def killed(*args, **kwargs):  # the part is staged: die as the OOM killer would
    os.kill(os.getpid(), signal.SIGKILL)

preshuffle_output.put_file = killed
urls, out, options, staging = json.loads(sys.argv[1])
grain_cells.preshuffle(urls, out, storage_options=options, staging_dir=staging,
                       cells_per_file=100, seed=9, progress=False)
"""


@pytest.mark.slow  # a subprocess run and a rerun: about 6 s
def test_staging_of_a_killed_run_is_removed_by_the_next(inputs, s3, tmp_path):
    _, urls = inputs
    staging = tmp_path / "staging"
    out = f"s3://{s3.bucket}/killed/"
    args = json.dumps([urls, out, s3.options, str(staging)])
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_RUN, args], capture_output=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    left = [p for p in staging.rglob("*") if p.is_file()]
    assert left, "the killed run staged a part"  # what used to stay forever
    got = grain_cells.preshuffle(
        urls,
        out,
        storage_options=s3.options,
        staging_dir=staging,
        cells_per_file=100,
        seed=9,
        progress=False,
    )
    assert len(got) == 3
    assert list(staging.iterdir()) == []


def test_only_staging_of_dead_owners_is_removed(tmp_path):
    exited = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(exited.stdout)
    parent = os.getppid()
    start = preshuffle_output.start_time(parent)
    mine = preshuffle_output.start_time(os.getpid())
    folders = {
        "dead": f"{preshuffle_output.PREFIX}{dead}-{mine}-ab12",
        "reused": f"{preshuffle_output.PREFIX}{parent}-{start + 1}-cd34",
        "alive": f"{preshuffle_output.PREFIX}{parent}-{start}-ef56",
        "older": f"{preshuffle_output.PREFIX}k2j4h5",  # earlier versions: owner unknown
        "other": "someone-elses",
    }
    for name in folders.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "part.h5ad").write_bytes(b"x")
    made = preshuffle_output.make_staging(tmp_path)
    removed = preshuffle_output.remove_stale_staging(tmp_path)
    assert sorted(p.name for p in removed) == sorted(
        [folders["dead"], folders["reused"]]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [folders["alive"], folders["older"], folders["other"], made.name]
    )


def test_url_inputs_carry_layers_raw_obsm_and_uns(s3, tmp_path):
    """Elements besides X are read through the object store like X."""
    from test_preshuffle_carry import write_inputs

    paths = write_inputs(tmp_path)
    urls = [s3.upload(p, f"carry-in/{i}.h5ad") for i, p in enumerate(paths)]
    keep = ["layers", "raw", "obsm", "varm", "uns"]
    kwargs = dict(keep=keep, seed=2, progress=False)
    (remote,) = grain_cells.preshuffle(
        urls, tmp_path / "remote", storage_options=s3.options, **kwargs
    )
    (local,) = grain_cells.preshuffle(paths, tmp_path / "local", **kwargs)
    a, b = anndata.read_h5ad(remote), anndata.read_h5ad(local)
    assert list(a.obs_names) == list(b.obs_names)
    for name in ("counts", "dense"):
        np.testing.assert_array_equal(_dense(a.layers[name]), _dense(b.layers[name]))
    np.testing.assert_array_equal(_dense(a.raw.X), _dense(b.raw.X))
    np.testing.assert_array_equal(a.obsm["X_pca"], b.obsm["X_pca"])
    np.testing.assert_array_equal(a.varm["PCs"], b.varm["PCs"])
    assert a.uns["title"] == "atlas"
    # anndata >= 0.13 also lists X under the key None.
    assert {k for k in a.layers if k is not None} == {"counts", "dense"}
