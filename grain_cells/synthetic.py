"""Synthetic, Tahoe-100M-shaped single-cell data written as ``.h5ad``.

The files are meant for tests, benchmarks and demos: they look like a plate of
the Tahoe-100M atlas from the point of view of a data loader (cells sorted by
plate, categorical metadata, a sparse CSR count matrix with realistic row
lengths and a skewed gene distribution), but they carry no biology.

Generation model, per cell:

* a target number of distinct genes is drawn from a lognormal distribution
  with mean ``mean_nnz`` (clipped to ``[min(50, mean_nnz / 2), n_genes]``)
  and converted into a number of sequenced molecules ``n_counts`` (at most
  ``8 * n_genes + 64``, which caps the densest rows a little below
  ``n_genes``);
* that many molecules are drawn, with replacement, from a fixed Zipf-like
  (log-uniform over gene rank) distribution over genes, so a few hundred genes
  are seen in most cells, most genes are rare, and popular genes collect counts
  > 1 (values are mostly 1-3 with a long tail);
* duplicates are merged: the row stores each gene once, its value being the
  number of molecules that hit it. ``obs["n_counts"]`` is therefore exactly the
  row sum.

Everything is vectorised per chunk of cells: the molecules of the whole chunk
are drawn at once, keyed by ``row * n_genes + gene``, sorted, deduplicated and
split back into rows; no Python loop runs per cell. The matrix is streamed to
disk chunk by chunk, so memory is bounded by ``chunk_cells`` and never by
``n_cells``.

Example:
    >>> import anndata
    >>> from grain_cells.synthetic import write_tahoe_like
    >>> path = write_tahoe_like("/tmp/demo.h5ad", 1_000, n_genes=2_000,
    ...                         mean_nnz=200)
    >>> adata = anndata.read_h5ad(path)
    >>> adata.shape
    (1000, 2000)
"""

from __future__ import annotations

import math
import numbers
import os
import pathlib
import sys
import tempfile

import h5py
import numpy as np
import pandas as pd
import tqdm

__all__ = ["cached_tahoe_like", "write_tahoe_like"]

# Independent random streams, all derived from the user's seed.
_STREAM_OBS = 0  # per-cell metadata and per-cell molecule counts
_STREAM_LAYOUT = 1  # gene-rank permutation, category frequency permutations
_STREAM_MOLECULES = 2  # gene draws, one sub-stream per write step (chunk)

_ZIPF_OFFSET = 5.0  # flattens the head of the gene-rank distribution
_NNZ_SIGMA = 0.5  # lognormal spread of genes detected per cell
_MIN_NNZ = 50
_MAX_MOLECULES = 2**24  # per cell; keeps n_counts exact in float32
_MAX_MOLECULES_PER_GENE = 8  # and at most this many per gene, plus 64
_CSR_CHUNK = 2**18  # HDF5 chunk (elements) for data/indices, uncompressed
_CSR_CHUNK_COMPRESSED = 2**16  # same, when a compression filter is set
_DENSE_CHUNK_BYTES = 2**20  # target HDF5 chunk size of a compressed dense X
_DENSE_BLOCK_BYTES = 2**26  # densify at most this much of a chunk at a time
_COMPRESSIONS = (None, "gzip", "lzf")
# `chunks="atlas"`: HDF5 chunks as anndata writes them for a file this size.
ATLAS_CHUNKS = "atlas"

