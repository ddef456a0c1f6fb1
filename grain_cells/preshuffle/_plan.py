"""What `preshuffle` writes: validated arguments, inputs and output layout."""

from __future__ import annotations

import json
import os
import pathlib
import warnings

import numpy as np

from grain_cells import errors
from grain_cells._util import arguments
from grain_cells.io import (
    element_files,
    file_entries,
    matrix_element,
    open_file,
    resolve_paths,
    source_identity,
)
from grain_cells.io import obs_columns as file_obs_columns
from grain_cells.preshuffle import _carry
from grain_cells.preshuffle._matrices import Matrix
from grain_cells.source import AnnDataSource
from grain_cells.storage.remote import is_url

# Bump when the output of identical arguments changes. 3: layers, raw, obsm,
# varm, varp and uns are carried (`keep`); cells may be grouped (`group_by`).
FORMAT = 3
COMPRESSIONS = (None, "gzip", "lzf")
FORMATS = {"h5ad": None, "zarr": 3, "zarr-v2": 2}
"""`preshuffle`'s `format`: the zarr format written (None: HDF5, `.h5ad`)."""
ZARR_COMPRESSIONS = (None, "gzip", "zstd")
_CARRY_ERRORS = (
    errors.GeneMismatchError,
    errors.AnnDataFormatError,
    errors.UnsupportedLayoutError,
)


