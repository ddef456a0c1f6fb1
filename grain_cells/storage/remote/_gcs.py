"""Requester-pays GCS buckets: the project billed for each request (`user_project`).

Design notes: docs/reference/design.md#storage-remote-gcs.
"""

from __future__ import annotations

from grain_cells.storage.remote._retries import first_line


def bill_project(root: str, project, client_options: dict) -> None:
    """Sends `x-goog-user-project: project` with every request to a GCS bucket."""
    if root.split("://", 1)[0].lower() not in ("gs", "gcs"):
        raise ValueError(
            f"{root}: storage_options['user_project'] names the Google Cloud "
            "project billed for a requester-pays GCS bucket, which only gs:// "
            "URLs use (for S3 requester-pays buckets pass request_payer=True)"
        )
    if (
        not isinstance(project, str)
        or not project.strip()
        or any(c in project for c in "\r\n")
    ):
        raise ValueError(
            f"{root}: storage_options['user_project'] must be a Google Cloud "
            f"project ID such as 'my-billing-project', got {project!r}"
        )
    headers = dict(client_options.get("default_headers") or {})
    headers["x-goog-user-project"] = project.strip()
    client_options["default_headers"] = headers


def unbilled_error(url: str, storage_options: dict | None, error):
    """The error of a requester-pays bucket's 400 to an unbilled request, or None."""
    scheme = url.split("://", 1)[0].lower()
    if scheme not in ("gs", "gcs") or "user_project" in (storage_options or {}):
        return None
    if "400 Bad Request" not in str(error) and "UserProjectMissing" not in str(error):
        return None
    return PermissionError(
        f"{url}: the bucket answered 400 Bad Request ({first_line(error)}), "
        "which is how a GCS requester-pays bucket refuses requests that name "
        "no project to bill. Pass the Google Cloud project to bill: "
        "storage_options={'user_project': 'my-billing-project'} (the "
        "credentials need serviceusage.services.use on it)."
    )
