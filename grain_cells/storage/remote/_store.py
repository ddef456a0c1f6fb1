"""Objects in S3, GCS, Azure or on HTTP servers (obstore): stores, HEADs, errors.

Design notes: docs/reference/design.md#storage-remote-store.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import threading
import urllib.parse

from grain_cells import errors
from grain_cells._util import fork
from grain_cells.storage._readers import FileStat
from grain_cells.storage.remote import _aws, _retries
from grain_cells.storage.remote._retries import first_line

# Schemes read through obstore; `file://` URLs are plain local paths.
SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "azure", "http", "https")

# Chosen by measurement (benchmarks/RESULTS.md, issue 13, round 6): at 20 ms
# round trip, with a version check (HEAD) after each batch of GETs, 256 per
# process and kind reach 26-29k cells/s at 0 workers, 64 only 11k, 512 no more.
DEFAULT_MAX_IN_FLIGHT = 256
MAX_IN_FLIGHT_LIMIT = 1024
DEFAULT_CONTENT_CHECK_S = 60.0
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
        DEFAULT_CONTENT_CHECK_S,
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

# A forked child builds its own clients: the stores' belong to the parent.
_stores = fork.ProcessCache()

# Requests made by this process, by kind ("head": a source's HEADs, "get",
# "check": the HEAD after each batch of GETs), for tests and benchmarks.
_counts: collections.Counter = collections.Counter()
_counts_lock = threading.Lock()
# Whether this process, or the one it was forked from, used obstore.
_used = {"here": False, "inherited": False}


def is_url(path) -> bool:
    """Whether `path` is a URL read through an object store (not `file://`)."""
    if not isinstance(path, str) or "://" not in path:
        return False
    return path.split("://", 1)[0].lower() in SCHEMES


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
    _used["here"] = True
    with _counts_lock:
        _counts[kind] += n


def mark_obstore_used() -> None:
    """Notes that this process has sent requests through obstore."""
    _used["here"] = True


@fork.in_child
def _after_fork() -> None:
    # No lock here (a parent's thread may hold `_counts_lock` at the fork):
    # every counted request has set `here` (`count_request`).
    _used["inherited"] = _used["here"] or _used["inherited"]
    _used["here"] = False


def check_not_forked_after_use(where: str) -> None:
    """Raises `ObjectStoreError` in a child forked after obstore was used (it hangs)."""
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


def store_for(url: str, storage_options: dict | None = None, at: bool = False):
    """This process's obstore store for `url`'s bucket or host (`at`: rooted at `url`).

    Raises `ValueError` naming a bad option, or as `check_not_forked_after_use`.
    """
    check_not_forked_after_use(url)
    root, _ = split_url(url)  # names a bad URL
    if at:
        root = url.rstrip("/")
    options = dict(storage_options or {})
    for name in READER_OPTIONS:
        options.pop(name, None)
    # The environment's profile settings are part of the key: a process that
    # changes AWS_PROFILE gets a store with that profile's credentials.
    key = (at, root, repr(sorted(options.items())), _aws.cache_key())
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

    client, retry = _retries.client_options(options), _retries.retry_config(options)
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
    for key in _retries.POLICY_KEYS:
        options.pop(key, None)
    if "endpoint_url" in options:
        options["endpoint"] = options.pop("endpoint_url")
    if options.pop("anon", False) and scheme not in ("http", "https"):
        options["skip_signature"] = True
    is_s3 = scheme in ("s3", "s3a")
    if is_s3 and (provider := _aws.apply_profile(root, options)) is not None:
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
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get(
            "AWS_ENDPOINT", ""
        )
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


def ObjectStat(size: int, etag: str, last_modified_ns: int) -> FileStat:
    """The `FileStat` of one object version (`etag` with its quotes; "": none)."""
    return FileStat(0, 0, size, last_modified_ns, 0, etag)


def stat_of(meta) -> FileStat:
    """The `FileStat` of obstore's `ObjectMeta`."""
    modified = meta.get("last_modified")
    ns = int(modified.timestamp() * 1e9) if modified is not None else 0
    return ObjectStat(int(meta["size"]), str(meta.get("e_tag") or ""), ns)


