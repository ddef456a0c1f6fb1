"""Zarr copies of the suite's `.h5ad` files, in every layout anndata writes.

`copy_as(paths, directory, layout)` reads each file with `anndata.read_h5ad`
and writes it back with anndata's own zarr writer (`write_dispatched`, what
`AnnData.write_zarr` calls), so a zarr copy holds exactly the cells, obs, var,
layers, raw and obsm of its file, while its bytes, layout and identity differ.
The row-aligned matrices (X, layers, raw/X) get chunks of `chunk` elements
(first axis: values and indices of a CSR matrix, rows of a dense one), so
even the suite's small files span several chunks (and, sharded, several
shards of `SHARD_CHUNKS` chunks each); the codecs are zarr's defaults for
the format (v2: blosc lz4, v3: zstd), so the stores are compressed.

Layouts (`LAYOUTS`): `zarr-v2` (with consolidated metadata, as anndata
writes v2), `zarr-v3`, `zarr-v3-sharded`, and `zarr-zip` (the sharded v3
store in a `.zarr.zip`). `h5ad` names the original files (no copy).
`read(path)` is the oracle: `anndata.read_zarr` (or `read_h5ad`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import warnings
import zipfile

import anndata
import numpy as np
import pytest
import scipy.sparse as sp
import zarr
from anndata.experimental import write_dispatched

LAYOUTS = ("zarr-v2", "zarr-v3", "zarr-v3-sharded", "zarr-zip")
SHARD_CHUNKS = 4  # inner chunks per shard of the sharded layouts
_ROW_ALIGNED = ("X", "raw/X")  # and every layers/<name>


def layout_params(*layouts, slow=()):
    """`pytest.param`s of layouts, those in `slow` marked slow."""
    return [
        pytest.param(x, id=x, marks=pytest.mark.slow if x in slow else ())
        for x in layouts
    ]


def write_store(
    adata: anndata.AnnData, path, layout: str, chunk: int = 16, **codecs
) -> str:
    """Writes `adata` as a zarr store of `layout` at `path`; returns the path.

    `codecs` (e.g. `compressors=zarr.codecs.GzipCodec()`) go to the
    row-aligned matrices' arrays in place of zarr's defaults.
    """
    path = str(path)
    if layout == "zarr-zip":
        folder = path.removesuffix(".zip")
        write_store(adata, folder, "zarr-v3-sharded", chunk, **codecs)
        _zip_folder(folder, path)
        return path
    fmt = 2 if layout == "zarr-v2" else 3
    kwargs = {"chunks": (chunk,)}
    if layout == "zarr-v3-sharded":
        kwargs["shards"] = (chunk * SHARD_CHUNKS,)

    def callback(write, store, key, elem, *, dataset_kwargs, iospec):
        del iospec
        name = f"{store.path}/{key}".strip("/")  # keys are relative to `store`
        if name in _ROW_ALIGNED or name.startswith("layers/"):
            row_chunks = dict(kwargs)
            if not sp.issparse(elem) and np.ndim(elem) == 2:  # dense: whole rows
                row_chunks = {k: (v[0], np.shape(elem)[1]) for k, v in kwargs.items()}
            dataset_kwargs = {**dataset_kwargs, **row_chunks, **codecs}
        write(store, key, elem, dataset_kwargs=dataset_kwargs)

    with _settings(fmt):
        adata = adata.copy()
        adata.strings_to_categoricals()  # as write_zarr does
        group = zarr.open_group(path, mode="w", zarr_format=fmt)
        group.attrs.update({"encoding-type": "anndata", "encoding-version": "0.1.0"})
        write_dispatched(group, "/", adata, callback=callback)
        if fmt == 2:
            zarr.consolidate_metadata(path)
    return path


@contextlib.contextmanager
def _settings(fmt: int):
    """anndata's zarr format (0.13 deprecates the setting: v3 only from 0.14)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "This setting will be removed", DeprecationWarning
        )
        with anndata.settings.override(zarr_write_format=fmt, auto_shard_zarr_v3=False):
            yield


def _zip_folder(folder: str, path: str) -> None:
    """A `.zarr.zip` of a store folder (stored, not deflated, as zarr writes)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for root, dirs, files in os.walk(folder):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(root, name)
                z.write(full, os.path.relpath(full, folder))


def copy_as(paths, directory, layout: str, chunk: int = 16, **codecs) -> list[str]:
    """Zarr copies of `.h5ad` files in `directory` (`layout` 'h5ad': `paths`)."""
    if layout == "h5ad":
        return list(paths)
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    suffix = ".zarr.zip" if layout == "zarr-zip" else ".zarr"
    out = []
    for p in paths:
        stem = pathlib.Path(p).name.removesuffix(".h5ad")
        out.append(
            write_store(
                anndata.read_h5ad(p),
                directory / (stem + suffix),
                layout,
                chunk,
                **codecs,
            )
        )
    return out


@functools.cache
def read(path: str) -> anndata.AnnData:
    """The oracle: `anndata.read_zarr` of a store (`read_h5ad` of a file)."""
    if path.endswith(".h5ad"):
        return anndata.read_h5ad(path)
    if path.endswith(".zip"):
        store = zarr.storage.ZipStore(path, mode="r")
        try:
            return anndata.read_zarr(store)
        finally:
            store.close()
    return anndata.read_zarr(path)


def dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else np.asarray(x)


class Truth:
    """What the stores (or files) of a source hold, as anndata reads them."""

    def __init__(self, paths):
        self.adatas = [read(str(p)) for p in paths]
        self.offsets = np.cumsum([0] + [a.n_obs for a in self.adatas])

    def locate(self, row_ids):
        row_ids = np.asarray(row_ids, np.int64)
        files = np.searchsorted(self.offsets, row_ids, side="right") - 1
        return files, row_ids - self.offsets[files]

    def matrix(self, row_ids, get=lambda a: a.X) -> np.ndarray:
        """Dense rows of X (or of `get(adata)`) for global row ids."""
        files, local = self.locate(row_ids)
        width = dense(get(self.adatas[0])[:1]).shape[1]
        out = np.zeros((files.size, width), np.float64)
        for f, a in enumerate(self.adatas):
            sel = files == f
            if sel.any():
                out[sel] = dense(get(a)[local[sel]])
        return out

    def obs(self, row_ids, column) -> np.ndarray:
        files, local = self.locate(row_ids)
        out = np.empty(files.size, object)
        for f, a in enumerate(self.adatas):
            sel = files == f
            out[sel] = a.obs[column].to_numpy()[local[sel]]
        return out
