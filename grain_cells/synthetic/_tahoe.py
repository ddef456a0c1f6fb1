"""Synthetic, Tahoe-100M-shaped `.h5ad` files and their generation model.

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
import pandas as pd
import tqdm

from grain_cells._util import arguments
from grain_cells._util.cache_files import cache_root
from grain_cells.synthetic._thin import (
    ATLAS_CHUNKS,
    XWriter,
    check_compression,
    csr_chunk_length,
)

# Independent random streams, all derived from the user's seed.
STREAM_OBS = 0  # per-cell metadata and per-cell molecule counts
STREAM_LAYOUT = 1  # gene-rank permutation, category frequency permutations
STREAM_MOLECULES = 2  # gene draws, one sub-stream per write step (chunk)
_ZIPF_OFFSET = 5.0  # flattens the head of the gene-rank distribution
_NNZ_SIGMA = 0.5  # lognormal spread of genes detected per cell
_MIN_NNZ = 50
_MAX_MOLECULES = 2**24  # per cell; keeps n_counts exact in float32
_MAX_MOLECULES_PER_GENE = 8  # and at most this many per gene, plus 64


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
    n_plates)``. ``obs``: the categoricals ``plate`` (``plate_01``, ...),
    ``cell_line`` (``CVCL_0001``, ...; Zipf-like in every plate) and ``drug``
    (``drug_001``, ...; skewed), the float32 ``n_counts`` (row sums of X), the
    index ``cell_000000000``, ...; ``var``: ``ENSG00000000001``-style ids and a
    ``gene_symbol`` column. X holds integer-valued float32 counts as anndata's
    ``csr_matrix`` (int32 ``indices`` sorted per row, int64 ``indptr``), or
    with ``dense=True`` a 2-D dataset (chunked by whole rows when compressed).
    The same arguments give the same X, obs and var; ``chunk_cells`` changes which
    genes each cell holds, not obs, var or the counts.

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
    check_compression(compression)
    arguments.check_bool("dense", dense)
    arguments.check_bool("progress", progress)
    if chunks is not None and chunks != ATLAS_CHUNKS:
        arguments.check_int("chunks", chunks, minimum=1)
    try:
        path = pathlib.Path(path)
    except TypeError:
        raise ValueError(
            f"path must be a str or os.PathLike, got path={path!r}"
        ) from None
    n_cells, n_genes, seed = int(n_cells), int(n_genes), int(seed)
    layout_rng = np.random.default_rng([seed, STREAM_LAYOUT])
    gene_of_rank = layout_rng.permutation(n_genes).astype(np.uint32)
    line_perm = layout_rng.permutation(n_cell_lines)
    drug_perm = layout_rng.permutation(n_drugs)
    obs_rng = np.random.default_rng([seed, STREAM_OBS])
    molecules = molecules_per_cell(obs_rng, n_cells, n_genes, float(mean_nnz))
    obs = make_obs(obs_rng, n_cells, n_plates, line_perm, drug_perm)
    obs["n_counts"] = molecules.astype(np.float32)
    import anndata  # heavy, and only needed to write obs/var

    anndata.AnnData(obs=obs, var=make_var(n_genes)).write_h5ad(path)
    del obs
    length = None if dense else csr_chunk_length(chunks, compression, n_cells, mean_nnz)
    bar = progress_bar(n_cells, f"write_tahoe_like {path.name}", "cells", progress)
    with bar, h5py.File(path, "a") as f:
        out = XWriter(f, n_cells, n_genes, compression, length)
        for chunk_index, start in enumerate(range(0, n_cells, chunk_cells)):
            stop = min(start + chunk_cells, n_cells)
            rng = np.random.default_rng([seed, STREAM_MOLECULES, chunk_index])
            out.append(*generate_chunk(rng, molecules[start:stop], gene_of_rank))
            bar.update(stop - start)
    return path


def progress_bar(total: int, desc: str, unit: str, enabled: bool) -> tqdm.tqdm:
    """A tqdm bar on stderr (shown only when `enabled`)."""
    options = {"unit_scale": True, "disable": not enabled, "file": sys.stderr}
    return tqdm.tqdm(total=total, desc=desc, unit=unit, **options)


# Keyword arguments of write_tahoe_like and their defaults (cache names).
_DEFAULTS = {
    k: p.default
    for k, p in inspect.signature(write_tahoe_like).parameters.items()
    if p.kind is p.KEYWORD_ONLY
}


def cached_tahoe_like(
    n_cells: int, *, cache_dir: str | os.PathLike | None = None, **kwargs
) -> pathlib.Path:
    """Returns a file made by ``write_tahoe_like(path, n_cells, **kwargs)``, made once.

    Made under a temporary name renamed when complete, and reused. The name encodes
    ``n_cells``, ``n_genes``, ``seed``, the compression and a tag per other argument
    off its default (``tahoe_like-n10000-g5000-s0-none-nnz300.0.h5ad``; ``-dense``,
    ``-c4096``); no generator version: clear the cache after changing the generator.
    ``cache_dir`` (created if missing) defaults to ``$GRAIN_CELLS_CACHE`` or else
    ``~/.cache/grain_cells``. With ``progress=True`` a file that must be made is
    announced on stderr. Raises ``TypeError`` for an unknown argument and
    ``ValueError`` for an invalid one (see ``write_tahoe_like``).
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
    """`final` (a file or `folder`) made once by `make(tmp)` beside it, `announce`d."""
    if final.is_dir() if folder else final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    if announce:
        print(announce, file=sys.stderr, flush=True)
    names = {"dir": final.parent, "prefix": f".{final.name}.", "suffix": ".tmp"}
    work = pathlib.Path(tempfile.mkdtemp(**names))  # a file is made inside it
    try:
        tmp = work if folder else work / final.name
        make(tmp)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def _cache_name(n_cells: int, args: dict) -> str:
    parts = ["tahoe_like", f"n{n_cells}", f"g{args['n_genes']}", f"s{args['seed']}"]
    parts.append(str(args["compression"]).lower())
    shown = {**args, "mean_nnz": repr(float(args["mean_nnz"])), "dense": ""}
    tags = dict(mean_nnz="nnz", n_plates="p", n_cell_lines="l", n_drugs="d")
    tags.update(dense="dense", chunk_cells="c", chunks="k")
    parts += [f"{t}{shown[k]}" for k, t in tags.items() if args[k] != _DEFAULTS[k]]
    return "-".join(parts) + ".h5ad"


