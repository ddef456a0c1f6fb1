"""What `preshuffle` writes: validated arguments, inputs, output layout, matrices.

Each `Matrix` reads through a `FileSet` (genes aligned, reads identity-checked).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import warnings

import numpy as np

from grain_cells import errors
from grain_cells._util import arguments
from grain_cells.io import (
    FileSet,
    OpenFiles,
    RowBuffer,
    element_files,
    fetch_ranges,
    file_entries,
    matrix_element,
    open_file,
    resolve_paths,
    source_identity,
)
from grain_cells.io import obs_columns as file_obs_columns
from grain_cells.preshuffle import _carry
from grain_cells.source import AnnDataSource
from grain_cells.storage.remote import is_url

CHUNK_BYTES = 4 << 20  # default chunk of data/indices, uncompressed
CHUNK_BYTES_COMPRESSED = 256 << 10  # same, compressed
ZARR_CHUNK_CELLS = {3: 32, 2: 256}  # zarr's default cells per chunk, per format
ZARR_MIN_CHUNK_BYTES = {3: 64 << 10, 2: 1 << 20}  # and its floor
MAX_CHUNK_BYTES = (1 << 31) - 1  # HDF5 caps a chunk below 4 GiB; stay well under
_ALIGNED_PASS_VALUES = 1 << 24  # stored values per read when counting aligned rows
_INDPTR_STEP = 1 << 22  # indptr entries per read when counting rows

# Bump when the output of identical arguments changes. 3: layers, raw, obsm,
# varm, varp and uns are carried (`keep`); cells may be grouped (`group_by`).
FORMAT = 3
FORMATS = {"h5ad": None, "zarr": 3, "zarr-v2": 2}
"""`preshuffle`'s `format`: the zarr format written (None: HDF5, `.h5ad`)."""
COMPRESSIONS = (None, "gzip", "lzf")
ZARR_COMPRESSIONS = (None, "gzip", "zstd")
# Arguments recorded in the fingerprint as given (after validation).
_FINGERPRINTED = ("layer", "join", "genes", "obs_columns", "seed", "cells_per_file")
_FINGERPRINTED += ("compression", "chunk_cells", "group_by")


