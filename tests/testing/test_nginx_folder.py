"""`grain_cells.testing.NginxFolder`: the benchmarks' compiled S3 stand-in.

The values a source reads through it equal the local file's (and so
anndata's: `tests/test_object_store_reads.py` holds that oracle for the
suite's own server), range GETs are counted, `If-Match` is honoured and the
added round-trip time holds every request. Skipped, saying what to install,
where nginx or its echo module is missing.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import grain_cells
from grain_cells.synthetic import _tahoe as synthetic
from grain_cells.testing import NginxFolder, nginx_folder

obstore = pytest.importorskip("obstore", reason="obstore is not installed (.[cloud])")

if nginx_folder.find_nginx() is None or nginx_folder.echo_module() is None:
    pytest.skip(
        f"nginx with its echo module is not installed: {nginx_folder.INSTALL_HINT}",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    out = tmp_path_factory.mktemp("nginx") / "cells.h5ad"
    return synthetic.write_tahoe_like(out, 3_000, n_genes=200, mean_nnz=20)


def test_reads_equal_the_local_file_through_the_loader(path, tmp_path):
    local = grain_cells.AnnDataSource(path, block_size=8, obs_columns=["plate"])
    with NginxFolder(tmp_path, rtt_s=0.002, objects={"b/c.h5ad": path}) as server:
        remote = grain_cells.AnnDataSource(
            "s3://b/c.h5ad",
            block_size=8,
            obs_columns=["plate"],
            storage_options=server.storage_options(),
        )
        rows = np.array([2_999, 0, 1_234, 1_234, 77])
        got, want = remote.read(rows), local.read(rows)
        assert (got.X != want.X).nnz == 0 and got.X.shape == want.X.shape
        server.stats(reset=True)
        batches = []
        for source in (remote, local):
            loader = grain_cells.DataLoader(
                data_source=source,
                sampler=grain_cells.BlockSampler(source, seed=3, num_epochs=1),
                operations=grain_cells.fetch_operations(
                    source, batch_size=32, fetch_factor=4, seed=3
                ),
            )
            batches.append(list(loader))
        assert len(batches[0]) == len(batches[1]) > 0
        for a, b in zip(*batches, strict=True):
            for key in b:
                np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        stats = server.stats()
        assert stats["range_gets"] > 0 and stats["response_bytes"] > 0
        assert server.pids["server"] > 0


def _bucket(server: NginxFolder):
    """obstore's store for bucket `b` of `server`, unsigned."""
    return obstore.store.S3Store(
        "b",
        endpoint=server.endpoint_url,
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
        skip_signature=True,
        region="us-east-1",
    )


def test_if_match_and_latency(path, tmp_path):
    with NginxFolder(tmp_path, rtt_s=0.05, objects={"b/c.h5ad": path}) as server:
        store = _bucket(server)
        etag = obstore.head(store, "c.h5ad")["e_tag"]
        began = time.monotonic()
        data = obstore.get(
            store, "c.h5ad", options={"range": (10, 110), "if_match": etag}
        ).bytes()
        assert time.monotonic() - began >= 0.045
        assert bytes(data) == path.read_bytes()[10:110]
        with pytest.raises(obstore.exceptions.PreconditionError):
            obstore.get(store, "c.h5ad", options={"range": (0, 1), "if_match": '"x"'})


def test_immutable_counts_every_get_of_its_buffered_log(path, tmp_path):
    """`immutable=True` (open files cached, log buffered): same bytes, full counts."""
    want = path.read_bytes()
    objects = {"b/c.h5ad": path}
    with NginxFolder(tmp_path, rtt_s=0.002, objects=objects, immutable=True) as s:
        store = _bucket(s)
        s.stats(reset=True)
        ranges = [(k * 997, k * 997 + 300) for k in range(25)]
        for a, b in ranges:
            got = obstore.get(store, "c.h5ad", options={"range": (a, b)}).bytes()
            assert bytes(got) == want[a:b]
        stats = s.stats()
        assert stats["range_gets"] == 25 and stats["response_bytes"] == 25 * 300


def test_missing_nginx_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setattr(nginx_folder, "find_nginx", lambda: None)
    with pytest.raises(RuntimeError, match="apt-get install nginx-light"):
        NginxFolder(tmp_path).start()
