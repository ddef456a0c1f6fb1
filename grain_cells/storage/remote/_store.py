"""Object stores (obstore) by URL: options, credentials, retries, request counts.

Design notes: docs/reference/design.md#storage-remote-store.
"""

from __future__ import annotations

import collections
import datetime
import functools
import math
import os
import pathlib
import re
import threading
import urllib.parse
from collections.abc import Mapping
from typing import Any

from grain_cells import errors
from grain_cells._util import fork

# Schemes read through obstore; `file://` URLs are plain local paths.
SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "azure", "http", "https")

# 256 range GETs in flight per process (benchmarks/RESULTS.md, issue 13, round 6).
DEFAULT_MAX_IN_FLIGHT = 256
MAX_IN_FLIGHT_LIMIT = 1024
# Keys of `storage_options` that tune grain_cells' reader, not the store:
# (default, valid(value), what a value must be).
READER_OPTIONS = {
    "max_in_flight": (
        DEFAULT_MAX_IN_FLIGHT,
        lambda v: _is_number(v, int) and 1 <= v <= MAX_IN_FLIGHT_LIMIT,
        f"an integer from 1 to {MAX_IN_FLIGHT_LIMIT} (range GETs in flight per "
        "process)",
    ),
    "content_check_s": (
        60.0,
        lambda v: _is_number(v, (int, float)) and math.isfinite(v) and v >= 0,
        "a number of seconds >= 0 (how often each process re-reads the "
        "sampled bytes of an object whose ETag does not follow its content)",
    ),
    "verify_reads": (
        False,
        lambda v: isinstance(v, bool),
        "True or False (check every byte read against block digests of the "
        "whole object, read when each process opens it)",
    ),
}
DEFAULT_RETRY: dict[str, Any] = {
    "max_retries": 10,
    "backoff": {
        "init_backoff": datetime.timedelta(milliseconds=100),
        "max_backoff": datetime.timedelta(seconds=5),
        "base": 2,
    },
    "retry_timeout": datetime.timedelta(seconds=60),
}
DEFAULT_CLIENT: dict[str, Any] = {
    "connect_timeout": datetime.timedelta(seconds=5),
    "timeout": datetime.timedelta(seconds=30),
}
# obstore's ClientConfig keys its stores also read from the environment
# (`AWS_ALLOW_HTTP`, ...): given `client_options` replace those, so they are
# read here and kept (below explicit options).
_ENV_CLIENT_KEYS = re.compile(
    "ALLOW_HTTP|ALLOW_INVALID_CERTIFICATES|CONNECT_TIMEOUT|POOL_IDLE_TIMEOUT|"
    "POOL_MAX_IDLE_PER_HOST|PROXY_URL|PROXY_CA_CERTIFICATE|PROXY_EXCLUDES|"
    "TIMEOUT|USER_AGENT"
)

# A forked child builds its own clients: the stores' belong to the parent.
_stores = fork.ProcessCache()
# Requests sent by this process, by kind ("head": a source's HEADs, "get",
# "check": the HEAD after each batch of GETs), for tests and benchmarks.
_counts: collections.Counter = collections.Counter()
_counts_lock = threading.Lock()
# Whether this process, or the one it was forked from, used obstore.
_used = {"here": False, "inherited": False}


def is_url(path) -> bool:
    """Whether `path` is a URL read through an object store (not `file://`)."""
    scheme = path.split("://", 1)[0] if isinstance(path, str) and "://" in path else ""
    return scheme.lower() in SCHEMES


def local_path(path: str) -> str:
    """A `file://` URL as a local path; any other path unchanged."""
    if isinstance(path, str) and path.lower().startswith("file://"):
        return urllib.parse.unquote(urllib.parse.urlsplit(path).path)
    return path


def split_url(url: str) -> tuple[str, str]:
    """`(store root, object key)` of a URL, e.g. `("s3://bucket", "a/b.h5ad")`."""
    parts = urllib.parse.urlsplit(url)
    if not parts.netloc or not parts.path.strip("/"):
        raise ValueError(
            f"{url}: expected a URL of an object such as s3://bucket/key.h5ad, "
            "gs://bucket/key.h5ad or https://host/path/key.h5ad"
        )
    if parts.query or parts.fragment:
        raise ValueError(
            f"{url}: URLs with a query or fragment are not supported; pass "
            "credentials as storage_options"
        )
    key = urllib.parse.unquote(parts.path.lstrip("/"))
    return f"{parts.scheme}://{parts.netloc}", key


def request_counts() -> dict[str, int]:
    """Requests this process has sent, by kind (`head`, `get`, `check`)."""
    with _counts_lock:
        return dict(_counts)


def count_request(kind: str, n: int = 1) -> None:
    """Counts `n` requests of `kind` (see `request_counts`)."""
    with _counts_lock:
        _counts[kind] += n


