"""Credentials as users give them, against a moto server that checks them.

`s3_server.s3_auth` runs moto with IAM authentication on: a request signed
with unknown keys, or by a user without permission, is refused (403). So a
read that works proves the credentials reached the request. Routes: the
`AWS_*` environment, `AWS_PROFILE` and the `default` profile of a temporary
`~/.aws` (HOME monkeypatched; obstore does not read profiles, see
`grain_cells.storage.remote._store`), `storage_options={"profile": ...}`, explicit
keys. Errors: missing bucket, missing object, refused credentials, each
naming the URL and the fix.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import OBS, run, write_files

pytest.importorskip("obstore", reason="obstore is not installed")
pytest.importorskip("boto3", reason="boto3 is not installed")

import grain_cells

_AWS_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_ALLOW_HTTP",
)


@pytest.fixture(scope="module")
def files(tmp_path_factory, s3_auth):
    """conftest's CSR files: local paths and their URLs on the auth server."""
    paths = write_files(tmp_path_factory.mktemp("auth"))
    urls = []
    for i, path in enumerate(paths):
        s3_auth.client.upload_file(path, s3_auth.bucket, f"auth/{i}.h5ad")
        urls.append(f"s3://{s3_auth.bucket}/auth/{i}.h5ad")
    return paths, urls


@pytest.fixture
def home(tmp_path, monkeypatch, s3_auth):
    """A clean AWS environment and a HOME whose ~/.aws has three profiles."""
    for name in _AWS_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))
    aws = tmp_path / ".aws"
    aws.mkdir()
    good, bad = s3_auth.keys, s3_auth.denied_keys
    credentials, config = [], []
    for name, keys in (("default", good), ("reader", good), ("nobody", bad)):
        credentials += [
            f"[{name}]",
            f"aws_access_key_id = {keys['access_key_id']}",
            f"aws_secret_access_key = {keys['secret_access_key']}",
        ]
        header = "[default]" if name == "default" else f"[profile {name}]"
        config += [header, "region = us-east-1", f"endpoint_url = {s3_auth.endpoint}"]
    (aws / "credentials").write_text("\n".join(credentials) + "\n")
    (aws / "config").write_text("\n".join(config) + "\n")
    return tmp_path


def _same_as_local(urls, paths, options=None, worker_count=None) -> None:
    remote = grain_cells.AnnDataSource(urls, obs_columns=OBS, storage_options=options)
    local = grain_cells.AnnDataSource(paths, obs_columns=OBS)
    rows = np.random.default_rng(0).permutation(local.num_cells)
    np.testing.assert_array_equal(
        remote.read(rows).X.toarray(), local.read(rows).X.toarray()
    )
    if worker_count is None:
        return
    got = _batches(remote, worker_count)
    want = _batches(local, 0)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        for key in b:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _batches(source, worker_count) -> list[dict]:
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=0),
        operations=grain_cells.fetch_operations(
            source, batch_size=4, fetch_factor=5, seed=0
        ),
        worker_count=worker_count,
    )
    return run(loader)


def test_default_profile_from_home(files, home):
    paths, urls = files
    # No storage options, no AWS_* variables: ~/.aws's default profile gives
    # keys, region and the endpoint.
    _same_as_local(urls, paths)


def test_aws_profile_variable(files, home, monkeypatch):
    paths, urls = files
    monkeypatch.setenv("AWS_PROFILE", "reader")
    _same_as_local(urls, paths, worker_count=0)
    monkeypatch.setenv("AWS_PROFILE", "nobody")
    with pytest.raises(PermissionError, match=r"s3://cells/auth/0\.h5ad.*profile"):
        grain_cells.AnnDataSource(urls[0])


