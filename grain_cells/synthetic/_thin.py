"""Thin atlas-shaped `.h5ad` files for scale tests, and X's writer for both kinds.

anndata lays out empty obs and var; h5py fills them `chunk_cells` cells at a time.
Design notes: docs/reference/design.md#synthetic-thin.
"""

from __future__ import annotations

import os
import pathlib

import h5py
import numpy as np
import pandas as pd

from grain_cells._util import arguments

COMPRESSIONS = (None, "gzip", "lzf")
_CSR_CHUNK = 2**18  # HDF5 chunk (elements) for data/indices, uncompressed
_CSR_CHUNK_COMPRESSED = 2**16  # same, when a compression filter is set
_DENSE_CHUNK_BYTES = 2**20  # target HDF5 chunk size of a compressed dense X
_DENSE_BLOCK_BYTES = 2**26  # densify at most this much of a chunk at a time
# `chunks="atlas"`: HDF5 chunks as anndata writes them for a file this size.
ATLAS_CHUNKS = "atlas"
_MAX_NNZ = 6
_BATCH_RUN = 4_096


def check_compression(compression) -> None:
    """Raises `ValueError` unless `compression` is one h5py writes."""
    if compression not in COMPRESSIONS:
        raise ValueError(
            f"compression must be None, 'gzip' or 'lzf', got compression="
            f"{compression!r}"
        )


def csr_chunk_length(chunks, compression, n_cells: int, mean_nnz: float) -> int:
    """HDF5 chunk length of X's CSR datasets for `chunks` (None, "atlas" or an int)."""
    if chunks is None:
        return _CSR_CHUNK if compression is None else _CSR_CHUNK_COMPRESSED
    if chunks != ATLAS_CHUNKS:
        return int(chunks)
    # h5py's own guess (what anndata gets) for a float32 dataset of the full
    # expected length, in a throwaway in-memory file (chunks are lazy).
    length = max(1, round(n_cells * mean_nnz))
    name = f"atlas-chunks-{os.getpid()}"
    with h5py.File(name, "w", driver="core", backing_store=False) as mem:
        probe = mem.create_dataset(
            "probe", (length,), np.float32, maxshape=(None,), chunks=True
        )
        return int(probe.chunks[0])