_DEFAULTS = {
    "n_genes": 62_710,
    "mean_nnz": 1_600.0,
    "n_plates": 14,
    "n_cell_lines": 50,
    "n_drugs": 380,
    "seed": 0,
    "compression": None,
    "dense": False,
    "chunk_cells": 16_384,
    "chunks": None,
    "progress": False,
}


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

    Cells are sorted by plate: plate ``i`` (0-based) holds cells
    ``[i * n_cells // n_plates, (i + 1) * n_cells // n_plates)``. ``obs`` has
    the categorical columns ``plate`` (``plate_01``, ...), ``cell_line``
    (``CVCL_0001``, ...; a Zipf-like mix inside every plate) and ``drug``
    (``drug_001``, ...; skewed, random per cell), the float32 column
    ``n_counts`` (row sums of X) and the index ``cell_000000000``, ...
    ``var`` is indexed by unique ``ENSG00000000001``-style ids and has a
    ``gene_symbol`` string column.

    X holds integer-valued float32 counts. As CSR (the default) it follows
    anndata's ``csr_matrix`` encoding: group ``X`` with datasets ``data``
    (float32), ``indices`` (int32, sorted and unique within each row) and
    ``indptr`` (int64), all chunked and resizable (``maxshape=(None,)``), with
    HDF5 chunks of 2**18 elements (2**16 when compressed) unless ``chunks``
    says otherwise. ``chunks="atlas"`` gives the chunks anndata writes for a
    file of this size: h5py's guess for a dataset of the full expected length
    (``n_cells * mean_nnz`` values), e.g. 39,063 elements (about 24 cells) at
    400,000 Tahoe-shaped cells, 14,649 at 20,000 cells of 1,500 values.
    With ``dense=True`` X is a 2-D float32 dataset ``(n_cells, n_genes)``
    holding exactly the values the CSR variant would hold for the same
    arguments; it is contiguous
    when ``compression`` is None, otherwise chunked by whole rows with about
    1 MiB per chunk (at most 1024 rows).

    The output is deterministic: the same arguments give identical ``X``,
    ``obs`` and ``var``. Metadata and per-cell counts do not depend on
    ``chunk_cells``, but the gene draws use one random stream per write step,
    so changing ``chunk_cells`` changes which genes each cell holds.

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
            and ``indptr``: None for the defaults above, ``"atlas"`` for
            anndata's (h5py's guess at full size), or an int > 0. Ignored
            with ``dense=True``.
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
    _check_int("n_cells", n_cells, 1)
    _check_int("n_genes", n_genes, 1, 2**31 - 1)
    _check_int("n_plates", n_plates, 1)
    _check_int("n_cell_lines", n_cell_lines, 1)
    _check_int("n_drugs", n_drugs, 1)
    _check_int("seed", seed, 0)
    _check_int("chunk_cells", chunk_cells, 1)
    if (
        isinstance(mean_nnz, bool)
        or not isinstance(mean_nnz, numbers.Real)
        or not math.isfinite(mean_nnz)
        or not 0 < mean_nnz <= n_genes
    ):
        raise ValueError(
            f"mean_nnz must be a finite number in (0, n_genes={n_genes}], "
            f"got mean_nnz={mean_nnz!r}"
        )
    if compression not in _COMPRESSIONS:
        raise ValueError(
            f"compression must be None, 'gzip' or 'lzf', "
            f"got compression={compression!r}"
        )
    if not isinstance(dense, bool):
        raise ValueError(f"dense must be a bool, got dense={dense!r}")
    if chunks is not None and chunks != ATLAS_CHUNKS:
        _check_int("chunks", chunks, 1)
    if not isinstance(progress, bool):
        raise ValueError(f"progress must be a bool, got progress={progress!r}")
    try:
        path = pathlib.Path(path)
    except TypeError:
        raise ValueError(
            f"path must be a str or os.PathLike, got path={path!r}"
        ) from None

    n_cells, n_genes, seed = int(n_cells), int(n_genes), int(seed)
    layout_rng = np.random.default_rng([seed, _STREAM_LAYOUT])
    gene_of_rank = layout_rng.permutation(n_genes).astype(np.uint32)
    line_perm = layout_rng.permutation(n_cell_lines)
    drug_perm = layout_rng.permutation(n_drugs)

    obs_rng = np.random.default_rng([seed, _STREAM_OBS])
    molecules = _molecules_per_cell(obs_rng, n_cells, n_genes, float(mean_nnz))
    obs = _make_obs(
        obs_rng, n_cells, n_plates, n_cell_lines, n_drugs, line_perm, drug_perm
    )
    obs["n_counts"] = molecules.astype(np.float32)
    var = _make_var(n_genes)

    # Lazy import: anndata is heavy and only needed to write obs/var.
    import anndata

    anndata.AnnData(obs=obs, var=var).write_h5ad(path)
    del obs, var

    bar = tqdm.tqdm(
        total=n_cells,
        desc=f"write_tahoe_like {path.name}",
        unit="cells",
        unit_scale=True,
        disable=not progress,
        file=sys.stderr,
    )
    with bar, h5py.File(path, "a") as f:
        if dense:
            out = _DenseWriter(f, n_cells, n_genes, compression)
        else:
            length = _csr_chunk_length(chunks, compression, n_cells, mean_nnz)
            out = _CsrWriter(f, n_cells, n_genes, compression, length)
        for chunk_index, start in enumerate(range(0, n_cells, chunk_cells)):
            stop = min(start + chunk_cells, n_cells)
            rng = np.random.default_rng([seed, _STREAM_MOLECULES, chunk_index])
            indptr, indices, data = _generate_chunk(
                rng, molecules[start:stop], gene_of_rank
            )
            out.append(indptr, indices, data)
            bar.update(stop - start)
    return path