class Plan:
    """Validated arguments, the inputs' metadata and the output layout."""

    @classmethod
    def make(cls, inputs, output_dir, **kwargs) -> Plan:
        """Validates `preshuffle`'s arguments and inspects the inputs."""
        self = cls()
        try:
            paths = resolve_paths(inputs)
        except ValueError:
            raise ValueError(
                "inputs is empty: expected one or more .h5ad files"
            ) from None
        output_dir = pathlib.Path(output_dir)
        if output_dir.exists() and not output_dir.is_dir():
            raise NotADirectoryError(
                f"{output_dir}: exists and is not a folder; output_dir must be a "
                "folder (it is created if missing)"
            )
        cells_per_file = kwargs["cells_per_file"]
        if cells_per_file is not None:
            arguments.check_int("cells_per_file", cells_per_file, minimum=1)
        arguments.check_int("seed", kwargs["seed"], minimum=0)
        chunk_cells = kwargs["chunk_cells"]
        if chunk_cells is not None:
            arguments.check_int("chunk_cells", chunk_cells, minimum=1)
        budget = kwargs["memory_budget_bytes"]
        arguments.check_int("memory_budget_bytes", budget, minimum=1)
        output_format = kwargs.get("format", "h5ad")
        if not isinstance(output_format, str) or output_format not in FORMATS:
            raise ValueError(
                f"format must be one of {list(FORMATS)}, got format={output_format!r}"
            )
        self.format = output_format
        self.zarr_format = FORMATS[output_format]
        compression = kwargs["compression"]
        allowed = COMPRESSIONS if self.zarr_format is None else ZARR_COMPRESSIONS
        if compression not in allowed:
            raise ValueError(
                f"compression must be one of {list(allowed)} for format="
                f"{output_format!r}, got compression={compression!r}"
            )
        layer = kwargs["layer"]
        obs_columns = kwargs["obs_columns"]
        if isinstance(obs_columns, str):
            obs_columns = [obs_columns]

        join = kwargs["join"]
        genes = kwargs["genes"]
        self.storage_options = dict(kwargs.get("storage_options") or {})
        # Checks every input: AnnData, aligned genes, a usable matrix; takes
        # each input's identity (grain_cells.io._identity).
        self.source = AnnDataSource(
            paths,
            block_size=1,
            layer=layer,
            join=join,
            genes=genes,
            read_threads=0,
            storage_options=self.storage_options,
        )
        self.paths = list(self.source.paths)
        self.element = matrix_element(layer)
        have = {}
        for path in self.paths:
            with open_file(path, self.storage_options) as f:
                have[path] = file_obs_columns(f)
        if obs_columns is None:
            obs_columns = have[self.paths[0]]
        obs_columns = [str(c) for c in obs_columns]
        if len(set(obs_columns)) != len(obs_columns):
            raise ValueError(f"obs_columns has duplicates: {obs_columns}")
        for path in self.paths:
            missing = [c for c in obs_columns if c not in have[path]]
            if missing:
                raise errors.MissingColumnError(
                    f"{path}: obs has no column(s) {missing}; it has {have[path]}. "
                    "Pass obs_columns=[...] naming columns every input has."
                )
        self.obs_columns = obs_columns
        group_by = kwargs.get("group_by")
        if group_by is not None:
            group_by = [group_by] if isinstance(group_by, str) else group_by
            if (
                not isinstance(group_by, (list, tuple))
                or not group_by
                or not all(isinstance(c, str) for c in group_by)
            ):
                raise TypeError(
                    "group_by must be an obs column name (a str), a list of them, "
                    f"or None, got {type(kwargs['group_by']).__name__} "
                    f"{kwargs['group_by']!r}"
                )
            group_by = list(group_by)
            if len(set(group_by)) != len(group_by):
                raise ValueError(f"group_by has duplicates: {group_by}")
            for path in self.paths:
                missing = [c for c in group_by if c not in have[path]]
                if missing:
                    raise errors.MissingColumnError(
                        f"{path}: obs has no column(s) group_by={missing}; it has "
                        f"{have[path]}"
                    )
        self.group_by = group_by

        self.output_dir = output_dir
        self.n_cells = self.source.num_cells
        self.n_vars = len(self.source.var_names)
        self.sparse = self.source.is_sparse
        self.dtype = np.dtype(self.source.dtype)
        self.index_dtype = np.dtype(np.int32 if self.n_vars < 2**31 else np.int64)
        self.nnz = (
            sum(self.source.file_info(i).nnz for i in range(len(self.paths)))
            if self.sparse
            else None
        )
        # Gene alignment: files whose stored columns are not the output's.
        maps = [self.source.file_column_map(i) for i in range(len(self.paths))]
        self.column_map_first = maps[0]
        self.x = Matrix("X", self.source.files, self.source.check_indices)
        self.carry = _carry.choose(
            self.paths,
            self.storage_options,
            keep=kwargs.get("keep"),
            layer=layer,
            genes_changed=maps[0] is not None,
        )
        self.matrices = [self.x]
        for element in list(self.carry.matrices):
            try:
                files = element_files(self.source.files, element)
            except _CARRY_ERRORS as e:
                if kwargs.get("keep") is not None:
                    raise
                self.carry.matrices.remove(element)
                self.carry.left.append(f"{element} ({e})")
                continue
            self.matrices.append(Matrix(element, files, self.source.check_indices))
        if self.carry.left:
            warnings.warn(
                "preshuffle leaves out "
                + "; ".join(self.carry.left)
                + ". Pass keep=[...] to name what to carry (keep=() for X, obs "
                "and var only); this warning then goes away.",
                UserWarning,
                stacklevel=4,
            )
        self.seed = int(kwargs["seed"])
        self.compression = compression
        self.chunk_cells = chunk_cells
        self.budget = int(budget)
        size = cells_per_file or max(self.n_cells, 1)
        n_parts = max(1, -(-self.n_cells // size))
        self.part_bounds = [
            (i * size, min((i + 1) * size, self.n_cells)) for i in range(n_parts)
        ]
        suffix = ".h5ad" if self.zarr_format is None else ".zarr"
        self.part_paths = [output_dir / f"part-{i:05d}{suffix}" for i in range(n_parts)]
        for path in self.paths:
            for part in self.part_paths:
                if is_url(path):
                    continue  # a bucket output checks its URLs itself
                if part.exists() and os.path.samefile(path, part):
                    raise ValueError(
                        f"{path}: is an input and also output part {part.name} of "
                        f"{output_dir}; write the parts to another folder"
                    )
        fingerprint = {
            "format": FORMAT,
            # By content, not path or mtime: an input changed with its
            # mtime restored (cp -p, rsync -t) is redone; a copy of the
            # inputs in another folder is not.
            "inputs": file_entries(self.source),
            "layer": layer,
            "join": self.source.join,
            "genes": source_identity(self.source)["genes"],
            "obs_columns": obs_columns,
            "seed": self.seed,
            "cells_per_file": cells_per_file,
            "compression": compression,
            "chunk_cells": chunk_cells,
            "group_by": group_by,
            "carry": self.carry.describe(),
            # Only when not h5ad: h5ad parts of earlier versions stay valid.
            **({} if self.zarr_format is None else {"output": output_format}),
        }
        self.fingerprint = json.loads(json.dumps(fingerprint))  # JSON-normal
        return self