@fork.in_child
def _after_fork() -> None:
    _used["inherited"] = _used["here"] or _used["inherited"]
    _used["here"] = False


def check_not_forked_after_use(where: str) -> None:
    """Notes that this process uses obstore (a store is made, or its client used).

    Raises `ObjectStoreError` in a child forked after obstore was used (it hangs).
    """
    _used["here"] = True
    if _used["inherited"]:
        raise errors.ObjectStoreError(
            f"{where}: this process was forked from one that had already read "
            "from an object store, and obstore's runtime does not survive "
            "os.fork (its requests would hang). Read remote stores from "
            "spawned processes (Grain's workers are spawned; for "
            "multiprocessing use get_context('spawn')), or fork before the "
            "first remote read.",
            url=where,
        )


def option(storage_options: dict | None, name: str):
    """The reader option `name` of `storage_options` (`ValueError` if not valid)."""
    default, valid, expected = READER_OPTIONS[name]
    value = (storage_options or {}).get(name, default)
    if not valid(value):
        raise ValueError(f"storage_options[{name!r}] must be {expected}, got {value!r}")
    return value


def _is_number(value, kinds) -> bool:
    return isinstance(value, kinds) and not isinstance(value, bool)


max_in_flight = functools.partial(option, name="max_in_flight")


