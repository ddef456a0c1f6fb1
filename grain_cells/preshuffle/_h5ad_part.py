"""One `.h5ad` part being written: its temporary file, datasets and publish."""

from __future__ import annotations

import contextlib
import json
import os

import h5py
import numpy as np

from grain_cells.io import CSR, DENSE
from grain_cells.preshuffle import _files
from grain_cells.preshuffle._matrices import Matrix
from grain_cells.preshuffle._plan import Plan

_GZIP_LEVEL = 1  # "light": most of gzip's gain at a fraction of its cost
INDPTR_CHUNK = 1 << 16  # elements per chunk of indptr (512 KiB)


class H5adPart:
    """Part `index` of a plan in a temporary HDF5 file (removed on error); `commit`."""

    def __init__(self, plan: Plan, index: int, nbytes: int):
        self.plan = plan
        self.final = plan.part_paths[index]
        fd, self.tmp = _files.create_temporary(plan.output_dir, self.final.name)
        os.close(fd)
        try:
            with h5py.File(self.tmp, "w"):  # an empty HDF5 file ...
                pass
            # ... given the space it will need before HDF5 writes to it.
            _files.reserve_space(self.tmp, nbytes, f"part {self.final.name}")
            self.root = h5py.File(self.tmp, "a")
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise

    def frames_settings(self):
        """Context of anndata's writes of obs, var and the other frames."""
        return contextlib.nullcontext()

    def create_csr(self, m: Matrix, n: int, nnz: int, chunk: int):
        """Matrix `m`'s CSR group of `n` rows: `(data, indices, indptr)` datasets."""
        group = self.root.require_group(m.name)
        group.attrs["encoding-type"] = CSR
        group.attrs["encoding-version"] = "0.1.0"
        group.attrs["shape"] = np.array([n, m.n_vars], np.int64)
        opts = filter_options(self.plan.compression)
        data = group.create_dataset(
            "data", (nnz,), m.dtype, maxshape=(None,), chunks=(chunk,), **opts
        )
        indices = group.create_dataset(
            "indices", (nnz,), m.index_dtype, maxshape=(None,), chunks=(chunk,), **opts
        )
        indptr = group.create_dataset(
            "indptr",
            (n + 1,),
            np.int64,
            maxshape=(None,),
            chunks=(min(INDPTR_CHUNK, n + 1),),
        )
        return data, indices, indptr

    def create_dense(self, m: Matrix, n: int, chunk_rows: int):
        """Matrix `m` as a dense array of `n` rows, chunked by `chunk_rows`."""
        n_vars = m.n_vars
        x = self.root.create_dataset(
            m.name,
            (n, n_vars),
            m.dtype,
            chunks=(chunk_rows, n_vars) if n and n_vars else None,
            **(filter_options(self.plan.compression) if n and n_vars else {}),
        )
        x.attrs["encoding-type"] = DENSE
        x.attrs["encoding-version"] = "0.2.0"
        return x

    def commit(self, marker: dict) -> None:
        """Marks the part complete, flushes it and renames it into place."""
        self.root.attrs[_files.MARKER_ATTR] = json.dumps(marker)
        self.root.close()  # truncates the file to what HDF5 used
        _files.fsync_path(self.tmp)
        os.replace(self.tmp, self.final)
        _files.fsync_path(self.plan.output_dir)

    def __enter__(self) -> H5adPart:
        return self

    def __exit__(self, exc_type, e, tb) -> None:
        try:
            if e is None:
                return
            if not _files.is_disk_full(e):
                with contextlib.suppress(Exception):
                    self.root.close()
                return
            _files.abandon(self.root, self.tmp)  # HDF5 cannot close it: see abandon
            raise _files.disk_filled(self.plan, self.final, e) from e
        finally:
            self.tmp.unlink(missing_ok=True)


def filter_options(compression: str | None) -> dict:
    """h5py's options for `preshuffle`'s `compression`."""
    if compression is None:
        return {}
    if compression == "gzip":
        return {"compression": "gzip", "compression_opts": _GZIP_LEVEL, "shuffle": True}
    return {"compression": compression, "shuffle": True}