def cached_tahoe_like(
    n_cells: int, *, cache_dir: str | os.PathLike | None = None, **kwargs
) -> pathlib.Path:
    """Returns a file made by ``write_tahoe_like`` with these arguments.

    The file is made once per argument set and reused afterwards. Its name
    encodes every argument that affects its content: always ``n_cells``,
    ``n_genes``, ``seed`` and the compression (defaults give
    ``tahoe_like-n400000-g62710-s0-none.h5ad``), plus a tag for each other
    argument that differs from its default (e.g. ``-nnz300.0``, ``-dense``,
    ``-c4096``). The file is written under a temporary name in the same folder
    and renamed atomically when complete, so an interrupted run never leaves a
    file that looks complete. The name holds no generator version: clear the
    cache after changing the generator.

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
    _check_int("n_cells", n_cells, 1)
    if cache_dir is None:
        cache_dir = os.environ.get("GRAIN_CELLS_CACHE") or (
            pathlib.Path.home() / ".cache" / "grain_cells"
        )
    cache_dir = pathlib.Path(cache_dir).expanduser()
    name = _cache_name(int(n_cells), args)
    final = cache_dir / name
    if final.is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=cache_dir, prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    tmp = pathlib.Path(tmp_name)
    try:
        write_tahoe_like(tmp, n_cells, **kwargs)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


# --------------------------------------------------------------------------- #
# Helpers.
# --------------------------------------------------------------------------- #


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    """Raises ValueError unless ``value`` is an int in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {name}={value!r}")
    if value < low:
        what = "positive" if low == 1 else f">= {low}"
        raise ValueError(f"{name} must be {what}, got {name}={value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {name}={value!r}")


def _cache_name(n_cells: int, args: dict) -> str:
    parts = [
        "tahoe_like",
        f"n{n_cells}",
        f"g{args['n_genes']}",
        f"s{args['seed']}",
        str(args["compression"]).lower(),
    ]
    tags = {
        "mean_nnz": lambda v: f"nnz{float(v)!r}",
        "n_plates": lambda v: f"p{v}",
        "n_cell_lines": lambda v: f"l{v}",
        "n_drugs": lambda v: f"d{v}",
        "dense": lambda v: "dense",
        "chunk_cells": lambda v: f"c{v}",
        "chunks": lambda v: f"k{v}",
    }
    for key, tag in tags.items():
        if args[key] != _DEFAULTS[key]:
            parts.append(tag(args[key]))
    return "-".join(parts) + ".h5ad"


def _rank_probabilities(n_genes: int) -> np.ndarray:
    """Probability of each gene rank under the sampler of ``_draw_ranks``."""
    edges = np.log1p(np.arange(n_genes + 1, dtype=np.float64) / _ZIPF_OFFSET)
    return np.diff(edges) / edges[-1]


