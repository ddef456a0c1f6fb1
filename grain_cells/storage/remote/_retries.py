"""Retries, timeouts and the named error of object-store range reads.

Design notes: docs/reference/design.md#storage-remote-retries.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Mapping
from typing import Any

from grain_cells.errors import ObjectStoreError

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

# Keys of `storage_options` this module owns (the rest is the store's config).
POLICY_KEYS = ("retry_config", "client_options")


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


# obstore's ClientConfig keys that its stores also read from the environment
# (`AWS_ALLOW_HTTP`, ...). Passing `client_options` replaces what obstore took
# from there, so they are read here and kept (below explicit options).
_ENV_CLIENT_KEYS = re.compile(
    "ALLOW_HTTP|ALLOW_INVALID_CERTIFICATES|CONNECT_TIMEOUT|POOL_IDLE_TIMEOUT|"
    "POOL_MAX_IDLE_PER_HOST|PROXY_URL|PROXY_CA_CERTIFICATE|PROXY_EXCLUDES|"
    "TIMEOUT|USER_AGENT"
)


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


def describe(error: BaseException) -> tuple[int | None, str, int | None]:
    """`(HTTP status, one-line cause, retries)` of an obstore error (None: unsaid)."""
    text = str(error)
    # "Error performing GET <url> in 37ms, after 2 retries, ...  - <what>"
    what = first_line(error).split("  - ", 1)[-1].strip()
    retries = _RETRIES.search(text)
    status = _STATUS.search(text)
    code = _CODE.search(text)
    if status:
        cause = f"HTTP {status.group(1)} {(status.group(2) or '').strip()}".strip()
        if code:
            cause += f" ({code.group(1)})"
    elif "TimedOut" in text or "kind: Timeout" in text:
        cause = f"timed out ({what})"
    elif _DROPPED.search(text):
        cause = f"connection dropped ({what})"
    else:
        cause = what
    n = int(retries.group(1)) if retries else None
    return (int(status.group(1)) if status else None), cause, n


def named_error(
    error, url: str, storage_options, ranges, elapsed_s
) -> ObjectStoreError:
    """The `ObjectStoreError` of range reads `[(start, end)]` that failed for good."""
    status, cause, retries = describe(error)
    retry = retry_config(storage_options)
    limit, timeout = retry["max_retries"], retry["retry_timeout"]
    n = retries + 1 if retries is not None else None
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
    return ObjectStoreError(
        message, url=url, byte_range=(lo, hi), status=status, cause=cause, attempts=n
    )