def head(url: str, storage_options: dict | None = None) -> FileStat:
    """The object's size, ETag and last-modified (one HEAD); raises as `named_error`."""
    import obstore

    store = store_for(url, storage_options)
    _, key = split_url(url)
    count_request("head")
    try:
        return stat_of(obstore.head(store, key))
    except Exception as e:
        raise named_error(e, url, storage_options) from None


def named_error(e: Exception, url: str, storage_options, what: str = "read"):
    """The error to raise for obstore's `e` at a `what` (read: a HEAD; upload, ...)."""
    from obstore import exceptions as ox

    if not isinstance(e, (ox.BaseError, OSError)):
        return e
    status, _, _ = _retries.describe(e)
    write, text = what != "read", str(e)
    if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError)) or (
        write and status in (401, 403)
    ):
        return PermissionError(
            f"{url}: {what} refused ({first_line(e)}). The credentials in use may "
            "not do that there: pass others in storage_options (or "
            "output_storage_options), set AWS_PROFILE or the AWS_* variables, or "
            "ask for write access to the bucket."
            if write
            else f"{url}: access refused ({first_line(e)}). The credentials in use "
            "(storage_options, else the AWS_*/GOOGLE_* environment, AWS_PROFILE "
            "or ~/.aws profiles, instance roles) may not read it: pass others "
            "(e.g. storage_options={'profile': NAME}), ask for read access, or "
            "use anon=True for a public bucket."
        )
    if isinstance(e, (ox.NotFoundError, FileNotFoundError)) or (
        write and (status == 404 or "NoSuchBucket" in text)
    ):
        return missing_bucket_or_object(url, storage_options, e, what)
    if write:
        return OSError(f"{url}: {what} failed: {first_line(e)}")
    if (  # a requester-pays GCS bucket's 400 to a request naming no project
        isinstance(e, ox.GenericError)
        and url.split("://", 1)[0].lower() in ("gs", "gcs")
        and "user_project" not in (storage_options or {})
        and ("400 Bad Request" in text or "UserProjectMissing" in text)
    ):
        return PermissionError(
            f"{url}: the bucket answered 400 Bad Request ({first_line(e)}), "
            "which is how a GCS requester-pays bucket refuses requests that name "
            "no project to bill. Pass the Google Cloud project to bill: "
            "storage_options={'user_project': 'my-billing-project'} (the "
            "credentials need serviceusage.services.use on it)."
        )
    return e


def missing_bucket_or_object(
    url: str, storage_options: dict | None, error: BaseException, what: str = "read"
) -> FileNotFoundError:
    """The error of a 404: no bucket, or the keys beside a missing key (a LIST)."""
    import obstore

    root, key = split_url(url)
    scheme, _, bucket = root.partition("://")
    if scheme.lower() in ("http", "https"):
        return FileNotFoundError(f"{url}: no such object (HTTP 404); check the URL")
    folder = key.rpartition("/")[0]
    try:
        store = store_for(url, storage_options)
        listed = obstore.list_with_delimiter(store, folder or None)
    except Exception as e:  # any failure: say what we know
        if "NoSuchBucket" not in str(e) + str(error):
            return FileNotFoundError(f"{url}: no such object ({first_line(error)})")
        options = storage_options or {}
        endpoint = (
            options.get("endpoint_url")
            or options.get("endpoint")
            or os.environ.get("AWS_ENDPOINT_URL")
            or "the provider's default endpoint"
        )
        return FileNotFoundError(
            f"{url}: bucket {bucket!r} does not exist at {endpoint} "
            f"(NoSuchBucket; {what} failed). Check the bucket's name, and for "
            "S3-compatible stores endpoint_url and region in storage_options "
            "(or AWS_ENDPOINT_URL, AWS_REGION); create the bucket first to "
            "write to it."
        )
    names = [m["path"].rpartition("/")[2] for m in listed["objects"]]
    beside = f"{len(names)} object(s) there: {', '.join(names[:5])}" + (
        ", ..." if len(names) > 5 else ""
    )
    where = f"{root}/{folder}/" if folder else f"{root}/"
    return FileNotFoundError(
        f"{url}: no such object: bucket {bucket!r} has no key {key!r} ({what} "
        f"failed; objects under {where}: {beside if names else 'none there'}). "
        "Check the key (keys are case-sensitive)."
    )
