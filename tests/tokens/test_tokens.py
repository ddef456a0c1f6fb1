"""Token outputs, vocabularies and corpus statistics against per-cell references.

Files are written by anndata: integer counts 1 to 4 (many ties), every
seventh cell all zero, cells from 0 to 40 expressed genes over 40 genes, of
which the vocabulary (a text file, in a shuffled order) lacks 5. Expected
sequences come from straightforward per-cell implementations of the
published definitions, on the matrix `anndata.read_h5ad` returns.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import warnings

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells._util import counter_rng
from grain_cells.outputs import Fetch
from grain_cells.tokens._base import IGNORE

N_GENES = 40
SIZES = (150, 90)
IN_VOCAB = 35


def _write(directory) -> list[str]:
    rng = np.random.default_rng(3)
    paths, offset = [], 0
    for f, n in enumerate(SIZES):
        density = rng.random((n, 1))
        x = rng.integers(1, 5, (n, N_GENES)) * (rng.random((n, N_GENES)) < density)
        rows = np.arange(offset, offset + n)
        x[rows % 7 == 0] = 0
        x[rows % 11 == 1, :3] = 4  # ties at the top
        adata = anndata.AnnData(
            X=sp.csr_matrix(x.astype(np.float32)),
            obs=pd.DataFrame({"idx": rows}, index=[f"c{r}" for r in rows]),
            var=pd.DataFrame(index=[f"g{j}" for j in range(N_GENES)]),
        )
        path = str(directory / f"tok{f}.h5ad")
        adata.write_h5ad(path)
        paths.append(path)
        offset += n
    return paths


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokens")
    paths = _write(directory)
    genes = [f"g{j}" for j in np.random.default_rng(5).permutation(N_GENES)]
    vocab_path = directory / "vocab.txt"
    vocab_path.write_text("\n".join(genes[:IN_VOCAB]) + "\n")
    x = np.concatenate([anndata.read_h5ad(p).X.toarray() for p in paths])
    return paths, str(vocab_path), x


@pytest.fixture(scope="module")
def parts(files, tmp_path_factory):
    paths, vocab_path, x = files
    source = grain_cells.AnnDataSource(paths, block_size=4)
    vocab = grain_cells.tokens.GeneVocabulary.load(vocab_path)
    stats = grain_cells.tokens.corpus_stats(
        source, method="exact", cache=False, progress=False
    )
    return source, vocab, stats, x


# -- references from the published definitions ---------------------------------


def ref_medians(x, target_sum=1e4):
    totals = x.astype(np.float64).sum(axis=1)
    norm = x / np.where(totals > 0, totals, 1)[:, None] * target_sum
    return np.array(
        [
            np.median(norm[x[:, j] > 0, j]) if (x[:, j] > 0).any() else np.nan
            for j in range(x.shape[1])
        ]
    )


def vocab_ids(vocab, n_genes=N_GENES):
    mapped = vocab.map_genes([f"g{j}" for j in range(n_genes)])
    return mapped.tokens.tolist()


def ref_rank_value(x_row, ids, medians, length, pad, cls, eos):
    genes = [j for j in range(len(x_row)) if x_row[j] > 0 and ids[j] >= 0]
    score = {j: np.float32(x_row[j]) / np.float32(medians[j]) for j in genes}
    genes.sort(key=lambda j: (-score[j], ids[j]))
    seq = [cls] + [ids[j] for j in genes[: length - 2]] + [eos]
    return seq + [pad] * (length - len(seq)), len(seq)


def ref_value_bins(
    x_row,
    ids,
    *,
    length,
    n_bins,
    pad,
    cls,
    selection,
    key,
    row_id,
    pad_zeros=False,
    pad_value=-2,
):
    genes = [j for j in range(len(x_row)) if x_row[j] > 0 and ids[j] >= 0]
    bins = {}
    if genes:
        values = x_row[genes].astype(np.float32)
        edges = np.quantile(values, np.linspace(0, 1, n_bins - 1))
        bins = dict(zip(genes, np.digitize(values, edges), strict=True))
    if selection == "top":
        genes.sort(key=lambda j: (-x_row[j], ids[j]))
    else:
        genes.sort(
            key=lambda j: (
                counter_rng.hash64_int(key, row_id, ids[j]) >> 16,
                -x_row[j],
                ids[j],
            )
        )
    genes = genes[: length - 1]
    seq = [cls] + [ids[j] for j in genes]
    val = [0] + [int(bins[j]) for j in genes]
    if pad_zeros:
        vocab = [t for t in ids if t >= 0]
        expressed = {ids[j] for j in range(len(x_row)) if x_row[j] > 0 and ids[j] >= 0}
        need = min(length - len(seq), len(vocab) - len(expressed))
        extra, j = [], 0
        while len(extra) < need:
            h = counter_rng.hash64_int(key, row_id, (1 << 40) + j)
            t = vocab[h % len(vocab)]
            j += 1
            if t not in expressed and t not in extra:
                extra.append(t)
        seq += extra
        val += [0] * len(extra)
    n = len(seq)
    return seq + [pad] * (length - n), val + [pad_value] * (length - n), n


def fetch_of(source, rows, key=99):
    cells = source.read(rows)
    x = cells.X.tocsr()
    csr = grain_cells.outputs._formats.CsrRows(
        x.data, x.indices, x.indptr.astype(np.int64), x.shape[1]
    )
    return Fetch(None, cells.row_ids, source.num_genes, key=key, _csr=csr)


# -- vocabulary and statistics ----------------------------------------------------


def test_vocabulary_from_file_honoured(files, tmp_path):
    _, vocab_path, _ = files
    vocab = grain_cells.tokens.GeneVocabulary.load(vocab_path)
    with open(vocab_path) as f:
        genes = f.read().split()
    assert [vocab.special(r) for r in ("pad", "cls", "eos", "mask")] == [0, 1, 2, 3]
    assert [vocab[g] for g in genes] == list(range(4, 4 + IN_VOCAB))
    mapped = vocab.map_genes([f"g{j}" for j in range(N_GENES)])
    assert mapped.num_dropped == N_GENES - IN_VOCAB
    assert set(mapped.dropped) == {f"g{j}" for j in range(N_GENES)} - set(genes)
    # A JSON token dictionary keeps its own ids.
    table = {"<pad>": 7, "<cls>": 3, "<eos>": 5, "<mask>": 1, "g0": 100, "g1": 11}
    (tmp_path / "v.json").write_text(json.dumps(table))
    loaded = grain_cells.tokens.GeneVocabulary.load(tmp_path / "v.json")
    assert loaded["g0"] == 100 and loaded.special("pad") == 7 and len(loaded) == 101
    assert loaded.map_genes(["g1", "g9", "g0"]).tokens.tolist() == [11, -1, 100]
    del table["<pad>"]
    (tmp_path / "w.json").write_text(json.dumps(table))
    with pytest.raises(ValueError, match=r"w\.json.*pad"):
        grain_cells.tokens.GeneVocabulary.load(tmp_path / "w.json")


def test_corpus_stats_exact(parts):
    source, _, stats, x = parts
    np.testing.assert_array_equal(stats.var_names, source.var_names)
    np.testing.assert_allclose(stats.nonzero_median, ref_medians(x), rtol=1e-12)
    np.testing.assert_array_equal(stats.nonzero_count, (x > 0).sum(axis=0))
    np.testing.assert_allclose(stats.total, x.sum(axis=0))
    assert stats.num_cells == sum(SIZES) and stats.method == "exact"


def test_corpus_stats_histogram_error_bound(parts):
    source, _, _, x = parts
    stats = grain_cells.tokens.corpus_stats(
        source, method="histogram", cache=False, progress=False
    )
    ref = ref_medians(x)
    rel = np.abs(stats.nonzero_median / ref - 1)
    assert np.nanmax(rel) <= 2 ** (1 / 64) - 1


def test_corpus_stats_cache(files, tmp_path, monkeypatch):
    paths, _, _ = files
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path))
    source = grain_cells.AnnDataSource(paths, block_size=4)
    first = grain_cells.tokens.corpus_stats(source, progress=False)
    cached = list(tmp_path.glob("grain_cells-corpus-stats-*.npz"))
    assert len(cached) == 1
    # Reused: a run that cannot compute (reads fail) still gets the figures.
    module = importlib.import_module("grain_cells.tokens._corpus_stats")
    monkeypatch.setattr(module, "_compute", lambda *a: 1 / 0)
    again = grain_cells.tokens.corpus_stats(
        grain_cells.AnnDataSource(paths, block_size=4)
    )
    np.testing.assert_array_equal(again.nonzero_median, first.nonzero_median)
    # Another selection of cells is other data: a new key.
    view = source.select(np.arange(100))
    with pytest.raises(ZeroDivisionError):
        grain_cells.tokens.corpus_stats(view, progress=False)


# -- outputs on random cells ------------------------------------------------------


@pytest.mark.parametrize("full_vocabulary", [False, True], ids=["dropped", "all"])
@pytest.mark.parametrize("length", [6, 12, 48])
def test_rank_value_equals_reference(parts, length, full_vocabulary):
    source, vocab, stats, x = parts
    if full_vocabulary:  # every gene in the vocabulary: the fast path
        vocab = grain_cells.tokens.GeneVocabulary.from_genes(source.var_names[::-1])
    out = grain_cells.tokens.RankValueTokens.for_source(
        source, vocab, stats, length=length
    )
    rows = np.random.default_rng(length).choice(sum(SIZES), 64, replace=False)
    rows[:3] = [0, 1, 12]  # all-zero, tied top genes, tied
    batch = out.format(fetch_of(source, rows), np.arange(64), 70)
    ids = vocab_ids(vocab)
    medians = stats.nonzero_median
    for i, r in enumerate(rows):
        seq, n = ref_rank_value(x[r], ids, medians, length, 0, 1, 2)
        assert batch["gene_ids"][i].tolist() == seq, f"row {r}"
        assert batch["attention_mask"][i].tolist() == [k < n for k in range(length)]
        expressed = (x[r] > 0) & (np.array(ids) >= 0)
        assert batch["n_expressed"][i] == expressed.sum()
        assert batch["n_dropped"][i] == ((x[r] > 0) & (np.array(ids) < 0)).sum()
    assert (batch["gene_ids"][64:] == 0).all() and not batch["attention_mask"][
        64:
    ].any()
    assert batch["gene_ids"].shape == (70, length)


KERNELS = [
    "numpy",
    pytest.param(
        "numba",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("numba") is None, reason="numba"
        ),
    ),
]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("threads", [1, 2])
def test_rank_value_counts_out_of_vocabulary_and_no_median_apart(
    parts, kernels, threads
):
    """`n_dropped` counts a cell's positive values of genes outside the
    vocabulary (as `VocabularyMap.num_dropped` and `ValueBinTokens` do);
    `n_no_median` those of vocabulary genes whose median is missing (corpus
    statistics of other cells). Neither is tokenised."""
    source, vocab, stats, x = parts
    ids = np.array(vocab_ids(vocab))
    medians = stats.nonzero_median.copy()
    in_vocab = np.flatnonzero(ids >= 0)
    medians[in_vocab[::3]] = np.nan  # a third of the vocabulary: no median
    medians[in_vocab[1::7]] = 0.0
    out = grain_cells.tokens.RankValueTokens(
        ids, medians, length=12, cls_id=1, eos_id=2, kernels=kernels, threads=threads
    )
    no_median = (ids >= 0) & ~(np.isfinite(medians) & (medians > 0))
    assert out.num_without_median == no_median.sum() > 0
    rows = np.arange(64)
    fetch = fetch_of(source, rows)
    fetch.order = rows
    batch = out.format(fetch, rows, 64)
    positive = x[rows] > 0
    want_dropped = (positive & (ids < 0)).sum(axis=1)
    want_no_median = (positive & no_median).sum(axis=1)
    assert (want_dropped > 0).any() and (want_no_median > 0).any()
    np.testing.assert_array_equal(batch["n_dropped"], want_dropped)
    np.testing.assert_array_equal(batch["n_no_median"], want_no_median)
    np.testing.assert_array_equal(
        batch["n_expressed"], (positive & (ids >= 0) & ~no_median).sum(axis=1)
    )
    # A padded minibatch: the padding rows count nothing.
    short = out.format(fetch, rows[:10], 16)
    np.testing.assert_array_equal(short["n_dropped"][:10], want_dropped[:10])
    np.testing.assert_array_equal(short["n_no_median"][:10], want_no_median[:10])
    assert not short["n_dropped"][10:].any() and not short["n_no_median"][10:].any()


@pytest.mark.parametrize("pad_zeros", [False, True], ids=["no-zeros", "zeros"])
@pytest.mark.parametrize("selection", ["top", "random"])
@pytest.mark.parametrize("length", [5, 30])
def test_value_bins_equal_reference(parts, selection, pad_zeros, length):
    source, vocab, _, x = parts
    n_bins = 7
    out = grain_cells.tokens.ValueBinTokens.for_source(
        source,
        vocab,
        length=length,
        n_bins=n_bins,
        selection=selection,
        pad_zeros=pad_zeros,
    )
    rows = np.random.default_rng(length).choice(sum(SIZES), 64, replace=False)
    rows[:3] = [0, 1, 12]
    batch = out.format(fetch_of(source, rows, key=1234), np.arange(64), 64)
    ids = vocab_ids(vocab)
    for i, r in enumerate(rows):
        seq, val, n = ref_value_bins(
            x[r],
            ids,
            length=length,
            n_bins=n_bins,
            pad=0,
            cls=1,
            selection=selection,
            key=1234,
            row_id=int(r),
            pad_zeros=pad_zeros,
        )
        assert batch["gene_ids"][i].tolist() == seq, f"row {r}"
        assert batch["values"][i].tolist() == val, f"row {r}"
        assert batch["attention_mask"][i].sum() == n


def test_mlm_masks_gene_positions_only(parts):
    source, vocab, stats, _ = parts
    rows = np.arange(64)
    plain = grain_cells.tokens.RankValueTokens.for_source(
        source, vocab, stats, length=30
    )
    masked = grain_cells.tokens.RankValueTokens.for_source(
        source, vocab, stats, length=30, mlm_probability=0.3
    )
    a = plain.format(fetch_of(source, rows), rows, 64)
    b = masked.format(fetch_of(source, rows), rows, 64)
    hit = b["gene_ids"] != a["gene_ids"]
    assert (b["gene_ids"][hit] == vocab.special("mask")).all()
    np.testing.assert_array_equal(b["labels"][hit], a["gene_ids"][hit])
    assert (b["labels"][~hit] == IGNORE).all()
    genes = a["attention_mask"] & (a["gene_ids"] > 3)
    assert not (hit & ~genes).any()
    assert 0.2 < hit.sum() / genes.sum() < 0.4
    # The same fetch key gives the same masks; another key others.
    c = masked.format(fetch_of(source, rows), rows, 64)
    d = masked.format(fetch_of(source, rows, key=5), rows, 64)
    np.testing.assert_array_equal(b["gene_ids"], c["gene_ids"])
    assert (b["gene_ids"] != d["gene_ids"]).any()


def test_bad_arguments(parts):
    source, vocab, stats, _ = parts
    with pytest.raises(ValueError, match="length=2 leaves no room"):
        grain_cells.tokens.RankValueTokens.for_source(source, vocab, stats, length=2)
    with pytest.raises(ValueError, match="selection"):
        grain_cells.tokens.ValueBinTokens.for_source(source, vocab, selection="best")
    with pytest.raises(ValueError, match="n_bins"):
        grain_cells.tokens.ValueBinTokens.for_source(source, vocab, n_bins=2)


# -- through the loader -----------------------------------------------------------


def _loader(parts, output, workers, seed=0):
    source = parts[0]
    return grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=seed),
        operations=grain_cells.fetch_operations(
            source, batch_size=8, fetch_factor=4, output=output, seed=seed
        ),
        worker_count=workers,
    )


WORKERS = [0, pytest.param(2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("workers", WORKERS)
def test_tokens_through_loader(parts, helpers, workers):
    source, vocab, stats, x = parts
    rank = grain_cells.tokens.RankValueTokens.for_source(
        source, vocab, stats, length=16
    )
    ids = vocab_ids(vocab)
    seen = []
    for batch in helpers.run(_loader(parts, rank, workers)):
        for i, r in enumerate(batch["row_ids"]):
            if r < 0:
                assert not batch["attention_mask"][i].any()
                continue
            seq, _ = ref_rank_value(x[r], ids, stats.nonzero_median, 16, 0, 1, 2)
            assert batch["gene_ids"][i].tolist() == seq
            seen.append(r)
    assert sorted(seen) == list(range(sum(SIZES)))
    bins = grain_cells.tokens.ValueBinTokens.for_source(
        source, vocab, length=10, n_bins=5
    )
    for batch in helpers.run(_loader(parts, bins, workers), 6):
        for i, r in enumerate(batch["row_ids"]):
            if r < 0:
                continue
            seq, val, _ = ref_value_bins(
                x[r],
                ids,
                length=10,
                n_bins=5,
                pad=0,
                cls=1,
                selection="top",
                key=0,
                row_id=int(r),
            )
            assert batch["gene_ids"][i].tolist() == seq
            assert batch["values"][i].tolist() == val


@pytest.mark.parametrize("workers", WORKERS)
def test_random_tokens_resume_exactly(parts, helpers, workers):
    source, vocab, _, _ = parts
    output = grain_cells.tokens.ValueBinTokens.for_source(
        source,
        vocab,
        length=12,
        n_bins=5,
        selection="random",
        pad_zeros=True,
        mlm_probability=0.2,
    )
    loader = _loader(parts, output, workers, seed=3)
    everything = helpers.run(loader)
    # Inside the second fetch, and at its end (one point with workers: each
    # restore starts them anew).
    for stop in (3, 6) if workers == 0 else (3,):
        loader.set_epoch(0)  # each iter() is the next epoch: the same one again
        iterator = iter(loader)
        helpers.take(iterator, stop)
        state = iterator.get_state()
        helpers.close_iterator(iterator)
        restored = iter(_loader(parts, output, workers, seed=3))
        restored.set_state(state)
        rest = helpers.take(restored)
        helpers.close_iterator(restored)
        assert len(rest) == len(everything) - stop
        for got, want in zip(rest, everything[stop:], strict=True):
            for k in want:
                np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # Draws depend on the epoch's fetches: another seed, other samples.
    other = helpers.run(_loader(parts, output, 0, seed=4), 1)[0]
    assert not np.array_equal(other["gene_ids"], everything[0]["gene_ids"])


@pytest.mark.parametrize("join", ["inner", "outer"])
def test_token_ids_stable_across_files_and_joins(tmp_path, join):
    """Files listing genes in other orders (and other genes) give one id per name."""
    rng = np.random.default_rng(11)
    names = [[f"g{j}" for j in range(10)], [f"g{j}" for j in range(12)][::-1]]
    paths, dense = [], []
    for f, genes in enumerate(names):
        x = rng.integers(0, 4, (30, len(genes))).astype(np.float32)
        x[::5] = 0
        adata = anndata.AnnData(
            X=sp.csr_matrix(x),
            var=pd.DataFrame(index=genes),
            obs=pd.DataFrame(index=[f"f{f}c{i}" for i in range(30)]),
        )
        path = str(tmp_path / f"j{f}.h5ad")
        adata.write_h5ad(path)
        paths.append(path)
        dense.append(anndata.read_h5ad(path).to_df())
    source = grain_cells.AnnDataSource(paths, block_size=5, join=join)
    vocab = grain_cells.tokens.GeneVocabulary.from_genes(
        [f"g{j}" for j in range(12)][::-1]
    )
    out = grain_cells.tokens.ValueBinTokens.for_source(
        source, vocab, length=14, n_bins=4
    )
    rows = np.arange(60)
    batch = out.format(fetch_of(source, rows), rows, 60)
    for r in rows:
        df = dense[r // 30]
        cell = df.iloc[r % 30]
        cell = cell[[g for g in cell.index if g in set(source.var_names)]]
        genes = sorted(
            (g for g in cell.index if cell[g] > 0), key=lambda g: (-cell[g], vocab[g])
        )
        expected = [vocab.special("cls")] + [vocab[g] for g in genes]
        got = batch["gene_ids"][r][: len(expected)].tolist()
        assert got == expected, (join, r)
        assert batch["attention_mask"][r].sum() == len(expected)


# -- the statistics' cache ----------------------------------------------------------


def _write_counts(path, *, dense: bool) -> None:
    """2,000 cells x 20 genes, ~20,000 stored values (more than the 8,192
    first and last values an earlier cache key hashed)."""
    rng = np.random.default_rng(0)
    n, g = 2000, 20
    values = (np.arange(n)[:, None] % 7 + np.arange(g)[None, :] + 1).astype(np.float32)
    x = np.where(rng.random((n, g)) < 0.5, values, np.float32(0))
    anndata.AnnData(
        x if dense else sp.csr_matrix(x),
        var=pd.DataFrame(index=[f"g{j}" for j in range(g)]),
    ).write_h5ad(path)


@pytest.mark.parametrize("dense", [False, True], ids=["csr", "dense"])
def test_corpus_stats_cache_notices_values_rewritten_in_place(
    tmp_path, monkeypatch, dense
):
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "a.h5ad"
    _write_counts(path, dense=dense)
    stats = grain_cells.tokens.corpus_stats
    before = stats(grain_cells.AnnDataSource(path), progress=False)
    # Same shape and sparsity, other values in the middle of X (even genes
    # tripled, so normalised values change too).
    with h5py.File(path, "r+") as f:
        if dense:
            x = f["X"][900:1100]
            x[:, ::2] *= 3
            f["X"][900:1100] = x
        else:
            data, indices = f["X/data"], f["X/indices"][:]
            lo, hi = data.shape[0] // 3, 2 * data.shape[0] // 3
            part = data[lo:hi]
            part[indices[lo:hi] % 2 == 0] *= 3
            data[lo:hi] = part
    fresh = stats(grain_cells.AnnDataSource(path), progress=False, cache=False)
    assert not np.array_equal(fresh.nonzero_median, before.nonzero_median)
    again = stats(grain_cells.AnnDataSource(path), progress=False)
    np.testing.assert_array_equal(again.nonzero_median, fresh.nonzero_median)


def test_corpus_stats_cache_goes_to_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("GRAIN_CELLS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    data = tmp_path / "data"
    data.mkdir()
    _write_counts(data / "a.h5ad", dense=False)
    grain_cells.tokens.corpus_stats(
        grain_cells.AnnDataSource(data / "a.h5ad"), progress=False
    )
    assert sorted(p.name for p in data.iterdir()) == ["a.h5ad"]
    assert len(list((tmp_path / "xdg" / "grain_cells").glob("*.npz"))) == 1


def test_repeated_gene_names_are_refused_by_name(tmp_path, monkeypatch):
    # Two columns named "dup" used to share one median and put "dup"'s token
    # twice into a cell's sequence (issue 27, item 2).
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))
    names = [f"g{j}" for j in range(20)]
    names[3] = names[17] = "dup"
    x = sp.csr_matrix(np.arange(1, 401, dtype=np.float32).reshape(20, 20))
    with warnings.catch_warnings():
        # anndata warns of the repeated names (from another module in 0.13).
        warnings.simplefilter("ignore", UserWarning)
        adata = anndata.AnnData(x, var=pd.DataFrame(index=names))
        adata.write_h5ad(tmp_path / "d.h5ad")
        source = grain_cells.AnnDataSource(tmp_path / "d.h5ad", block_size=4)
    stats = grain_cells.tokens.corpus_stats(source, progress=False)
    vocab = grain_cells.tokens.GeneVocabulary.from_genes(sorted(set(names)))
    for build in (
        lambda: grain_cells.tokens.RankValueTokens.for_source(source, vocab, stats),
        lambda: grain_cells.tokens.ValueBinTokens.for_source(source, vocab),
        lambda: stats.medians_for(source.var_names),
    ):
        with pytest.raises(grain_cells.errors.GeneMismatchError) as e:
            build()
        assert "'dup'" in str(e.value) and "3" in str(e.value) and "17" in str(e.value)
