"""Pre-shuffled copies of `.h5ad` files, written once, read as plain AnnData.

Contiguous blocks of a shuffled copy are random samples, so a loader can read
large blocks at the diversity of random sampling. Algorithm, memory bound and
layout: docs/reference/design.md#preshuffle-preshuffle; a bucket output is staged
in `grain-cells-preshuffle-<pid>-<start>-<random>` (#preshuffle-staging).
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence

import numpy as np
import tqdm

from grain_cells._util.pids import gone, start_time
from grain_cells.preshuffle import _files
from grain_cells.preshuffle._files import MANIFEST, MARKER_ATTR
from grain_cells.preshuffle._plan import Plan
from grain_cells.storage.remote import (
    delete,
    head,
    is_url,
    join,
    list_names,
    part_names,
    put_bytes,
    put_file,
    split_url,
)

__all__ = ["MANIFEST", "MARKER_ATTR", "preshuffle"]

PREFIX = "grain-cells-preshuffle-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-\w+")
PROGRESS_EVERY_S = 0.5


def preshuffle(
    inputs: str | os.PathLike | Sequence[str | os.PathLike],
    output_dir: str | os.PathLike,
    *,
    cells_per_file: int | None = None,
    seed: int = 0,
    layer: str | None = None,
    obs_columns: Sequence[str] | None = None,
    compression: str | None = None,
    chunk_cells: int | None = None,
    memory_budget_bytes: int = 2 << 30,
    progress: bool = True,
    join: str = "exact",
    genes: Sequence[str] | np.ndarray | None = None,
    storage_options: dict | None = None,
    output_storage_options: dict | None = None,
    staging_dir: str | os.PathLike | None = None,
    group_by: str | Sequence[str] | None = None,
    keep: Sequence[str] | None = None,
    format: str = "h5ad",
) -> list[pathlib.Path] | list[str]:
    """Writes the cells of `inputs` in a seeded random order as new `.h5ad` files.

    The inputs are concatenated and shuffled together into `part-00000.h5ad`,
    ... in `output_dir`; a rerun keeps the parts already complete. A part holds
    `X` (CSR or dense as stored), `obs` (categories merged over the inputs),
    `var` (the first input's; `raw/var` for `layer="raw"`) and what `keep`
    carries: `layers`, `raw`, `obsm` in the part's row order; `uns`, `varm`,
    `varp` from the first input; never `obsp`.

    Example:
        >>> parts = preshuffle(["plate1.h5ad", "plate2.h5ad"], "/data/shuffled",
        ...                    cells_per_file=1_000_000, seed=0)
        >>> source = grain_cells.AnnDataSource(parts, block_size=256,
        ...                                    obs_columns=["cell_line"])
        >>> anndata.read_h5ad(parts[0], backed="r")  # plain AnnData

    Args:
        inputs: One `.h5ad` path or URL or a sequence of them, concatenated
            in order.
        output_dir: Folder for the parts (created if missing), or the URL
            of a prefix in an existing bucket (each part is staged locally,
            then uploaded).
        cells_per_file: Cells per part (the last holds the rest); None: one.
        seed: Seed of the permutation (an int >= 0; same seed, same order).
        layer: Matrix copied as `X`: None for `X`, `"raw"` for `raw/X`, any
            other name for `layers/<name>`.
        obs_columns: obs columns to carry; None: every column of the first
            input (the others must have them too).
        compression: None (default: positional reads), `"gzip"` (level 1,
            shuffled) or `"lzf"`; for zarr None, `"zstd"` or `"gzip"`.
        chunk_cells: Cells per chunk of the output matrix. None: about 4 MiB
            of values per HDF5 chunk (256 KiB compressed); for zarr, 32 cells
            and at least 64 KiB (v2: 256 cells, 1 MiB).
        memory_budget_bytes: Bytes of matrix values held at once (two
            windows and the read buffer; a window holds at least one cell).
        progress: Show a progress bar (tqdm, on stderr) of the cells written.
        join: As in `AnnDataSource`.
        genes: As in `AnnDataSource`.
        storage_options: As in `AnnDataSource` (for URL inputs).
        output_storage_options: The `storage_options` of a URL `output_dir`
            (None: `storage_options`).
        staging_dir: For a URL `output_dir`: a local folder with room for
            one part (default `TMPDIR`).
        group_by: An obs column every input has, or a list of them: each
            label's cells (a combination's, the first column outermost;
            category order, a missing label last) are written contiguously,
            shuffled within, so blocks are pure (for class-balanced or
            condition sampling) rather than random samples.
        keep: Elements to carry besides X, obs and var: None carries every
            one that fits and warns naming those it leaves; or a list of
            `"layers"`, `"layers/<name>"`, `"raw"`, `"obsm"`, `"obsm/<name>"`,
            `"varm"`, `"varp"`, `"uns"`; `()` carries none (the quickest).
        format: `"h5ad"` (default), `"zarr"` (zarr v3, sharded matrices,
            `part-00000.zarr`) or `"zarr-v2"`; zarr parts hold the cells of
            the h5ad parts in the same order, in a local folder only.

    Returns:
        The paths of the parts, in order (URLs for a URL `output_dir`).

    Raises:
        ValueError: `inputs` is empty, an argument is out of range, an input
            would be overwritten by a part, or a zarr `format` names a URL.
        NotADirectoryError: `output_dir` exists and is not a folder.
        FileNotFoundError: An input does not exist.
        PermissionError: The credentials may not read an input or write the
            output (names the URL and the fix).
        OSError: The disk lacks room for a part (names the folder, the bytes
            needed and free), or an upload failed.
        TypeError: `group_by` or `keep` is of the wrong type.
        errors.MissingColumnError: An obs column, layer, X or an element named
            in `keep` is missing.
        errors.AnnDataFormatError: An input is not AnnData, or an obs column
            cannot be merged over the inputs; and see `AnnDataSource`.
    """
    args = dict(locals())  # every argument by name, for Plan
    bucket = None
    if is_url(os.fspath(output_dir)):
        if format != "h5ad":
            raise ValueError(
                f"format={format!r} writes to a local folder, got output_dir="
                f"{os.fspath(output_dir)!r}; write the parts locally and upload "
                "the folders (e.g. `aws s3 sync`), or use format='h5ad'"
            )
        options = output_storage_options
        bucket = BucketOutput(
            os.fspath(output_dir),
            storage_options if options is None else options,
            staging_dir,
        )
    try:
        if bucket is not None:  # one listing first: no bucket, no rights
            list_names(bucket.url, bucket.storage_options)
        plan = Plan(inputs, output_dir if bucket is None else bucket.staging, args)
        n_parts = len(plan.part_paths)
        if bucket is not None:
            bucket.check_inputs(plan)
        plan.output_dir.mkdir(parents=True, exist_ok=True)
        _files.remove_temporaries(plan.output_dir)
        marker = _files.completed_marker if bucket is None else bucket.completed_marker
        done = {i: marker(plan, i) for i in range(n_parts)}
        todo = [i for i, got in done.items() if got is None]
        bar = progress_bar(plan, todo, enabled=progress)
        try:
            if todo:
                # Imported here: the writer reads and writes obs/var through
                # anndata and pandas, which `import grain_cells` does not import.
                from grain_cells.preshuffle._writer import Writer

                writer = Writer(plan, todo)
                for i in todo:
                    done[i] = writer.write_part(i, bar)
                    if bucket is not None:
                        bucket.publish(plan, i)  # uploads while the next is written
                if bucket is not None:
                    bucket.wait()
        finally:
            bar.close()
            for closable in (plan.source, *plan.matrices):
                closable.close()
        if bucket is not None:
            bucket.remove_stale_parts(plan)
            bucket.write_manifest(plan, done)
            return [bucket.part_url(plan, i) for i in range(n_parts)]
        _files.remove_stale_parts(plan)
        _files.write_manifest(plan, done)
        return list(plan.part_paths)
    finally:
        if bucket is not None:
            bucket.close()


def progress_bar(plan: Plan, todo: list[int], enabled: bool) -> tqdm.tqdm:
    """A tqdm bar (stderr) of cells written times matrices; says what was complete."""
    cells = sum(plan.part_bounds[i][1] - plan.part_bounds[i][0] for i in todo)
    total = len(plan.matrices) * cells
    skipped = len(plan.part_paths) - len(todo)
    if enabled and skipped:
        print(
            f"preshuffle: {skipped} of {len(plan.part_paths)} part(s) already "
            f"complete in {plan.output_dir}",
            file=sys.stderr,
        )
    options = {"mininterval": PROGRESS_EVERY_S, "disable": not enabled or not total}
    options.update(file=sys.stderr, unit_scale=True)
    return tqdm.tqdm(total=total, desc="preshuffle", unit="cells", **options)


def make_staging(parent: str | os.PathLike | None) -> pathlib.Path:
    """Creates this process's staging folder under `parent` (None: `TMPDIR`)."""
    parent = pathlib.Path(tempfile.gettempdir() if parent is None else parent)
    parent.mkdir(parents=True, exist_ok=True)
    prefix = f"{PREFIX}{os.getpid()}-{start_time(os.getpid()) or 0}-"
    return pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def remove_stale_staging(parent: str | os.PathLike | None) -> list[pathlib.Path]:
    """Removes the staging folders under `parent` whose owner is dead; returns them."""
    parent = pathlib.Path(tempfile.gettempdir() if parent is None else parent)
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for path in entries:
        match = _NAME.fullmatch(path.name)
        if match is None or not path.is_dir() or path.is_symlink():
            continue
        pid, start = int(match[1]), int(match[2])
        if pid != os.getpid() and gone(pid, start or None):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class BucketOutput:
    """Parts in a bucket (`url/part-00000.h5ad`, ...), each staged, then uploaded."""

    def __init__(self, url: str, storage_options: dict | None, staging_dir=None):
        split_url(join(url, "x"))  # a bucket is named
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        remove_stale_staging(staging_dir)  # runs that died left theirs
        self.staging = make_staging(staging_dir)
        self._uploads = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="grain_cells_upload"
        )
        self._pending: concurrent.futures.Future | None = None

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
            if name not in keep and _files.is_ours(url, self.storage_options):
                delete(url, self.storage_options)

    def write_manifest(self, plan: Plan, markers: dict[int, dict]) -> None:
        """Uploads `preshuffle.json` (the parts and their statistics)."""
        text = _files.manifest_of(plan, markers)
        put_bytes(join(self.url, MANIFEST), text, self.storage_options)

    def close(self) -> None:
        """Lets a running upload end (error unraised); removes the staging folder."""
        self._pending = None
        self._uploads.shutdown(wait=True)
        shutil.rmtree(self.staging, ignore_errors=True)
