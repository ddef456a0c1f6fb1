"""The generation model of synthetic Tahoe-shaped cells (design notes: synthetic-tahoe).

Lognormal distinct genes per cell, Zipf-like gene ranks, plate-sorted obs.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

# Independent random streams, all derived from the user's seed.
STREAM_OBS = 0  # per-cell metadata and per-cell molecule counts
STREAM_LAYOUT = 1  # gene-rank permutation, category frequency permutations
STREAM_MOLECULES = 2  # gene draws, one sub-stream per write step (chunk)
_ZIPF_OFFSET = 5.0  # flattens the head of the gene-rank distribution
_NNZ_SIGMA = 0.5  # lognormal spread of genes detected per cell
_MIN_NNZ = 50
_MAX_MOLECULES = 2**24  # per cell; keeps n_counts exact in float32
_MAX_MOLECULES_PER_GENE = 8  # and at most this many per gene, plus 64


def rank_probabilities(n_genes: int) -> np.ndarray:
    """Probability of each gene rank under the sampler of ``draw_ranks``."""
    edges = np.log1p(np.arange(n_genes + 1, dtype=np.float64) / _ZIPF_OFFSET)
    return np.diff(edges) / edges[-1]


def draw_ranks(rng: np.random.Generator, size: int, n_genes: int) -> np.ndarray:
    """Gene ranks `x0 * e^(u L) - x0` (`L = ln(1 + n_genes / x0)`, u uniform)."""
    u = rng.random(size, dtype=np.float32)
    u *= np.float32(math.log1p(n_genes / _ZIPF_OFFSET))
    np.exp(u, out=u)
    u -= np.float32(1.0)
    u *= np.float32(_ZIPF_OFFSET)
    ranks = u.astype(np.int32)  # truncation == floor, u >= 0
    np.minimum(ranks, n_genes - 1, out=ranks)
    return ranks


def molecules_per_cell(
    rng: np.random.Generator, n_cells: int, n_genes: int, mean_nnz: float
) -> np.ndarray:
    """Per-cell molecule counts whose expected distinct genes are lognormal.

    A target `t` maps to the `m` with `sum_k 1 - (1 - p_k)^m = t` (interpolated).
    """
    p = rank_probabilities(n_genes)
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
    ranks = draw_ranks(rng, total, n_genes)
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


def make_obs(
    rng: np.random.Generator,
    n_cells: int,
    n_plates: int,
    n_cell_lines: int,
    n_drugs: int,
    line_perm: np.ndarray,
    drug_perm: np.ndarray,
) -> pd.DataFrame:
    """Obs of `n_cells` plate-sorted cells: plate, cell_line and drug labels."""
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


def make_var(n_genes: int) -> pd.DataFrame:
    """Var indexed by ENSG-style ids, with a gene_symbol column."""
    ids = np.arange(1, n_genes + 1)
    index = pd.Index(np.char.mod("ENSG%011d", ids).astype(object), dtype=object)
    symbols = np.char.mod("GENE%d", ids).astype(object)
    return pd.DataFrame({"gene_symbol": symbols}, index=index)