def _draw_ranks(rng: np.random.Generator, size: int, n_genes: int) -> np.ndarray:
    """Draws gene ranks from a log-uniform law: rank = x0 * e^(u L) - x0.

    Rank ``k`` has probability ``ln((k + 1 + x0) / (k + x0)) / L`` with
    ``L = ln(1 + n_genes / x0)``, i.e. roughly ``1 / (L (k + x0))``.
    """
    u = rng.random(size, dtype=np.float32)
    u *= np.float32(math.log1p(n_genes / _ZIPF_OFFSET))
    np.exp(u, out=u)
    u -= np.float32(1.0)
    u *= np.float32(_ZIPF_OFFSET)
    ranks = u.astype(np.int32)  # truncation == floor, u >= 0
    np.minimum(ranks, n_genes - 1, out=ranks)
    return ranks


def _molecules_per_cell(
    rng: np.random.Generator, n_cells: int, n_genes: int, mean_nnz: float
) -> np.ndarray:
    """Per-cell molecule counts whose expected distinct genes are lognormal.

    A target number of distinct genes ``t`` is drawn per cell (lognormal with
    mean ``mean_nnz``, clipped to ``[min(50, mean_nnz / 2), n_genes]``) and mapped
    to the number of molecules ``m`` whose expected number of distinct genes
    is ``t``, by interpolating ``E(m) = sum_k 1 - (1 - p_k)^m`` on a geometric
    grid of ``m``.
    """
    p = _rank_probabilities(n_genes)
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


