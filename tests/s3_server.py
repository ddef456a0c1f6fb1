"""An S3-compatible server on localhost for tests: moto's server mode.

`s3` (session-scoped fixture) starts moto's server (`python -m moto.server`)
in a child process on 127.0.0.1 and a free port, creates a bucket and
returns an `S3` helper: `upload(path, key)` puts a local file and returns its
`s3://` URL, and `options` are the storage options that reach the server.
When moto is not installed or the server does not answer within
`START_SECONDS`, every test using the fixture is skipped with the reason
(never passed silently).

The server runs in its own process, not in a thread of the test process: a
request sent from inside an h5py call holds h5py's global lock, and a
server thread of the same process that garbage-collects an h5py object
would wait for that lock while the request waits for the server.

moto reads a whole object for every range GET: keep test objects small.
The metadata cache of remote files goes to the session's private cache
folder (`GRAIN_CELLS_CACHE`, conftest's `private_cache`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import subprocess
import sys
import time
import urllib.request

import pytest

BUCKET = "cells"
KEYS = {"access_key_id": "testing", "secret_access_key": "testing"}
START_SECONDS = 60


@dataclasses.dataclass
class S3:
    """A running server and a bucket on it."""

    endpoint: str
    bucket: str
    client: object  # boto3 S3 client

    @property
    def options(self) -> dict:
        """Storage options for `AnnDataSource(..., storage_options=...)`."""
        return {"endpoint_url": self.endpoint, "region": "us-east-1", **KEYS}

    def env(self) -> dict:
        """The same settings as AWS environment variables."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": KEYS["access_key_id"],
            "AWS_SECRET_ACCESS_KEY": KEYS["secret_access_key"],
        }

    def upload(self, path, key: str | None = None) -> str:
        """Puts a local file into the bucket; returns its URL."""
        key = key or pathlib.Path(path).name
        self.client.upload_file(str(path), self.bucket, key)
        return f"s3://{self.bucket}/{key}"

    def put_bytes(self, key: str, data: bytes) -> str:
        """Puts bytes as an object; returns its URL."""
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
        return f"s3://{self.bucket}/{key}"


def start_moto(port: int, log: pathlib.Path) -> subprocess.Popen:
    """Starts moto's S3 server on 127.0.0.1:`port`; waits until it answers.

    Args:
        port: A free port.
        log: Where the server's output goes.

    Raises:
        RuntimeError: It exited or did not answer in `START_SECONDS`.
    """
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + START_SECONDS
    while True:
        if server.poll() is not None:
            raise RuntimeError(
                f"moto.server exited with {server.returncode}: "
                f"{log.read_text(errors='replace')[-500:]}"
            )
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).close()
            return server
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                server.wait()
                raise RuntimeError(f"no answer on 127.0.0.1:{port}") from None
            time.sleep(0.2)


@contextlib.contextmanager
def moto_endpoint(tmp_path_factory, name: str, env: dict | None = None):
    """A moto server process on a free port, stopped on exit; yields its endpoint.

    The test is skipped, with the reason, when moto is not installed or the
    server does not start. `env` is set for the server process only.
    """
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
        import portpicker
    except ImportError as e:
        pytest.skip(f"moto[server] is not installed ({e}): pip install 'moto[server]'")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in (env or {}).items():
            patch.setenv(key, value)
        # A port picked free can be taken before moto binds it (another test
        # process starting its own server): a new port, up to three times.
        for attempt in range(3):
            port = portpicker.pick_unused_port()
            try:
                server = start_moto(port, tmp_path_factory.mktemp(name) / "server.log")
                break
            except (OSError, RuntimeError) as e:  # e.g. a sandbox without loopback
                if attempt == 2 or "Address already in use" not in str(e):
                    pytest.skip(
                        f"the moto S3 server cannot start on 127.0.0.1:{port}: {e}"
                    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A moto S3 server on localhost with an empty bucket (see the module doc)."""
    with moto_endpoint(tmp_path_factory, "moto") as endpoint:
        import boto3  # present: moto_endpoint skips without it

        client = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", **_boto(KEYS)
        )
        client.create_bucket(Bucket=BUCKET)
        yield S3(endpoint, BUCKET, client)


@dataclasses.dataclass
class AuthS3:
    """A moto server that checks signatures, with two users and a bucket.

    `keys` may do anything (an IAM policy allowing `s3:*`); `denied_keys`
    belong to a user with no policy (every request refused with 403).
    """

    endpoint: str
    bucket: str
    client: object  # boto3 S3 client with `keys`
    keys: dict
    denied_keys: dict


# Requests moto serves before it starts checking signatures: enough for the
# IAM setup below; the rest are used up by refused probes (`_enforce`).
_NO_AUTH_REQUESTS = 20


def _enforce(endpoint: str) -> None:
    """Sends unsigned-for-real requests until moto refuses one (auth is on)."""
    import boto3
    import botocore.exceptions

    probe = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="AKIANOTAUSER",
        aws_secret_access_key="wrong",
    )
    for _ in range(_NO_AUTH_REQUESTS + 5):
        try:
            probe.list_buckets()
        except botocore.exceptions.ClientError:
            return
    raise RuntimeError("moto never started checking signatures")


@pytest.fixture(scope="session")
def s3_auth(tmp_path_factory):
    """A moto S3 server with IAM authentication on (see `AuthS3`)."""
    import json

    env = {"INITIAL_NO_AUTH_ACTION_COUNT": str(_NO_AUTH_REQUESTS)}
    with moto_endpoint(tmp_path_factory, "moto-auth", env) as endpoint:
        import boto3  # present: moto_endpoint skips without it

        iam = boto3.client(
            "iam", endpoint_url=endpoint, region_name="us-east-1", **_boto(KEYS)
        )
        users = {}
        for name in ("reader", "nobody"):
            iam.create_user(UserName=name)
            key = iam.create_access_key(UserName=name)["AccessKey"]
            users[name] = {
                "access_key_id": key["AccessKeyId"],
                "secret_access_key": key["SecretAccessKey"],
            }
        policy = iam.create_policy(
            PolicyName="s3-all",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [
                        {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
                    ],
                }
            ),
        )
        iam.attach_user_policy(UserName="reader", PolicyArn=policy["Policy"]["Arn"])
        _enforce(endpoint)
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            **_boto(users["reader"]),
        )
        client.create_bucket(Bucket=BUCKET)
        yield AuthS3(endpoint, BUCKET, client, users["reader"], users["nobody"])


def _boto(keys: dict) -> dict:
    return {
        "aws_access_key_id": keys["access_key_id"],
        "aws_secret_access_key": keys["secret_access_key"],
    }
