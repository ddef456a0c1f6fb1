"""A source's arguments, checked, and the values they build.

`build` turns `AnnDataSource(...)`'s arguments into the three values a
source holds: its `FileSet` (every file opened once, checked and closed),
its `BlockTable` and its `SourceOptions` (how it reads). A view of the
source holds the same files and options and another table.

Design notes: docs/reference/design.md#source-options.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from grain_cells._util import arguments
from grain_cells.io import (
    JOINS,
    OBS_MISSING,
    FileSet,
    OpenFiles,
    check_max_open,
    matrix_element,
    resolve_paths,
)
from grain_cells.source import _chunk_cache, _chunk_grid
from grain_cells.source._table import BlockTable


@dataclasses.dataclass(frozen=True)
class SourceOptions:
    """How a source reads its files, beyond what its `FileSet` records.

    Attributes:
        layer: The matrix asked for: None (`X`), `"raw"` or a layer's name.
        obs_missing: What files lacking an obs column give: `"error"`, `"fill"`.
        check_indices: Check at every read that column indices are in range.
        read_threads: Read (and decode) threads per process: a count (0
            reads inline) or `"auto"` (`grain_cells._util.cores`).
        fetch_blocks: Blocks per fetch when a loader is given no
            `fetch_factor` (compressed defaults); None: fetch factor 16.
        max_open_files: Files each process keeps open at once, or `"auto"`
            (`grain_cells.io._file_lru.default_max_open`).
    """

    layer: str | None
    obs_missing: str
    check_indices: bool
    read_threads: int | str
    fetch_blocks: int | None = None
    max_open_files: int | str = "auto"


def build(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    block_size: int | None = None,
    layer: str | None = None,
    obs_columns: Sequence[str] = (),
    genes: Sequence[str] | np.ndarray | None = None,
    join: str = "exact",
    genes_from: str | None = None,
    obs_missing: str = "error",
    check_indices: bool = True,
    read_threads: int | str = "auto",
    storage_options: dict | None = None,
    max_open_files: int | str = "auto",
) -> tuple[FileSet, BlockTable, SourceOptions]:
    """Checks `AnnDataSource`'s arguments and inspects its files.

    Arguments and errors as in `AnnDataSource`.

    Returns:
        `(files, table, options)`: the file set, its blocks (the grid of
        `block_size` cells, or the defaults of the design notes) and the
        read options.
    """
    if block_size is not None:
        block_size = arguments.check_int("block_size", block_size, minimum=1)
    if not isinstance(read_threads, str):
        read_threads = arguments.check_int("read_threads", read_threads, minimum=0)
    elif read_threads != "auto":
        raise ValueError(
            "read_threads must be a non-negative int or 'auto', got "
            f"read_threads={read_threads!r}"
        )
    max_open_files = check_max_open(max_open_files)
    genes = arguments.check_genes(genes)
    paths = _check_paths(arguments.paths_of(paths))  # a backed AnnData: its file
    layer = arguments.check_name("layer", layer, optional=True)
    genes_from = arguments.check_name("genes_from", genes_from, optional=True)
    check_indices = arguments.check_bool("check_indices", check_indices)
    storage_options = arguments.check_mapping("storage_options", storage_options)
    if join not in JOINS:
        raise ValueError(f"join must be one of {list(JOINS)}, got join={join!r}")
    if obs_missing not in OBS_MISSING:
        raise ValueError(
            f"obs_missing must be one of {list(OBS_MISSING)}, got "
            f"obs_missing={obs_missing!r}"
        )
    resolved = resolve_paths(paths)
    element = matrix_element(layer)
    obs_names = arguments.check_names("obs_columns", obs_columns)
    if len(set(obs_names)) != len(obs_names):
        raise ValueError(f"obs_columns has duplicates: {list(obs_columns)}")
    files = FileSet.inspect(
        resolved,
        element=element,
        obs_names=obs_names,
        genes=genes,
        join=join,
        obs_missing=obs_missing,
        storage_options=storage_options,
        genes_from=genes_from,
    )
    options = SourceOptions(
        layer,
        obs_missing,
        bool(check_indices),
        read_threads,
        max_open_files=max_open_files,
    )
    if block_size is not None:
        return files, BlockTable.grid(files.n_obs, block_size), options
    return (files, *default_blocks(files, options))


def _check_paths(paths):
    """`paths`: a path or a non-empty sequence of paths (str or PathLike).

    Raises:
        arguments.ArgumentTypeError: `paths` (or one of them) is not a path.
        ValueError: `paths` is empty.
    """
    if isinstance(paths, (str, os.PathLike)):
        return paths
    if not isinstance(paths, Sequence):
        try:
            paths = list(paths)  # an array or another iterable of paths
        except TypeError:
            raise arguments.ArgumentTypeError(
                "paths must be a path (str or os.PathLike) or a list of paths, "
                f"got paths={paths!r} ({type(paths).__name__})"
            ) from None
    if len(paths) == 0:
        raise ValueError(
            "paths is empty: expected one or more .h5ad files or zarr stores, "
            f"got paths={paths!r}"
        )
    bad = [p for p in paths if not isinstance(p, (str, os.PathLike))]
    if bad:
        raise arguments.ArgumentTypeError(
            f"paths must hold paths (str or os.PathLike), got {bad[0]!r} "
            f"({type(bad[0]).__name__}) in paths"
        )
    return paths


def default_blocks(
    files: FileSet, options: SourceOptions
) -> tuple[BlockTable, SourceOptions]:
    """The table and options of a source built without a `block_size`.

    Opens nothing for uncompressed files; opens compressed ones once more to
    find their chunk starts (scanning a CSR matrix's `indptr`) unless the
    user's cache holds them (`_chunk_cache`).
    """
    sizes = [info.chunk_bytes for info in files.infos]
    if all(size is None for size in sizes):
        return BlockTable.grid(files.n_obs, 16), options
    offsets = np.concatenate([[0], np.cumsum(files.n_obs)])
    # Only the matrix is scanned: an open that reads no obs column.
    handles = OpenFiles(
        dataclasses.replace(files, obs_names=(), obs={}), 0, options.max_open_files
    )
    try:
        starts = [
            file_chunk_starts(files, handles, i) + offsets[i]
            if size is not None
            else offsets[i : i + 1]
            for i, size in enumerate(sizes)
        ]
    finally:
        handles.close()
    compressed = [i for i, size in enumerate(sizes) if size is not None]
    chosen = _chunk_grid.compressed_defaults(
        sum(files.n_obs[i] for i in compressed),
        np.concatenate([starts[i] for i in compressed]),
        max(sizes[i] for i in compressed),
    )
    grid = BlockTable.grid(files.n_obs, chosen.block_size)
    table = _chunk_grid.chunk_aligned_blocks(
        grid, np.unique(np.concatenate(starts)), chosen.chunks_per_block
    )
    options = dataclasses.replace(options, fetch_blocks=chosen.fetch_blocks)
    return table, options


def file_chunk_starts(files: FileSet, handles: OpenFiles, i: int) -> np.ndarray:
    """Local rows where file `i`'s matrix chunks begin, cached per file."""
    return _chunk_cache.cached_chunk_starts(
        files.identities[i],
        int(files.n_obs[i]),
        lambda: _scan_chunk_starts(handles, i),
    )


def _scan_chunk_starts(handles: OpenFiles, i: int) -> np.ndarray:
    with handles.pinned([i]) as (f,):  # not evicted while it is scanned
        return f.reader.chunk_starts()


__all__ = ["SourceOptions", "build", "default_blocks", "file_chunk_starts"]
