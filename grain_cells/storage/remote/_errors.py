"""What obstore's errors mean, as errors that name the URL, the cause and the fix.

Design notes: docs/reference/design.md#storage-remote-errors.
"""

from __future__ import annotations

import os
import re

from grain_cells import errors
from grain_cells.storage.remote import _store


def first_line(e: BaseException) -> str:
    """The first line of an error's message (obstore's run to many lines)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


_RETRIES = re.compile(r"after (\d+) retries")
_STATUS = re.compile(r"status code: (\d{3})(?: ([^:\n]*))?")
_CODE = re.compile(r"<Code>([^<]+)</Code>")
# What hyper/reqwest say (in obstore's debug text) of a connection cut short.
_DROPPED = re.compile(
    "IncompleteMessage|IncompleteBody|UnexpectedEof|ConnectionReset|"
    "ConnectionAborted|BrokenPipe|body error|error sending request"
)


def read_error(error, url, storage_options, ranges, elapsed_s):
    """The `ObjectStoreError` of range reads `[(start, end)]` that failed for good."""
    text = str(error)
    # "Error performing GET <url> in 37ms, after 2 retries, ...  - <what>"
    what = first_line(error).split("  - ", 1)[-1].strip()
    status, code = _STATUS.search(text), _CODE.search(text)
    if status:
        cause = f"HTTP {status.group(1)} {(status.group(2) or '').strip()}".strip()
        cause += f" ({code.group(1)})" if code else ""
    elif "TimedOut" in text or "kind: Timeout" in text:
        cause = f"timed out ({what})"
    else:
        cause = f"connection dropped ({what})" if _DROPPED.search(text) else what
    retry = _store.retry_config(storage_options)
    limit, timeout = retry["max_retries"], retry["retry_timeout"]
    n = int(retries.group(1)) + 1 if (retries := _RETRIES.search(text)) else None
    said = f"{n} attempts" if n is not None else f"up to {limit + 1} attempts"
    if n is None:
        said += " (obstore did not say how many)"
    lo, hi = min(a for a, _ in ranges), max(b for _, b in ranges)
    where = f"bytes {lo}-{hi - 1}" + (f" ({len(ranges)} ranges)" * (len(ranges) > 1))
    message = (
        f"{url}: range read of {where} failed after {said} in {elapsed_s:.1f} s: "
        f"{cause}. Retries allow {limit} retries within {timeout}; if the "
        "store is throttling or slow, raise storage_options['retry_config'] "
        "(max_retries, retry_timeout) or ['client_options'] (timeout)."
    )
    status = int(status.group(1)) if status else None
    return errors.ObjectStoreError(
        message, url=url, byte_range=(lo, hi), status=status, cause=cause, attempts=n
    )


def store_error(e: Exception, url: str, storage_options, what: str = "read"):
    """The error to raise for obstore's `e` at a `what` (read: a HEAD; upload, ...)."""
    from obstore import exceptions as ox

    if not isinstance(e, (ox.BaseError, OSError)):
        return e
    write, text = what != "read", str(e)
    status = int(m.group(1)) if (m := _STATUS.search(text)) else None
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
        return _missing(url, storage_options, e, what)
    if write:
        return OSError(f"{url}: {what} failed: {first_line(e)}")
    if isinstance(e, ox.GenericError) and "169.254.169.254" in text:
        return PermissionError(  # the last credential source: a cloud VM's
            f"{url}: no credentials found: none in storage_options, the AWS_* "
            "environment or ~/.aws profiles, and the instance metadata service "
            f"gave none ({first_line(e)}). Pass storage_options={{'anon': True}} "
            "for a public bucket, or credentials (storage_options={'profile': "
            "NAME}, AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)."
        )
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


def _missing(url: str, storage_options, error: BaseException, what: str):
    """The `FileNotFoundError` of a 404: no bucket, or the keys beside (a LIST)."""
    import obstore

    root, key = _store.split_url(url)
    scheme, _, bucket = root.partition("://")
    if scheme.lower() in ("http", "https"):
        return FileNotFoundError(f"{url}: no such object (HTTP 404); check the URL")
    folder = key.rpartition("/")[0]
    try:
        store = _store.store_for(url, storage_options)
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