def retry_config(storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `retry_config` for obstore: defaults overridden by key (`ValueError`)."""
    given = _mapping(storage_options, "retry_config")
    unknown = set(given) - set(DEFAULT_RETRY)
    if unknown:
        raise ValueError(
            f"storage_options['retry_config'] has unknown keys {sorted(unknown)}; "
            f"expected some of {sorted(DEFAULT_RETRY)} (obstore's RetryConfig)"
        )
    out = {**DEFAULT_RETRY, **given}
    out["backoff"] = {**DEFAULT_RETRY["backoff"], **dict(given.get("backoff", {}))}
    return out


def client_options(storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `client_options` for obstore: defaults < the environment's < given."""
    out = dict(DEFAULT_CLIENT)
    for prefix in ("AZURE_", "GOOGLE_", "AWS_"):  # the last set wins
        for name, value in os.environ.items():
            key = name[len(prefix) :]
            if name.startswith(prefix) and _ENV_CLIENT_KEYS.fullmatch(key):
                out[key.lower()] = value
    return {**out, **_mapping(storage_options, "client_options")}


def _mapping(storage_options, key: str) -> dict[str, Any]:
    value = (storage_options or {}).get(key) or {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"storage_options[{key!r}] must be a dict of obstore settings, "
            f"got {type(value).__name__}"
        )
    return dict(value)


def store_for(url: str, storage_options: dict | None = None, at: bool = False):
    """This process's obstore store for `url`'s bucket or host (`at`: at `url`)."""
    check_not_forked_after_use(url)
    root, _ = split_url(url)  # names a bad URL
    if at:
        root = url.rstrip("/")
    options = {
        k: v for k, v in (storage_options or {}).items() if k not in READER_OPTIONS
    }
    # The environment's profile settings are part of the key: a process that
    # changes AWS_PROFILE gets a store with that profile's credentials.
    names = "AWS_PROFILE AWS_ACCESS_KEY_ID AWS_SHARED_CREDENTIALS_FILE AWS_CONFIG_FILE"
    env = (str(pathlib.Path.home()), *map(os.environ.get, names.split()))
    key = (at, root, repr(sorted(options.items())), env)
    return _stores.get_or_make(key, lambda: _build_store(root, options))


store_at = functools.partial(store_for, at=True)


def _build_store(root: str, options: dict):
    try:
        from obstore.exceptions import UnknownConfigurationKeyError
        from obstore.store import from_url
    except ImportError:
        raise ImportError(
            f"{root}: reading .h5ad files from object stores needs obstore: "
            "pip install 'grain_cells[cloud]'"
        ) from None

    client, retry = client_options(options), retry_config(options)
    scheme = root.split("://", 1)[0].lower()
    if "user_project" in options:  # requester-pays GCS buckets (issue 33)
        project = options.pop("user_project")
        if scheme not in ("gs", "gcs"):
            raise ValueError(
                f"{root}: storage_options['user_project'] names the Google Cloud "
                "project billed for a requester-pays GCS bucket, which only gs:// "
                "URLs use (for S3 requester-pays buckets pass request_payer=True)"
            )
        bad = not isinstance(project, str) or not project.strip()
        if bad or "\r" in project or "\n" in project:
            raise ValueError(
                f"{root}: storage_options['user_project'] must be a Google Cloud "
                f"project ID such as 'my-billing-project', got {project!r}"
            )
        headers = dict(client.get("default_headers") or {})
        client["default_headers"] = {**headers, "x-goog-user-project": project.strip()}
    options.pop("retry_config", None)
    options.pop("client_options", None)
    if "endpoint_url" in options:
        options["endpoint"] = options.pop("endpoint_url")
    if options.pop("anon", False) and scheme not in ("http", "https"):
        options["skip_signature"] = True
    is_s3 = scheme in ("s3", "s3a")
    if is_s3 and (provider := _aws_profile(root, options)) is not None:
        options["credential_provider"] = provider
    elif "profile" in options:
        raise ValueError(
            f"{root}: storage_options['profile'] names an AWS profile, which only "
            "s3:// URLs use"
        )
    # An http:// endpoint (given, from a profile, or AWS_ENDPOINT_URL) means
    # plain HTTP is wanted; obstore would refuse it without allow_http.
    endpoint = str(options.get("endpoint") or "")
    if is_s3 and not endpoint:
        env = os.environ.get
        endpoint = env("AWS_ENDPOINT_URL") or env("AWS_ENDPOINT", "")
    if endpoint.startswith("http://") or scheme == "http":
        client.setdefault("allow_http", True)
    try:
        return from_url(
            root, client_options=client or None, retry_config=retry, **options
        )
    except UnknownConfigurationKeyError as e:
        raise ValueError(
            f"{root}: storage_options has a key obstore does not know ({e}). Use "
            "obstore's configuration keys for this scheme (e.g. for S3: "
            "access_key_id, secret_access_key, region, endpoint_url, anon)."
        ) from None


def _aws_files() -> str:
    """The AWS shared credentials and config files that exist, comma-separated."""
    aws = pathlib.Path.home() / ".aws"
    env = os.environ.get
    files = [env("AWS_SHARED_CREDENTIALS_FILE") or aws / "credentials"]
    files = map(pathlib.Path, [*files, env("AWS_CONFIG_FILE") or aws / "config"])
    return ", ".join(str(f) for f in files if f.is_file())


def _aws_profile(root: str, options: dict):
    """A profile's credential provider (boto3), or None; sets region, endpoint."""
    profile = options.pop("profile", None)
    keys = ("access_key_id", "aws_access_key_id", "skip_signature")  # or none
    explicit = [k for k in keys if options.get(k)]
    if explicit:
        if profile is not None:
            raise ValueError(
                f"{root}: storage_options names profile={profile!r} and also "
                f"{explicit}; give one or the other"
            )
        return None
    named = profile or os.environ.get("AWS_PROFILE")
    # The environment's keys come first, as in every AWS SDK.
    if profile is None and (
        os.environ.get("AWS_ACCESS_KEY_ID") or not (named or _aws_files())
    ):
        return None
    try:
        import botocore.exceptions
        import botocore.session
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        if named is None:
            return None  # only files without a named profile: obstore's chain
        raise ImportError(
            f"{root}: reading credentials of AWS profile {named!r} needs boto3 "
            "(obstore does not read ~/.aws profiles): pip install "
            "'grain_cells[aws]', or export the profile's keys: "
            'eval "$(aws configure export-credentials --format env)"'
        ) from None
    try:
        session = botocore.session.Session(profile=profile)
        credentials = session.get_credentials()
        scoped = session.get_scoped_config()
    except botocore.exceptions.ProfileNotFound:
        raise ValueError(
            f"{root}: AWS profile {named!r} is not in the shared files "
            f"({_aws_files() or 'no shared file exists'}). Name an existing "
            "profile (storage_options['profile'] or AWS_PROFILE), or add it with "
            "`aws configure --profile NAME`."
        ) from None
    except botocore.exceptions.BotoCoreError as e:
        raise PermissionError(
            f"{root}: AWS profile {named or 'default'!r} cannot give credentials "
            f"({e}). Fix the profile in {_aws_files()}."
        ) from None
    if credentials is None:
        if named is None:
            return None  # nothing in the files: obstore's chain (instance roles)
        raise PermissionError(
            f"{root}: AWS profile {named!r} gives no credentials; add "
            "aws_access_key_id/aws_secret_access_key (or sso_*, role_arn, "
            "credential_process) to it."
        )
    env = os.environ.get
    given = options.get("region") or env("AWS_REGION") or env("AWS_DEFAULT_REGION")
    if not given and (region := session.get_config_variable("region")):
        options["region"] = region
    if not (options.get("endpoint") or env("AWS_ENDPOINT_URL")):
        s3_section = scoped.get("s3") if isinstance(scoped.get("s3"), dict) else {}
        if endpoint := s3_section.get("endpoint_url") or scoped.get("endpoint_url"):
            options["endpoint"] = endpoint
    return Boto3CredentialProvider(session)