def test_profile_option_wins_over_environment_keys(files, home, monkeypatch, s3_auth):
    paths, urls = files
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_auth.denied_keys["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    _same_as_local(urls, paths, {"profile": "reader"})
    with pytest.raises(ValueError, match=r"profile 'nope'.*\.aws/credentials"):
        grain_cells.AnnDataSource(urls[0], storage_options={"profile": "nope"})
    with pytest.raises(ValueError, match="one or the other"):
        grain_cells.AnnDataSource(
            urls[0], storage_options={"profile": "reader", **s3_auth.keys}
        )


def test_environment_keys_and_explicit_keys(files, home, monkeypatch, s3_auth):
    paths, urls = files
    (home / ".aws" / "credentials").unlink()  # the environment alone
    (home / ".aws" / "config").unlink()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_auth.keys["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_auth.keys["secret_access_key"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_auth.endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    _same_as_local(urls, paths)
    explicit = {"endpoint_url": s3_auth.endpoint, "region": "us-east-1"}
    _same_as_local(urls, paths, {**explicit, **s3_auth.keys})


@pytest.mark.slow
def test_aws_profile_in_spawned_workers(files, home, monkeypatch):
    paths, urls = files
    monkeypatch.setenv("AWS_PROFILE", "reader")
    _same_as_local(urls, paths, worker_count=2)  # each worker builds its store


@pytest.mark.parametrize("whose", ["unknown keys", "user without permission"])
def test_refused_credentials_name_url_and_fix(files, home, s3_auth, whose):
    _, urls = files
    keys = (
        {"access_key_id": "AKIAUNKNOWN", "secret_access_key": "x"}
        if whose == "unknown keys"
        else s3_auth.denied_keys
    )
    options = {"endpoint_url": s3_auth.endpoint, "region": "us-east-1", **keys}
    with pytest.raises(
        PermissionError,
        match=r"s3://cells/auth/1\.h5ad: access refused.*storage_options",
    ):
        grain_cells.AnnDataSource(urls[1], storage_options=options)


def test_missing_bucket_and_object_name_the_fix(s3, monkeypatch, tmp_path):
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path))
    s3.put_bytes("errs/here.h5ad", b"x")
    with pytest.raises(
        FileNotFoundError,
        match=r"s3://nobucket/a\.h5ad: bucket 'nobucket' does not exist at "
        r"http://127\.0\.0\.1:\d+ .*endpoint_url",
    ):
        grain_cells.AnnDataSource("s3://nobucket/a.h5ad", storage_options=s3.options)
    with pytest.raises(
        FileNotFoundError,
        match=r"s3://cells/errs/Here\.h5ad: no such object: bucket 'cells' has no "
        r"key 'errs/Here\.h5ad' .*here\.h5ad.*case-sensitive",
    ):
        grain_cells.AnnDataSource(
            "s3://cells/errs/Here.h5ad", storage_options=s3.options
        )


@pytest.mark.slow  # starting the server and proxy processes takes seconds
def test_https_with_headers(tmp_path, monkeypatch):
    """HTTP(S) URLs send `client_options['default_headers']` on every request."""
    import shutil

    from grain_cells.testing import Fault, ServedFolder

    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "in").mkdir()
    paths = write_files(tmp_path / "in")
    root = tmp_path / "root"
    (root / "web").mkdir(parents=True)
    shutil.copy(paths[0], root / "web" / "a.h5ad")
    try:
        served = ServedFolder(root).start()
    except RuntimeError as e:
        pytest.skip(f"cannot start the local S3 server on loopback: {e}")
    try:
        # The proxy refuses any request without the token (a server that
        # wants an Authorization header).
        served.set_rule(
            lambda request: (
                None
                if request.headers.get("authorization") == "Bearer t0ken"
                else Fault(status=403, code="AccessDenied")
            )
        )
        url = f"{served.endpoint_url}/web/a.h5ad"
        with pytest.raises(PermissionError, match=r"/web/a\.h5ad: access refused"):
            grain_cells.AnnDataSource(url)
        headers = {
            "client_options": {"default_headers": {"Authorization": "Bearer t0ken"}}
        }
        remote = grain_cells.AnnDataSource(url, storage_options=headers)
        local = grain_cells.AnnDataSource(paths[0])
        rows = np.arange(local.num_cells)
        np.testing.assert_array_equal(
            remote.read(rows).X.toarray(), local.read(rows).X.toarray()
        )
    finally:
        served.stop()


def test_no_credentials_anywhere_names_the_fix():
    """obstore's last credential source is a cloud VM's metadata service; off
    a VM it fails with a GenericError about 169.254.169.254, which says nothing
    of credentials. The error names the URL and the ways to pass them.
    """
    from obstore import exceptions as ox

    from grain_cells.storage.remote import _errors

    raw = ox.GenericError(
        "Generic S3 error: Error performing PUT "
        "http://169.254.169.254/latest/api/token in 1ms - Server returned "
        "non-2xx status code: 403 Forbidden"
    )
    e = _errors.store_error(raw, "s3://bucket/a.h5ad", None)
    assert isinstance(e, PermissionError)
    message = str(e)
    assert message.startswith("s3://bucket/a.h5ad: no credentials found")
    assert "'anon': True" in message and "AWS_PROFILE" in message
