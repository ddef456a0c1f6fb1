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
from grain_cells.preshuffle._matrices import Matrix
from grain_cells.preshuffle._plan import Plan

CHUNK_CELLS = {3: 32, 2: 256}
"""Cells per chunk of a matrix by default, per zarr format."""
MIN_CHUNK_BYTES = {3: 64 << 10, 2: 1 << 20}
SHARD_BYTES = 32 << 20  # uncompressed bytes per shard (v3)
INDPTR_CHUNK = 1 << 16
WRITE_BYTES = 64 << 20  # uncompressed bytes per zarr write call, at most


def _compressors(compression: str | None, zarr_format: int):
    if compression is None:
        return None
    if zarr_format == 3:
        if compression == "gzip":
            return zarr.codecs.GzipCodec(level=1)
        return zarr.codecs.ZstdCodec(level=0)
    import numcodecs

    return numcodecs.GZip(level=1) if compression == "gzip" else numcodecs.Zstd(level=0)


class ZarrPart:
    """Part `index` of a plan, written into a temporary zarr store (as `H5adPart`)."""

    def __init__(self, plan: Plan, index: int, nbytes: int):
        self.plan = plan
        self.zarr_format = plan.zarr_format
        self.final = plan.part_paths[index]
        _files.check_free_space(plan.output_dir, nbytes, f"part {self.final.name}")
        self.tmp = _files.create_temporary(plan.output_dir, self.final.name, True)[1]
        self._appenders: list[_Appender] = []
        try:
            self.root = zarr.open_group(
                zarr.storage.LocalStore(self.tmp),
                mode="w",
                zarr_format=self.zarr_format,
            )
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def frames_settings(self):
        """The anndata settings under which anndata writes obs, var and the rest."""
        shard = anndata.settings.auto_shard_zarr_v3
        return anndata.settings.override(auto_shard_zarr_v3=bool(shard))

    def _array(self, path: str, shape, dtype, chunks, unit_bytes: int):
        """Creates an array; returns it and the rows of one shard (v3) or chunk."""
        n = shape[0]
        rows = chunks[0]
        shards = None
        if self.zarr_format == 3:
            per = max(1, SHARD_BYTES // max(rows * unit_bytes, 1))
            rows *= min(per, max(1, -(-n // rows)))
            shards = (rows, *chunks[1:])
        parent, name = _parent(self.root, path)
        array = parent.create_array(
            name,
            shape=shape,
            dtype=dtype,
            chunks=chunks,
            shards=shards,
            compressors=_compressors(self.plan.compression, self.zarr_format),
            filters=None,
            fill_value=0,
            config={"write_empty_chunks": True},
        )
        return array, rows

    def _cells_per_chunk(self) -> tuple[int, bool]:
        if self.plan.chunk_cells is not None:
            return self.plan.chunk_cells, False
        return CHUNK_CELLS[self.zarr_format], True

    def create_csr(self, m: Matrix, n: int, nnz: int, chunk: int):
        """Matrix `m`'s CSR group: in-order writers of `data`, `indices`, `indptr`.

        `chunk` (the HDF5 writer's) is not used: see the design notes.
        """
        del chunk
        cells, floor = self._cells_per_chunk()
        elements = math.ceil(cells * max(m.nnz / max(m.n_cells, 1), 1.0))
        if floor:
            elements = max(
                elements, MIN_CHUNK_BYTES[self.zarr_format] // m.dtype.itemsize
            )
        elements = max(1, min(elements, nnz))
        parent, name = _parent(self.root, m.name)
        group = parent.require_group(name)
        group.attrs.update(
            {
                "encoding-type": "csr_matrix",
                "encoding-version": "0.1.0",
                "shape": [int(n), int(m.n_vars)],
            }
        )
        out = []
        for key, dtype in (("data", m.dtype), ("indices", m.index_dtype)):
            array, unit = self._array(
                f"{m.name}/{key}", (nnz,), dtype, (elements,), dtype.itemsize
            )
            out.append(self._appender(array, unit))
        ptr, unit = self._array(
            f"{m.name}/indptr",
            (n + 1,),
            np.dtype(np.int64),
            (max(1, min(INDPTR_CHUNK, n + 1)),),
            8,
        )
        out.append(self._appender(ptr, unit))
        return tuple(out)

    def create_dense(self, m: Matrix, n: int, chunk_rows: int):
        """Matrix `m` as a dense array of `n` rows (`chunk_rows`: the HDF5 writer's)."""
        del chunk_rows
        row_bytes = max(m.n_vars * m.dtype.itemsize, 1)
        rows, floor = self._cells_per_chunk()
        if floor:
            rows = max(rows, -(-MIN_CHUNK_BYTES[self.zarr_format] // row_bytes))
        rows = max(1, min(rows, n))
        array, unit = self._array(
            m.name, (n, m.n_vars), m.dtype, (rows, max(m.n_vars, 1)), row_bytes
        )
        array.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
        return self._appender(array, unit)

    def _appender(self, array, unit: int) -> _Appender:
        appender = _Appender(array, unit)
        self._appenders.append(appender)
        return appender

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