def _generate_chunk(
    rng: np.random.Generator, molecules: np.ndarray, gene_of_rank: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Generates the CSR rows of one chunk of cells.

    Returns:
        ``(indptr, indices, data)`` of the chunk, ``indptr`` starting at 0.
    """
    n_rows = molecules.size
    n_genes = gene_of_rank.size
    total = int(molecules.sum())
    key_dtype = np.uint32 if n_rows * n_genes <= 2**32 else np.uint64

    keys = np.repeat(np.arange(n_rows, dtype=key_dtype) * key_dtype(n_genes), molecules)
    ranks = _draw_ranks(rng, total, n_genes)
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
    row_ends = np.cumsum(molecules)
    indptr = np.zeros(n_rows + 1, dtype=np.int64)
    indptr[1:] = np.searchsorted(starts, row_ends, side="left")
    return indptr, indices, data


def _make_obs(
    rng: np.random.Generator,
    n_cells: int,
    n_plates: int,
    n_cell_lines: int,
    n_drugs: int,
    line_perm: np.ndarray,
    drug_perm: np.ndarray,
) -> pd.DataFrame:
    bounds = np.arange(n_plates + 1, dtype=np.int64) * n_cells // n_plates
    plate = np.repeat(np.arange(n_plates), np.diff(bounds))
    line_w = 1.0 / np.arange(1, n_cell_lines + 1) ** 0.7
    line = line_perm[rng.choice(n_cell_lines, n_cells, p=line_w / line_w.sum())]
    drug_w = 1.0 / np.arange(1, n_drugs + 1) ** 0.6
    drug = drug_perm[rng.choice(n_drugs, n_cells, p=drug_w / drug_w.sum())]
    index = pd.Index(
        np.char.mod("cell_%09d", np.arange(n_cells)).astype(object), dtype=object
    )
    return pd.DataFrame(
        {
            "plate": _categorical(plate, "plate_", n_plates, 2),
            "cell_line": _categorical(line, "CVCL_", n_cell_lines, 4),
            "drug": _categorical(drug, "drug_", n_drugs, 3),
        },
        index=index,
    )


def _categorical(codes: np.ndarray, prefix: str, n: int, width: int):
    width = max(width, len(str(n)))
    names = [f"{prefix}{i:0{width}d}" for i in range(1, n + 1)]
    return pd.Categorical.from_codes(codes, categories=names)


def _make_var(n_genes: int) -> pd.DataFrame:
    ids = np.arange(1, n_genes + 1)
    index = pd.Index(np.char.mod("ENSG%011d", ids).astype(object), dtype=object)
    symbols = np.char.mod("GENE%d", ids).astype(object)
    return pd.DataFrame({"gene_symbol": symbols}, index=index)


def _csr_chunk_length(chunks, compression, n_cells: int, mean_nnz: float) -> int:
    """HDF5 chunk length of the CSR datasets for `write_tahoe_like(chunks=)`."""
    if chunks is None:
        return _CSR_CHUNK if compression is None else _CSR_CHUNK_COMPRESSED
    if chunks != ATLAS_CHUNKS:
        return int(chunks)
    # h5py's own guess (what anndata gets) for a float32 dataset of the full
    # expected length, asked of a throwaway in-memory file: HDF5 allocates
    # chunks lazily, so nothing of that size is made.
    length = max(1, round(n_cells * mean_nnz))
    with h5py.File(
        f"atlas-chunks-{os.getpid()}", "w", driver="core", backing_store=False
    ) as mem:
        probe = mem.create_dataset(
            "probe", (length,), np.float32, maxshape=(None,), chunks=True
        )
        return int(probe.chunks[0])


class _CsrWriter:
    """Streams CSR rows into group ``X`` in anndata's csr_matrix encoding."""

    def __init__(
        self, f: h5py.File, n_cells: int, n_genes: int, compression, chunk: int
    ):
        group = f.create_group("X")
        group.attrs["encoding-type"] = "csr_matrix"
        group.attrs["encoding-version"] = "0.1.0"
        group.attrs["shape"] = np.array([n_cells, n_genes], dtype=np.int64)
        opts = {"maxshape": (None,), "chunks": (chunk,), "compression": compression}
        self.data = group.create_dataset("data", (0,), np.float32, **opts)
        self.indices = group.create_dataset("indices", (0,), np.int32, **opts)
        self.indptr = group.create_dataset("indptr", (1,), np.int64, **opts)
        self.indptr[0] = 0
        self.nnz = 0
        self.rows = 0

    def append(self, indptr, indices, data) -> None:
        nnz, rows = self.nnz + data.size, self.rows + indptr.size - 1
        self.data.resize((nnz,))
        self.data[self.nnz :] = data
        self.indices.resize((nnz,))
        self.indices[self.nnz :] = indices
        self.indptr.resize((rows + 1,))
        self.indptr[self.rows + 1 :] = indptr[1:] + self.nnz
        self.nnz, self.rows = nnz, rows


class _DenseWriter:
    """Writes rows densified from CSR into a 2-D float32 dataset ``X``."""

    def __init__(self, f: h5py.File, n_cells: int, n_genes: int, compression):
        chunks = None
        if compression is not None:
            rows = max(1, min(1024, n_cells, _DENSE_CHUNK_BYTES // (4 * n_genes)))
            chunks = (rows, n_genes)
        self.x = f.create_dataset(
            "X",
            (n_cells, n_genes),
            np.float32,
            chunks=chunks,
            compression=compression,
        )
        self.x.attrs["encoding-type"] = "array"
        self.x.attrs["encoding-version"] = "0.2.0"
        self.n_genes = n_genes
        self.rows = 0

    def append(self, indptr, indices, data) -> None:
        n_rows = indptr.size - 1
        step = max(1, _DENSE_BLOCK_BYTES // (4 * self.n_genes))
        for r0 in range(0, n_rows, step):
            r1 = min(r0 + step, n_rows)
            lo, hi = indptr[r0], indptr[r1]
            block = np.zeros((r1 - r0, self.n_genes), dtype=np.float32)
            rows = np.repeat(np.arange(r1 - r0), np.diff(indptr[r0 : r1 + 1]))
            block[rows, indices[lo:hi]] = data[lo:hi]
            self.x[self.rows + r0 : self.rows + r1] = block
        self.rows += n_rows