class Plan:
    """`preshuffle`'s arguments validated (`args`), the inputs' metadata, the parts.

    Raises what `preshuffle` documents for its arguments and inputs.
    """

    def __init__(self, inputs, output_dir, args: dict):
        args = dict(args)
        try:
            paths = resolve_paths(inputs)
        except ValueError:
            raise ValueError(
                "inputs is empty: expected one or more .h5ad files"
            ) from None
        self.output_dir = output_dir = pathlib.Path(output_dir)
        if output_dir.exists() and not output_dir.is_dir():
            raise NotADirectoryError(
                f"{output_dir}: exists and is not a folder; output_dir must be a "
                "folder (it is created if missing)"
            )
        for name in ("cells_per_file", "seed", "chunk_cells", "memory_budget_bytes"):
            if args[name] is not None or name in ("seed", "memory_budget_bytes"):
                arguments.check_int(name, args[name], minimum=int(name != "seed"))
        self.format = arguments.check_choice("format", args["format"], list(FORMATS))
        self.zarr_format = FORMATS[self.format]
        allowed = COMPRESSIONS if self.zarr_format is None else ZARR_COMPRESSIONS
        if args["compression"] not in allowed:
            raise ValueError(
                f"compression must be one of {list(allowed)} for format="
                f"{self.format!r}, got compression={args['compression']!r}"
            )
        self.storage_options = dict(args["storage_options"] or {})
        # Checks every input: AnnData, aligned genes, a usable matrix.
        options = {k: args[k] for k in ("layer", "join", "genes")}
        options.update(storage_options=self.storage_options, read_threads=0)
        self.source = source = AnnDataSource(paths, block_size=1, **options)
        self.paths = list(source.paths)
        self.element = matrix_element(args["layer"])
        self.obs_columns, self.group_by = self._columns(args)
        self.n_cells = source.num_cells
        self.x = Matrix("X", source.files, source.check_indices)
        keep, aligned = args["keep"], self.x.column_map(0) is not None
        self.carry = _carry.choose(
            self.paths, self.storage_options, keep, args["layer"], aligned
        )
        self.matrices = [self.x]
        for element in list(self.carry.matrices):
            try:
                files = element_files(source.files, element)
            except _carry.CARRY_ERRORS as e:
                if keep is not None:
                    raise
                self.carry.matrices.remove(element)
                self.carry.left.append(f"{element} ({e})")
                continue
            self.matrices.append(Matrix(element, files, source.check_indices))
        if self.carry.left:
            left = "; ".join(self.carry.left)
            warnings.warn(
                f"preshuffle leaves out {left}. Pass keep=[...] to name what to carry "
                "(keep=() for X, obs and var only); this warning then goes away.",
                stacklevel=3,
            )
        self.seed = args["seed"] = int(args["seed"])
        self.compression, self.chunk_cells = args["compression"], args["chunk_cells"]
        self.budget = int(args["memory_budget_bytes"])
        size = args["cells_per_file"] or max(self.n_cells, 1)
        n_parts = max(1, -(-self.n_cells // size))
        self.part_bounds = [
            (i * size, min((i + 1) * size, self.n_cells)) for i in range(n_parts)
        ]
        suffix = ".h5ad" if self.zarr_format is None else ".zarr"
        self.part_paths = [output_dir / f"part-{i:05d}{suffix}" for i in range(n_parts)]
        for path in self.paths:
            for part in self.part_paths:  # a bucket output checks its URLs itself
                if not is_url(path) and part.exists() and os.path.samefile(path, part):
                    raise ValueError(
                        f"{path}: is an input and also output part {part.name} of "
                        f"{output_dir}; write the parts to another folder"
                    )
        args.update(join=source.join, genes=source_identity(source)["genes"])
        args.update(obs_columns=self.obs_columns, group_by=self.group_by)
        fingerprint = {
            "format": FORMAT,
            # By content, not path or mtime: an input changed with its mtime
            # restored is redone; a copy of the inputs elsewhere is not.
            "inputs": file_entries(source),
            **{name: args[name] for name in _FINGERPRINTED},
            "carry": {k: v for k, v in vars(self.carry).items() if k != "left"},
            # Only when not h5ad: h5ad parts of earlier versions stay valid.
            **({} if self.zarr_format is None else {"output": self.format}),
        }
        self.fingerprint = json.loads(json.dumps(fingerprint))  # JSON-normal

    def _columns(self, args: dict) -> tuple[list[str], list[str] | None]:
        """`(obs_columns, group_by)` as lists, checked against every input's obs."""
        obs_columns, given = args["obs_columns"], args["group_by"]
        have = {}
        for path in self.paths:
            with open_file(path, self.storage_options) as f:
                have[path] = file_obs_columns(f)
        obs_columns = have[self.paths[0]] if obs_columns is None else obs_columns
        obs_columns = [obs_columns] if isinstance(obs_columns, str) else obs_columns
        obs_columns = [str(c) for c in obs_columns]
        group_by = [given] if isinstance(given, str) else given
        if group_by is not None:
            if (
                not isinstance(group_by, (list, tuple))
                or not group_by
                or not all(isinstance(c, str) for c in group_by)
            ):
                raise TypeError(
                    "group_by must be an obs column name (a str), a list of them, "
                    f"or None, got {type(given).__name__} {given!r}"
                )
            group_by = list(group_by)
        fix = ". Pass obs_columns=[...] naming columns every input has."
        for name, columns in (("obs_columns", obs_columns), ("group_by", group_by)):
            if columns is not None and len(set(columns)) != len(columns):
                raise ValueError(f"{name} has duplicates: {columns}")
            for path in self.paths if columns is not None else ():
                missing = [c for c in columns if c not in have[path]]
                if missing:
                    said = missing if name == "obs_columns" else f"group_by={missing}"
                    raise errors.MissingColumnError(
                        f"{path}: obs has no column(s) {said}; it has {have[path]}"
                        + (fix if name == "obs_columns" else "")
                    )
        return obs_columns, group_by


class Matrix:
    """One row-aligned element of the inputs (`name` in the part); `lengths`: CSR's."""

    def __init__(self, name: str, files: FileSet, check_indices: bool = True):
        self.name, self.files, self.check_indices = name, files, check_indices
        self.sparse = files.sparse
        self.dtype = np.dtype(files.dtype)
        self.n_vars = files.num_genes
        self.index_dtype = np.dtype(np.int32 if self.n_vars < 2**31 else np.int64)
        self.nnz = sum(files.records.column("nnz")) if self.sparse else None
        self.n_cells = int(files.n_obs.sum())
        self.cell_offsets = np.concatenate([[0], np.cumsum(files.n_obs)])
        maps = [self.column_map(i) for i in range(len(files.paths))]
        self.reorders_genes = any(
            m is not None and (np.diff(m[m >= 0]) < 0).any() for m in maps
        )
        self.lengths: np.ndarray | None = None  # values per output row (`count_rows`)
        self.buffer, self._handles = RowBuffer(), None

    def column_map(self, i: int) -> np.ndarray | None:
        """Output column of each column file `i` stores (-1: not output), or None."""
        column_map = self.files.genes.maps[i]
        return None if column_map is None else column_map.out

    @property
    def value_bytes(self) -> int:
        """Bytes of one stored value of a CSR matrix (data plus index)."""
        return self.dtype.itemsize + self.index_dtype.itemsize

    def fetch_ranges(self, starts, stops):
        """Reads sorted global row ranges of one file into this matrix's buffer."""
        if self._handles is None:
            self._handles = OpenFiles(self.files, 0)
        where = (self._handles, self.cell_offsets, starts, stops, self.buffer)
        return fetch_ranges(*where, check_indices=self.check_indices)

    def close(self) -> None:
        """Closes the inputs' handles (they reopen on the next read)."""
        if self._handles is not None:
            self._handles.close()
            self._handles = None

    def chunk(self, plan: Plan, size: int) -> int:
        """Elements per chunk of `data`/`indices` (CSR) or rows (dense), <= `size`.

        `chunk_cells` cells, else HDF5's bytes or zarr's cells (with a floor in bytes).
        """
        compression, chunk_cells = plan.compression, plan.chunk_cells
        unit = max(self.dtype.itemsize * (1 if self.sparse else self.n_vars), 1)
        fmt = plan.zarr_format
        if chunk_cells is None and fmt is None:
            n = (CHUNK_BYTES if compression is None else CHUNK_BYTES_COMPRESSED) // unit
        else:
            cells = chunk_cells or ZARR_CHUNK_CELLS[fmt]
            per_cell = max(self.nnz / max(self.n_cells, 1), 1.0) if self.sparse else 1
            n = math.ceil(cells * per_cell)
            if chunk_cells is None:
                n = max(n, -(-ZARR_MIN_CHUNK_BYTES[fmt] // unit))
        most = MAX_CHUNK_BYTES // 8 if self.sparse else MAX_CHUNK_BYTES // unit
        return max(1, min(max(n, 1), max(most, 1), int(size)))

    def count_rows(self) -> None:
        """Sets `lengths` (int32) from each `indptr`, or aligned rows if genes drop."""
        if not self.sparse or self.lengths is not None:
            return
        out = np.empty(self.n_cells, np.int32)
        offsets = self.cell_offsets
        for i, info in enumerate(self.files.infos):
            column_map = self.column_map(i)
            start, n = int(offsets[i]), int(offsets[i + 1] - offsets[i])
            if column_map is not None and (column_map < 0).any():
                per_cell = max(self.nnz // max(self.n_cells, 1), 1)
                cells = max(1, _ALIGNED_PASS_VALUES // per_cell)
                for a in range(0, n, cells):
                    b = min(a + cells, n)
                    got = self.fetch_ranges([start + a], [start + b])
                    out[start + a : start + b] = np.diff(got.csr.indptr)
                continue
            identity = self.files.identities[i]
            with open_file(identity.path, self.files.storage_options) as f:
                ptr = f[info.element]["indptr"]
                for a in range(0, n, _INDPTR_STEP):
                    b = min(a + _INDPTR_STEP, n)
                    piece = ptr[a : b + 1].astype(np.int64)
                    out[start + a : start + b] = np.diff(piece)
        self.lengths = out