def molecules_per_cell(
    rng: np.random.Generator, n_cells: int, n_genes: int, mean_nnz: float
) -> np.ndarray:
    """Per-cell molecule counts whose expected distinct genes are lognormal.

    A target `t` maps to the `m` with `sum_k 1 - (1 - p_k)^m = t` (interpolated).
    """
    edges = np.log1p(np.arange(n_genes + 1, dtype=np.float64) / _ZIPF_OFFSET)
    p = np.diff(edges) / edges[-1]  # of each gene rank, as drawn by `generate_chunk`
    log_miss = np.log1p(-np.minimum(p, 1.0 - 1e-16))
    most = min(_MAX_MOLECULES, _MAX_MOLECULES_PER_GENE * n_genes + 64)
    grid = np.unique(np.rint(np.geomspace(1, most, 600)))
    expected = np.empty(grid.size)
    step = max(1, 2**22 // n_genes)
    for i in range(0, grid.size, step):
        block = grid[i : i + step, None] * log_miss[None, :]
        expected[i : i + step] = -np.expm1(block).sum(axis=1)
    expected = np.maximum.accumulate(expected)  # guard against rounding
    sigma = _NNZ_SIGMA
    target = rng.lognormal(math.log(mean_nnz) - sigma**2 / 2, sigma, n_cells)
    np.clip(target, min(_MIN_NNZ, mean_nnz / 2), n_genes, out=target)
    np.minimum(target, expected[-1], out=target)
    molecules = np.rint(np.interp(target, expected, grid))
    return np.maximum(molecules, 1).astype(np.int64)


def generate_chunk(
    rng: np.random.Generator, molecules: np.ndarray, gene_of_rank: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The CSR rows `(indptr from 0, indices, data)` of one chunk of cells."""
    n_rows = molecules.size
    n_genes = gene_of_rank.size
    total = int(molecules.sum())
    key_dtype = np.uint32 if n_rows * n_genes <= 2**32 else np.uint64
    keys = np.repeat(np.arange(n_rows, dtype=key_dtype) * key_dtype(n_genes), molecules)
    # Gene ranks `x0 * e^(u L) - x0` (`L = ln(1 + n_genes / x0)`, u uniform).
    u = rng.random(total, dtype=np.float32)
    u *= np.float32(math.log1p(n_genes / _ZIPF_OFFSET))
    np.exp(u, out=u)
    u -= np.float32(1.0)
    u *= np.float32(_ZIPF_OFFSET)
    ranks = u.astype(np.int32)  # truncation == floor, u >= 0
    del u
    np.minimum(ranks, n_genes - 1, out=ranks)
    keys += gene_of_rank[ranks].astype(key_dtype, copy=False)
    del ranks
    keys.sort()  # rows occupy disjoint key ranges: sorts by (row, gene)
    first = np.empty(total, dtype=bool)
    first[:1] = True
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    del first
    data = np.empty(starts.size, dtype=np.float32)
    np.subtract(starts[1:], starts[:-1], out=data[:-1], casting="unsafe")
    data[-1:] = total - starts[-1:]
    unique = keys[starts]
    del keys
    indices = (unique % key_dtype(n_genes)).astype(np.int32)
    del unique
    indptr = np.zeros(n_rows + 1, dtype=np.int64)
    indptr[1:] = np.searchsorted(starts, np.cumsum(molecules), side="left")
    return indptr, indices, data


def make_obs(
    rng: np.random.Generator, n_cells: int, n_plates: int, line_perm, drug_perm
) -> pd.DataFrame:
    """Obs of `n_cells` plate-sorted cells: plate, cell_line and drug labels.

    Cell lines and drugs are Zipf-like over their permuted codes (`*_perm`).
    """
    bounds = np.arange(n_plates + 1, dtype=np.int64) * n_cells // n_plates
    columns = {"plate": (np.repeat(np.arange(n_plates), np.diff(bounds)), n_plates)}
    for name, perm, power in (("cell_line", line_perm, 0.7), ("drug", drug_perm, 0.6)):
        w = 1.0 / np.arange(1, perm.size + 1) ** power
        columns[name] = (perm[rng.choice(perm.size, n_cells, p=w / w.sum())], perm.size)
    frame = {}
    for (name, (codes, n)), (prefix, width) in zip(
        columns.items(), (("plate_", 2), ("CVCL_", 4), ("drug_", 3)), strict=True
    ):
        width = max(width, len(str(n)))
        names = [f"{prefix}{i:0{width}d}" for i in range(1, n + 1)]
        frame[name] = pd.Categorical.from_codes(codes, categories=names)
    index = np.char.mod("cell_%09d", np.arange(n_cells)).astype(object)
    return pd.DataFrame(frame, index=pd.Index(index, dtype=object))


def make_var(n_genes: int) -> pd.DataFrame:
    """Var indexed by ENSG-style ids, with a gene_symbol column."""
    ids = np.arange(1, n_genes + 1)
    index = pd.Index(np.char.mod("ENSG%011d", ids).astype(object), dtype=object)
    return pd.DataFrame(
        {"gene_symbol": np.char.mod("GENE%d", ids).astype(object)}, index=index
    )