class XWriter:
    """Appends CSR rows to ``X``: a csr_matrix, or dense float32 if `chunk` is None."""

    def __init__(self, f: h5py.File, n_cells: int, n_genes: int, compression, chunk):
        self.n_genes, self.nnz, self.rows = n_genes, 0, 0
        if chunk is None:
            rows = max(1, min(1024, n_cells, _DENSE_CHUNK_BYTES // (4 * n_genes)))
            chunks = None if compression is None else (rows, n_genes)
            shape, opts = (n_cells, n_genes), {"compression": compression}
            self.x = f.create_dataset("X", shape, np.float32, chunks=chunks, **opts)
            self.x.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
            return
        self.x = None
        group = f.create_group("X")
        shape = np.array([n_cells, n_genes], dtype=np.int64)
        group.attrs.update(
            {"encoding-type": "csr_matrix", "encoding-version": "0.1.0", "shape": shape}
        )
        opts = {"maxshape": (None,), "chunks": (chunk,), "compression": compression}
        self.data = group.create_dataset("data", (0,), np.float32, **opts)
        self.indices = group.create_dataset("indices", (0,), np.int32, **opts)
        self.indptr = group.create_dataset("indptr", (1,), np.int64, **opts)
        self.indptr[0] = 0

    def append(self, indptr, indices, data) -> None:
        """Appends CSR rows (`indptr` starting at 0)."""
        n_rows = indptr.size - 1
        if self.x is not None:  # densified a block of rows at a time
            step = max(1, _DENSE_BLOCK_BYTES // (4 * self.n_genes))
            for r0 in range(0, n_rows, step):
                r1 = min(r0 + step, n_rows)
                lo, hi = indptr[r0], indptr[r1]
                block = np.zeros((r1 - r0, self.n_genes), dtype=np.float32)
                rows = np.repeat(np.arange(r1 - r0), np.diff(indptr[r0 : r1 + 1]))
                block[rows, indices[lo:hi]] = data[lo:hi]
                self.x[self.rows + r0 : self.rows + r1] = block
            self.rows += n_rows
            return
        nnz, rows = self.nnz + data.size, self.rows + n_rows
        for dataset, values in ((self.data, data), (self.indices, indices)):
            dataset.resize((nnz,))
            dataset[self.nnz :] = values
        self.indptr.resize((rows + 1,))
        self.indptr[self.rows + 1 :] = indptr[1:] + self.nnz
        self.nnz, self.rows = nnz, rows


def thin_rows(start: int, stop: int, n_genes: int):
    """CSR rows of atlas cells ``[start, stop)``: (indptr from 0, indices, data)."""
    cells = np.arange(start, stop, dtype=np.int64)
    nnz = 2 + cells % 5
    indptr = np.zeros(cells.size + 1, dtype=np.int64)
    np.cumsum(nnz, out=indptr[1:])
    row = np.repeat(np.arange(cells.size), nnz)
    j = np.arange(indptr[-1], dtype=np.int64) - indptr[:-1][row]
    stride = max(1, n_genes // (_MAX_NNZ + 2))
    span = n_genes - (_MAX_NNZ - 1) * stride
    base = (cells * 31) % span
    indices = (base[row] + j * stride).astype(np.int32)
    data = ((cells[row] % 65_536) + j + 1).astype(np.float32)
    return indptr, indices, data


def _nnz_before(i: int) -> int:
    """Values stored by atlas cells ``[0, i)`` (``sum(2 + k % 5)``)."""
    r = i % 5
    return 2 * i + 10 * (i // 5) + r * (r - 1) // 2


def _obs_codes(cells: np.ndarray, total: int, sizes: dict, seed: int) -> dict:
    out = {
        "plate": cells * sizes["plate"] // total,
        "donor": cells * sizes["donor"] // total,
        "batch": ((cells // _BATCH_RUN) * 2_654_435_761) % sizes["batch"],
    }
    k = sizes["cell_type"]
    cum = np.cumsum(1.0 / np.arange(1, k + 1))
    # One generator per 2**16 atlas cells, so codes do not depend on how a
    # file or a collection slices the atlas.
    draws = np.empty(cells.size)
    if cells.size:
        a, b = int(cells[0]), int(cells[-1]) + 1
        for g in range(a >> 16, ((b - 1) >> 16) + 1):
            lo, hi = max(a, g << 16), min(b, (g + 1) << 16)
            block = np.random.default_rng([seed, g]).random(1 << 16)
            draws[lo - a : hi - a] = block[lo - (g << 16) : hi - (g << 16)]
    out["cell_type"] = np.searchsorted(cum / cum[-1], draws, side="right")
    return out


def write_thin_atlas(
    path: str | os.PathLike,
    n_cells: int,
    *,
    n_genes: int = 2_000,
    n_plates: int = 14,
    n_donors: int = 1_000,
    n_cell_types: int = 50,
    n_batches: int = 100,
    compression: str | None = None,
    chunks: int | str = ATLAS_CHUNKS,
    seed: int = 0,
    first_cell: int = 0,
    total_cells: int | None = None,
    chunk_cells: int = 1 << 20,
) -> pathlib.Path:
    """Writes cells ``[first_cell, first_cell + n_cells)`` of a thin atlas to ``path``.

    ``path`` is overwritten (its folder must exist). Each cell stores 2-6 values;
    obs holds the categoricals ``plate`` and ``donor`` (runs over the atlas of
    ``total_cells``, default this file's end), ``cell_type`` (per cell, from
    ``seed``) and ``batch`` (per 4,096-cell run), each with ``n_<name>s``
    categories; var is indexed ``ENSG00000000000``, ... (``n_genes`` >= 8).
    ``compression`` (None, ``"gzip"``, ``"lzf"``) and ``chunks`` (an HDF5 chunk
    length, or ``"atlas"``: h5py's guess for the full length, what anndata writes)
    apply to X's datasets; ``chunk_cells`` cells are made and written per step
    (bounds memory). Returns the path as a ``pathlib.Path``; raises ``ValueError``
    for an argument out of range.
    """
    arguments.check_int("n_cells", n_cells, minimum=1)
    arguments.check_int("n_genes", n_genes, minimum=_MAX_NNZ + 2, maximum=2**31 - 1)
    arguments.check_int("first_cell", first_cell, minimum=0)
    arguments.check_int("chunk_cells", chunk_cells, minimum=1)
    sizes = dict(
        plate=n_plates, donor=n_donors, cell_type=n_cell_types, batch=n_batches
    )
    for key, n in sizes.items():
        arguments.check_int(f"n_{key}s", n, minimum=1)
    check_compression(compression)
    total = first_cell + n_cells if total_cells is None else int(total_cells)
    if total < first_cell + n_cells:
        raise ValueError(
            f"total_cells={total_cells} is below first_cell + n_cells "
            f"= {first_cell + n_cells}"
        )
    path = pathlib.Path(path)
    nnz_total = _nnz_before(first_cell + n_cells) - _nnz_before(first_cell)
    length = csr_chunk_length(chunks, compression, n_cells, nnz_total / n_cells)
    import anndata  # heavy, and only needed to lay out obs and var

    var = pd.DataFrame(index=[f"ENSG{i:011d}" for i in range(n_genes)])
    obs = pd.DataFrame(index=pd.Index([], dtype=object))
    for key, n in sizes.items():
        labels = [f"{key}_{i:0{len(str(n))}d}" for i in range(n)]
        obs[key] = pd.Categorical.from_codes([], labels)
    with h5py.File(path, "w") as f:
        # anndata's skeleton; obs empty and resizable, grown a step at a time.
        anndata.io.write_elem(f, "/", anndata.AnnData(var=var))
        del f["obs"]
        growing = {"maxshape": (None,), "chunks": (min(n_cells, 1 << 16),)}
        anndata.io.write_elem(f, "obs", obs, dataset_kwargs=growing)
        index, codes = f["obs/_index"], {k: f[f"obs/{k}/codes"] for k in sizes}
        for dataset in (index, *codes.values()):
            dataset.resize((n_cells,))
        x = XWriter(f, n_cells, n_genes, compression, length)
        for lo in range(0, n_cells, chunk_cells):
            hi = min(lo + chunk_cells, n_cells)
            cells = np.arange(first_cell + lo, first_cell + hi, dtype=np.int64)
            x.append(*thin_rows(first_cell + lo, first_cell + hi, n_genes))
            index[lo:hi] = np.char.add("cell_", cells.astype("U12")).astype(object)
            for key, values in _obs_codes(cells, total, sizes, seed).items():
                codes[key][lo:hi] = values
    return path


def write_thin_collection(
    folder: str | os.PathLike, n_files: int, cells_per_file: int, **kwargs
) -> list[pathlib.Path]:
    """Writes a thin atlas of ``n_files * cells_per_file`` cells as many files.

    File ``k`` (``thin-00000.h5ad``, ... in ``folder``, created if missing) holds
    atlas cells ``[k * n, (k + 1) * n)``: the concatenation equals one
    ``write_thin_atlas`` file of all the cells. ``**kwargs`` are those of
    ``write_thin_atlas`` but ``first_cell`` and ``total_cells``. Returns the paths,
    in atlas order.
    """
    arguments.check_int("n_files", n_files, minimum=1)
    arguments.check_int("cells_per_file", cells_per_file, minimum=1)
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    total = n_files * cells_per_file
    width = max(5, len(str(n_files - 1)))
    return [
        write_thin_atlas(
            folder / f"thin-{k:0{width}d}.h5ad",
            cells_per_file,
            first_cell=k * cells_per_file,
            total_cells=total,
            **kwargs,
        )
        for k in range(n_files)
    ]
