"""Synthetic, Tahoe-100M-shaped `.h5ad` files for tests, benchmarks and demos.

Design notes: docs/reference/design.md#synthetic-tahoe.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import pathlib
import shutil
import sys
import tempfile

import h5py
import numpy as np
import tqdm

from grain_cells._util import arguments
from grain_cells._util.cache_files import cache_root
from grain_cells.synthetic import _model
from grain_cells.synthetic._model import ATLAS_CHUNKS

_COMPRESSIONS = (None, "gzip", "lzf")


def write_tahoe_like(
    path: str | os.PathLike,
    n_cells: int,
    *,
    n_genes: int = 62_710,
    mean_nnz: float = 1_600.0,
    n_plates: int = 14,
    n_cell_lines: int = 50,
    n_drugs: int = 380,
    seed: int = 0,
    compression: str | None = None,
    dense: bool = False,
    chunk_cells: int = 16_384,
    chunks: int | str | None = None,
    progress: bool = False,
) -> pathlib.Path:
    """Writes a synthetic plate-sorted, Tahoe-100M-like dataset to ``.h5ad``.

    Plate ``i`` holds cells ``[i * n_cells // n_plates, (i + 1) * n_cells //
    n_plates)``. ``obs`` has the categoricals ``plate`` (``plate_01``, ...),
    ``cell_line`` (``CVCL_0001``, ...; Zipf-like in every plate) and ``drug``
    (``drug_001``, ...; skewed, per cell), the float32 ``n_counts`` (row sums of X) and
    the index ``cell_000000000``, ...; ``var`` is indexed by ``ENSG00000000001``-style
    ids with a ``gene_symbol`` column.

    X holds integer-valued float32 counts, as anndata's ``csr_matrix`` (``indices``
    int32, sorted within each row; ``indptr`` int64; resizable datasets), or with
    ``dense=True`` as a 2-D float32 dataset of the same values (contiguous, or chunked
    by whole rows, about 1 MiB each, when compressed).

    The same arguments give identical ``X``, ``obs`` and ``var``; ``chunk_cells``
    changes which genes each cell holds (one random stream per write step), not the
    metadata or counts.

    Args:
        path: Destination file; overwritten if it exists. Its folder must
            exist.
        n_cells: Number of cells (rows), > 0.
        n_genes: Number of genes (columns), > 0 and < 2**31.
        mean_nnz: Target mean number of stored values per cell, in
            ``(0, n_genes]``; the realised mean is close to it when it is well
            below ``n_genes``.
        n_plates: Number of plates, > 0.
        n_cell_lines: Number of cell lines, > 0.
        n_drugs: Number of drugs, > 0.
        seed: Non-negative seed of every random draw.
        compression: None, ``"gzip"`` or ``"lzf"``; applied to X's datasets.
        dense: Write X as a dense 2-D float32 dataset instead of CSR. Only
            sensible for small ``n_genes``.
        chunk_cells: Cells generated and written per step, > 0; bounds the
            memory used (about 30 bytes per stored value of a step).
        chunks: HDF5 chunk length (elements) of the CSR ``data``, ``indices``
            and ``indptr``: None for 2**18 (2**16 compressed), ``"atlas"`` for
            anndata's (h5py's guess at full size: 39,063 at 400,000 cells), or
            an int > 0. Ignored with ``dense=True``.
        progress: Show a progress bar (tqdm, on stderr) while writing.

    Returns:
        The path written, as a ``pathlib.Path``.

    Raises:
        ValueError: If an argument is out of range or of the wrong kind.

    Example:
        >>> import anndata
        >>> p = write_tahoe_like("/tmp/tiny.h5ad", 500, n_genes=1_000,
        ...                      mean_nnz=100, seed=1)
        >>> anndata.read_h5ad(p).obs["plate"].nunique()
        14
    """
    arguments.check_int("n_cells", n_cells, minimum=1)
    arguments.check_int("n_genes", n_genes, minimum=1, maximum=2**31 - 1)
    positive = dict(n_plates=n_plates, n_cell_lines=n_cell_lines, n_drugs=n_drugs)
    for name, value in {**positive, "seed": seed, "chunk_cells": chunk_cells}.items():
        arguments.check_int(name, value, minimum=0 if name == "seed" else 1)
    real = isinstance(mean_nnz, numbers.Real) and not isinstance(mean_nnz, bool)
    if not (real and math.isfinite(mean_nnz) and 0 < mean_nnz <= n_genes):
        raise ValueError(
            f"mean_nnz must be a finite number in (0, n_genes={n_genes}], "
            f"got mean_nnz={mean_nnz!r}"
        )
    if compression not in _COMPRESSIONS:
        raise ValueError(
            f"compression must be None, 'gzip' or 'lzf', "
            f"got compression={compression!r}"
        )
    for name, value in (("dense", dense), ("progress", progress)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {name}={value!r}")
    if chunks is not None and chunks != ATLAS_CHUNKS:
        arguments.check_int("chunks", chunks, minimum=1)
    try:
        path = pathlib.Path(path)
    except TypeError:
        raise ValueError(
            f"path must be a str or os.PathLike, got path={path!r}"
        ) from None

    n_cells, n_genes, seed = int(n_cells), int(n_genes), int(seed)
    layout_rng = np.random.default_rng([seed, _model.STREAM_LAYOUT])
    gene_of_rank = layout_rng.permutation(n_genes).astype(np.uint32)
    line_perm = layout_rng.permutation(n_cell_lines)
    drug_perm = layout_rng.permutation(n_drugs)
    obs_rng = np.random.default_rng([seed, _model.STREAM_OBS])
    molecules = _model.molecules_per_cell(obs_rng, n_cells, n_genes, float(mean_nnz))
    obs = _model.make_obs(obs_rng, n_cells, n_plates, line_perm, drug_perm)
    obs["n_counts"] = molecules.astype(np.float32)
    import anndata  # heavy, and only needed to write obs/var

    anndata.AnnData(obs=obs, var=_model.make_var(n_genes)).write_h5ad(path)
    del obs
    length = None
    if not dense:
        length = _model.csr_chunk_length(chunks, compression, n_cells, mean_nnz)
    bar = progress_bar(n_cells, f"write_tahoe_like {path.name}", "cells", progress)
    with bar, h5py.File(path, "a") as f:
        out = _model.XWriter(f, n_cells, n_genes, compression, length)
        for chunk_index, start in enumerate(range(0, n_cells, chunk_cells)):
            stop = min(start + chunk_cells, n_cells)
            rng = np.random.default_rng([seed, _model.STREAM_MOLECULES, chunk_index])
            out.append(*_model.generate_chunk(rng, molecules[start:stop], gene_of_rank))
            bar.update(stop - start)
    return path


def progress_bar(total: int, desc: str, unit: str, enabled: bool) -> tqdm.tqdm:
    """A tqdm bar on stderr (shown only when `enabled`)."""
    return tqdm.tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=True,
        disable=not enabled,
        file=sys.stderr,
    )


# Keyword arguments of write_tahoe_like and their defaults (cache names).
_DEFAULTS = {
    k: p.default
    for k, p in inspect.signature(write_tahoe_like).parameters.items()
    if p.kind is p.KEYWORD_ONLY
}


def cached_tahoe_like(
    n_cells: int, *, cache_dir: str | os.PathLike | None = None, **kwargs
) -> pathlib.Path:
    """Returns a file made by ``write_tahoe_like`` with these arguments.

    Made once per argument set, under a temporary name renamed when complete, and
    reused. The name encodes ``n_cells``, ``n_genes``, ``seed``, the compression
    (``tahoe_like-n400000-g62710-s0-none.h5ad`` at the defaults) and a tag per other
    argument off its default (``-nnz300.0``, ``-dense``, ``-c4096``); no generator
    version: clear the cache after changing the generator. With ``progress=True`` a file
    that must be made is announced on stderr.

    Args:
        n_cells: Number of cells, as for ``write_tahoe_like``.
        cache_dir: Folder of the cache, created if missing. Defaults to
            ``$GRAIN_CELLS_CACHE`` or else ``~/.cache/grain_cells``.
        **kwargs: Any keyword argument of ``write_tahoe_like``.

    Returns:
        The path of the cached file.

    Raises:
        TypeError: If ``kwargs`` holds an unknown argument.
        ValueError: If an argument is invalid (see ``write_tahoe_like``).

    Example:
        >>> p = cached_tahoe_like(10_000, n_genes=5_000, mean_nnz=300)
        >>> p.name
        'tahoe_like-n10000-g5000-s0-none-nnz300.0.h5ad'
    """
    unknown = sorted(set(kwargs) - set(_DEFAULTS))
    if unknown:
        raise TypeError(f"unknown argument(s) for write_tahoe_like: {unknown}")
    args = {**_DEFAULTS, **kwargs}
    arguments.check_int("n_cells", n_cells, minimum=1)
    folder = pathlib.Path(cache_root(xdg=False) if cache_dir is None else cache_dir)
    final = folder.expanduser() / _cache_name(int(n_cells), args)
    announce = (
        f"making synthetic data: {int(n_cells):,} cells x {args['n_genes']:,} "
        f"genes into {final} (once; later runs reuse it)"
    )
    return made_once(
        final,
        lambda tmp: write_tahoe_like(tmp, n_cells, **kwargs),
        announce if args["progress"] else None,
    )


def made_once(final: pathlib.Path, make, announce: str | None, folder=False):
    """`final` (a file, or a `folder`), made once by `make(tmp)` beside it, renamed.

    `announce` is printed on stderr first when it must be made.
    """
    if final.is_dir() if folder else final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    if announce:
        print(announce, file=sys.stderr, flush=True)
    names = {"dir": final.parent, "prefix": f".{final.name}.", "suffix": ".tmp"}
    if folder:
        tmp = pathlib.Path(tempfile.mkdtemp(**names))
    else:
        fd, tmp = tempfile.mkstemp(**names)
        os.close(fd)
        tmp = pathlib.Path(tmp)
    try:
        make(tmp)
        os.replace(tmp, final)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    return final


def _cache_name(n_cells: int, args: dict) -> str:
    parts = ["tahoe_like", f"n{n_cells}", f"g{args['n_genes']}", f"s{args['seed']}"]
    parts.append(str(args["compression"]).lower())
    tags = {
        "mean_nnz": lambda v: f"nnz{float(v)!r}",
        "n_plates": lambda v: f"p{v}",
        "n_cell_lines": lambda v: f"l{v}",
        "n_drugs": lambda v: f"d{v}",
        "dense": lambda v: "dense",
        "chunk_cells": lambda v: f"c{v}",
        "chunks": lambda v: f"k{v}",
    }
    parts += [tag(args[k]) for k, tag in tags.items() if args[k] != _DEFAULTS[k]]
    return "-".join(parts) + ".h5ad"
