"""`preshuffle` into a bucket: each part staged on local disk, then uploaded.

Design notes: docs/reference/design.md#preshuffle-output.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil

from grain_cells.io import open_file
from grain_cells.preshuffle import _files, _staging
from grain_cells.preshuffle._plan import Plan
from grain_cells.storage.remote import (
    delete,
    head,
    join,
    list_names,
    part_names,
    put_bytes,
    put_file,
    split_url,
)


class BucketOutput:
    """Parts of `preshuffle` in a bucket (`url/part-00000.h5ad`, ...), staged."""

    def __init__(self, url: str, storage_options: dict | None, staging_dir=None):
        split_url(join(url, "x"))  # a bucket is named
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        # Runs that died left their staging folders (and a part in each).
        _staging.remove_stale(staging_dir)
        self.staging = _staging.make(staging_dir)
        self._uploads = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="grain_cells_upload"
        )
        self._pending: concurrent.futures.Future | None = None

    def check_bucket(self) -> None:
        """Lists the output prefix once, before any work (no bucket, no rights)."""
        list_names(self.url, self.storage_options)

    def part_url(self, plan: Plan, index: int) -> str:
        return join(self.url, plan.part_paths[index].name)

    def check_inputs(self, plan: Plan) -> None:
        """Raises `ValueError` if an input is one of the output URLs."""
        outputs = {self.part_url(plan, i) for i in range(len(plan.part_paths))}
        for path in set(plan.paths) & outputs:
            raise ValueError(
                f"{path}: is an input and also an output part of {self.url}; "
                "write the parts to another prefix"
            )

    def completed_marker(self, plan: Plan, index: int) -> dict | None:
        """The marker of part `index` if the bucket holds it complete, else None."""
        url = self.part_url(plan, index)
        try:
            head(url, self.storage_options)
        except FileNotFoundError:
            return None
        return _files.completed_marker(plan, index, url, self.storage_options)

    def publish(self, plan: Plan, index: int) -> None:
        """Uploads part `index` in the background; raises the previous one's error."""
        self.wait()
        self._pending = self._uploads.submit(self._upload, plan, index)

    def _upload(self, plan: Plan, index: int) -> None:
        local = plan.part_paths[index]
        try:
            put_file(self.part_url(plan, index), local, self.storage_options)
        finally:
            local.unlink(missing_ok=True)

    def wait(self) -> None:
        """Returns when no upload is running; raises the last one's error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def remove_stale_parts(self, plan: Plan) -> None:
        """Deletes parts of an earlier run into this prefix beyond this run's count."""
        keep = {p.name for p in plan.part_paths}
        for name in part_names(list_names(self.url, self.storage_options)):
            url = join(self.url, name)
            if name not in keep and self._ours(url):
                delete(url, self.storage_options)

    def _ours(self, url: str) -> bool:
        try:
            with open_file(url, self.storage_options) as f:
                return _files.MARKER_ATTR in f.attrs
        except Exception:  # not HDF5, or gone: not ours to delete
            return False

    def write_manifest(self, plan: Plan, markers: dict[int, dict]) -> None:
        """Uploads `preshuffle.json` (the parts and their statistics)."""
        text = json.dumps(_files.manifest_of(plan, markers), indent=1).encode()
        put_bytes(join(self.url, _files.MANIFEST), text, self.storage_options)

    def close(self) -> None:
        """Lets a running upload end (error unraised); removes the staging folder."""
        self._pending = None
        self._uploads.shutdown(wait=True)
        shutil.rmtree(self.staging, ignore_errors=True)
