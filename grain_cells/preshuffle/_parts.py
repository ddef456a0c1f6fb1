"""A part being written: an `.h5ad` file (`H5adPart`) or a zarr store (`ZarrPart`).

Both write under a temporary name (removed on error) and `commit` renames it into
place. Design notes: docs/reference/design.md#preshuffle-zarr-part.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil

import h5py
import numpy as np

from grain_cells.io import CSR, DENSE
from grain_cells.preshuffle import _files
from grain_cells.preshuffle._plan import Matrix, Plan

INDPTR_CHUNK = 1 << 16  # elements per chunk of indptr (512 KiB)
_GZIP_LEVEL = 1  # "light": most of gzip's gain at a fraction of its cost
_ABANDONED: list = []  # HDF5 files that failed mid-write: never released
SHARD_BYTES = 32 << 20  # uncompressed bytes per shard (v3)
WRITE_BYTES = 64 << 20  # uncompressed bytes per zarr write call, at most


class H5adPart:
    """Part `index` of a plan in a temporary HDF5 file, its space reserved."""

    frames_settings = contextlib.nullcontext  # anndata's settings for obs, var, ...

    def __init__(self, plan: Plan, index: int, nbytes: int):
        self.plan = plan
        self.final = plan.part_paths[index]
        self.tmp = _files.create_temporary(plan.output_dir, self.final.name)
        try:
            h5py.File(self.tmp, "w").close()  # an empty HDF5 file, given its space
            _files.reserve_space(self.tmp, nbytes, f"part {self.final.name}")
            self.root = h5py.File(self.tmp, "a")
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise

    def create_csr(self, m: Matrix, n: int, nnz: int, chunk: int):
        """Matrix `m`'s CSR group of `n` rows: writers of `(data, indices, indptr)`."""
        parent, name = _parent(self.root, m.name)
        shape = [int(n), int(m.n_vars)]
        attrs = {"encoding-type": CSR, "encoding-version": "0.1.0", "shape": shape}
        parent.require_group(name).attrs.update(attrs)
        ptr = ((n + 1,), np.dtype(np.int64), (min(INDPTR_CHUNK, n + 1),))
        return (
            self._array(f"{m.name}/data", (nnz,), m.dtype, (chunk,)),
            self._array(f"{m.name}/indices", (nnz,), m.index_dtype, (chunk,)),
            self._array(f"{m.name}/indptr", *ptr, compress=False),
        )

    def create_dense(self, m: Matrix, n: int, chunk_rows: int):
        """Matrix `m`'s writer as a dense array of `n` rows, chunked by `chunk_rows`."""
        chunks = (chunk_rows, max(m.n_vars, 1))
        x = self._array(m.name, (n, m.n_vars), m.dtype, chunks)
        x.attrs.update({"encoding-type": DENSE, "encoding-version": "0.2.0"})
        return x

    def _array(self, path: str, shape, dtype, chunks, compress: bool = True):
        """A new dataset (1-D ones resizable, as anndata writes them)."""
        codec, opts = self.plan.compression, {}
        if compress and codec is not None:  # h5py filters, shuffle first
            level = {"compression_opts": _GZIP_LEVEL} if codec == "gzip" else {}
            opts = {"compression": codec, **level, "shuffle": True}
        if len(shape) == 1:
            opts["maxshape"] = (None,)
        elif not all(shape):  # an empty dense matrix: contiguous
            chunks, opts = None, {}
        return self.root.create_dataset(path, shape, dtype, chunks=chunks, **opts)

    def commit(self, marker: dict) -> None:
        """Marks the part complete, flushes it and renames it into place."""
        self.root.attrs[_files.MARKER_ATTR] = json.dumps(marker)
        self.root.close()  # truncates the file to what HDF5 used
        _files.publish(self.tmp, self.final)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, e, tb) -> None:
        try:
            if e is not None and not _files.is_disk_full(e):
                with contextlib.suppress(Exception):
                    self.root.close()
            elif e is not None:  # HDF5 cannot close it: truncated, handle kept
                _ABANDONED.append(self.root)
                with contextlib.suppress(OSError):
                    os.truncate(self.tmp, 0)
                raise _files.disk_filled(self.plan, self.final, e) from e
        finally:
            self.tmp.unlink(missing_ok=True)


class ZarrPart(H5adPart):
    """Part `index` of a plan in a temporary zarr store (`H5adPart`'s contract)."""

    def __init__(self, plan: Plan, index: int, nbytes: int):
        import zarr

        self.plan = plan
        self.zarr_format = plan.zarr_format
        self.final = plan.part_paths[index]
        _files.reserve_space(plan.output_dir, nbytes, f"part {self.final.name}")
        self.tmp = _files.create_temporary(plan.output_dir, self.final.name, True)
        self._appenders: list[_Appender] = []
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
        import anndata

        shard = anndata.settings.auto_shard_zarr_v3
        return anndata.settings.override(auto_shard_zarr_v3=bool(shard))

    def _array(self, path: str, shape, dtype, chunks, compress: bool = True):
        """A new array's in-order writer, a shard (v3) or chunk of rows at a time.

        Every array gets the codec (`compress` is the HDF5 writer's).
        """
        rows, shards = chunks[0], None
        if self.zarr_format == 3:
            unit_bytes = np.dtype(dtype).itemsize * math.prod(shape[1:])
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

    @property
    def attrs(self):
        return self.array.attrs

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

    def _write(self, values: np.ndarray) -> None:  # a few shards per call
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
