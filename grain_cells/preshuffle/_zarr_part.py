"""One zarr part being written (`preshuffle(..., format="zarr")`).

Design notes: docs/reference/design.md#preshuffle-zarr-part.
"""

from __future__ import annotations

import json
import math
import shutil

import anndata
import numpy as np
import zarr

from grain_cells.preshuffle import _files
from grain_cells.preshuffle._plan import Matrix, Plan

CHUNK_CELLS = {3: 32, 2: 256}
"""Cells per chunk of a matrix by default, per zarr format."""
MIN_CHUNK_BYTES = {3: 64 << 10, 2: 1 << 20}
SHARD_BYTES = 32 << 20  # uncompressed bytes per shard (v3)
INDPTR_CHUNK = 1 << 16
WRITE_BYTES = 64 << 20  # uncompressed bytes per zarr write call, at most


class ZarrPart:
    """Part `index` of a plan, written into a temporary zarr store (as `H5adPart`)."""

    def __init__(self, plan: Plan, index: int, nbytes: int):
        self.plan = plan
        self.zarr_format = plan.zarr_format
        self.final = plan.part_paths[index]
        _files.check_free_space(plan.output_dir, nbytes, f"part {self.final.name}")
        self.tmp = _files.create_temporary(plan.output_dir, self.final.name, True)[1]
        self._appenders: list[_Appender] = []
        # Cells per chunk: `chunk_cells`, else the default with a floor in bytes.
        self._cells = plan.chunk_cells or CHUNK_CELLS[self.zarr_format]
        self._min_bytes = 0 if plan.chunk_cells else MIN_CHUNK_BYTES[self.zarr_format]
        self._compressors = None
        if plan.compression is not None:
            import numcodecs

            gzip = plan.compression == "gzip"
            v3 = (zarr.codecs.GzipCodec, zarr.codecs.ZstdCodec)
            codec = v3 if self.zarr_format == 3 else (numcodecs.GZip, numcodecs.Zstd)
            self._compressors = codec[0 if gzip else 1](level=1 if gzip else 0)
        try:
            store = zarr.storage.LocalStore(self.tmp)
            self.root = zarr.open_group(store, mode="w", zarr_format=self.zarr_format)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def frames_settings(self):
        """The anndata settings under which anndata writes obs, var and the rest."""
        shard = anndata.settings.auto_shard_zarr_v3
        return anndata.settings.override(auto_shard_zarr_v3=bool(shard))

    def create_csr(self, m: Matrix, n: int, nnz: int, chunk: int):
        """Matrix `m`'s CSR group: in-order writers of `data`, `indices`, `indptr`.

        `chunk` (the HDF5 writer's) is not used: see the design notes.
        """
        elements = math.ceil(self._cells * max(m.nnz / max(m.n_cells, 1), 1.0))
        elements = max(1, min(max(elements, self._min_bytes // m.dtype.itemsize), nnz))
        parent, name = _parent(self.root, m.name)
        parent.require_group(name).attrs.update(
            {
                "encoding-type": "csr_matrix",
                "encoding-version": "0.1.0",
                "shape": [int(n), int(m.n_vars)],
            }
        )
        specs = (
            ("data", m.dtype, nnz, elements),
            ("indices", m.index_dtype, nnz, elements),
            ("indptr", np.dtype(np.int64), n + 1, max(1, min(INDPTR_CHUNK, n + 1))),
        )
        return tuple(
            self._appender(f"{m.name}/{key}", (size,), dtype, (rows,), dtype.itemsize)
            for key, dtype, size, rows in specs
        )

    def create_dense(self, m: Matrix, n: int, chunk_rows: int):
        """Matrix `m` as a dense array of `n` rows (`chunk_rows`: the HDF5 writer's)."""
        row_bytes = max(m.n_vars * m.dtype.itemsize, 1)
        rows = max(1, min(max(self._cells, -(-self._min_bytes // row_bytes)), n))
        chunks = (rows, max(m.n_vars, 1))
        out = self._appender(m.name, (n, m.n_vars), m.dtype, chunks, row_bytes)
        out.array.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
        return out

    def _appender(self, path: str, shape, dtype, chunks, unit_bytes: int) -> _Appender:
        """A new array's in-order writer, a shard (v3) or chunk of rows at a time."""
        rows, shards = chunks[0], None
        if self.zarr_format == 3:
            per = max(1, SHARD_BYTES // max(rows * unit_bytes, 1))
            rows *= min(per, max(1, -(-shape[0] // rows)))
            shards = (rows, *chunks[1:])
        parent, name = _parent(self.root, path)
        array = parent.create_array(
            name,
            shape=shape,
            dtype=dtype,
            chunks=chunks,
            shards=shards,
            compressors=self._compressors,
            filters=None,
            fill_value=0,
            config={"write_empty_chunks": True},
        )
        self._appenders.append(_Appender(array, rows))
        return self._appenders[-1]

    def commit(self, marker: dict) -> None:
        """Marks the part complete, flushes it and renames it into place."""
        for appender in self._appenders:
            appender.check_complete()
        self.root.attrs[_files.MARKER_ATTR] = json.dumps(marker)
        _files.publish(self.tmp, self.final)

    def __enter__(self) -> ZarrPart:
        return self

    def __exit__(self, exc_type, e, tb) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        if e is not None and _files.is_disk_full(e):
            raise _files.disk_filled(self.plan, self.final, e) from e


class _Appender:
    """Writes an array's rows in order, whole shards at a time (a partial one waits)."""

    def __init__(self, array, unit: int):
        self.array = array
        self.length = int(array.shape[0])
        self.unit = int(unit)
        row_bytes = array.dtype.itemsize * math.prod(array.shape[1:])
        self.piece = self.unit * max(1, WRITE_BYTES // max(self.unit * row_bytes, 1))
        self.written = 0
        self.buffered = 0
        self.buffer: np.ndarray | None = None

    def __setitem__(self, key: slice, values: np.ndarray) -> None:
        lo, hi = key.start, key.stop
        if lo != self.written + self.buffered or hi - lo != len(values):
            raise RuntimeError(
                f"preshuffle: rows {lo}:{hi} of {self.array.path} written out of "
                f"order (expected them from {self.written + self.buffered})"
            )
        k = 0
        if self.buffered:
            k = min(self.unit - self.buffered, len(values))
            self.buffer[self.buffered : self.buffered + k] = values[:k]
            self.buffered += k
            if self.buffered < self.unit and self.written + self.buffered < self.length:
                return  # every value went into the buffer
            self._write(self.buffer[: self.buffered])
            self.buffered = 0
        rest = values[k:]
        if self.written + len(rest) == self.length:
            full = len(rest)
        else:
            full = len(rest) // self.unit * self.unit
        if full:
            self._write(rest[:full])
        if full < len(rest):
            if self.buffer is None:
                self.buffer = np.empty((self.unit, *values.shape[1:]), values.dtype)
            self.buffered = len(rest) - full
            self.buffer[: self.buffered] = rest[full:]

    def _write(self, values: np.ndarray) -> None:
        # A few shards per call: zarr encodes the shards of one call at once,
        # each copied (chunks, then the shard), so a whole window per call
        # would cost several times the window in memory.
        for a in range(0, len(values), self.piece):
            piece = values[a : a + self.piece]
            self.array[self.written : self.written + len(piece)] = piece
            self.written += len(piece)

    def check_complete(self) -> None:
        """Raises unless every row was written."""
        if self.written != self.length:
            raise RuntimeError(
                f"preshuffle: {self.array.path} has {self.written} of "
                f"{self.length} rows written"
            )


def _parent(root, path: str):
    """The group holding `path` (created if missing) and the last name."""
    group = root
    *heads, name = path.split("/")
    for head in heads:
        group = group.require_group(head)
    return group, name
