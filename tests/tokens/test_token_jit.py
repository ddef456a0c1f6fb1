"""The compiled token kernels (numba) against the NumPy kernels, bit for bit.

Both paths of `RankValueTokens` and `ValueBinTokens` run on random fetches
built to hit every branch of the compiled sort and binning: integer counts
(many ties, most values 1), continuous values, all-zero cells, stored zeros
and negative values (and fetches without them, all genes in the vocabulary:
the kernels' unchecked loop), cells longer than the sequence, genes outside
the vocabulary, a vocabulary in reverse column order (ties arrive against
token order, past the insertion budget) and duplicate columns in a row. The
NumPy path is itself checked against per-cell references in
`tests/test_tokens.py`.
"""

from __future__ import annotations

import pathlib
import sys
import zlib

import numpy as np
import pytest

import grain_cells
from grain_cells.io._matrix import CsrRows
from grain_cells.outputs import Fetch

pytest.importorskip("numba")

N_GENES = 300


def _fetch(seed: int, *, kind: str, n_rows: int = 96) -> Fetch:
    """A random fetch; row `i` has about `i * 4` stored values, some rows long."""
    rng = np.random.default_rng(seed)
    data, indices, lengths = [], [], []
    for i in range(n_rows):
        n = 0 if i % 9 == 0 else int(rng.integers(0, min(N_GENES, 4 * i + 2)))
        if i % 17 == 5:
            n = N_GENES  # longer than any sequence below
        cols = np.sort(rng.choice(N_GENES, n, replace=False))
        if i % 23 == 7 and n > 2:
            cols[1] = cols[0]  # a duplicate column
        if kind in ("counts", "positive"):
            v = rng.geometric(0.6, n).astype(np.float32)  # mostly 1, ties
        else:
            v = rng.lognormal(0, 1, n).astype(np.float32)
            v[rng.random(n) < 0.3] = 1.0
        if kind != "positive":  # "positive": the kernels' branch-free key loop
            v[rng.random(n) < 0.05] = 0.0  # stored zeros
            v[rng.random(n) < 0.02] = -1.0  # negative values are not expressed
        if i % 13 == 3:
            v[:] = 2.0  # all tied
        data.append(v)
        indices.append(cols.astype(np.int32))
        lengths.append(n)
    indptr = np.zeros(n_rows + 1, np.int64)
    np.cumsum(lengths, out=indptr[1:])
    csr = CsrRows(np.concatenate(data), np.concatenate(indices), indptr, N_GENES)
    row_ids = rng.choice(10**6, n_rows, replace=False)
    return Fetch(None, row_ids, N_GENES, key=seed * 7919, _csr=csr)


def _tokens(vocabulary: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tokens = np.arange(4, 4 + N_GENES, dtype=np.int32)
    if vocabulary == "reversed":
        tokens = tokens[::-1].copy()
    elif vocabulary == "shuffled":
        tokens = rng.permutation(tokens)
    if vocabulary != "full":
        tokens[rng.random(N_GENES) < 0.1] = -1  # genes outside the vocabulary
    return tokens


def _medians(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    levels = rng.lognormal(0, 1, 12).astype(np.float32)  # few distinct medians
    medians = levels[rng.integers(0, levels.size, N_GENES)]
    medians[rng.random(N_GENES) < 0.03] = np.nan  # no median: dropped
    return medians


def _assert_same(make, fetch):
    """tokenize() and format() (a full and a short minibatch) agree."""
    numpy_out, numba_out = make("numpy"), make("numba")
    pairs = [(numpy_out.tokenize(fetch), numba_out.tokenize(fetch))]
    order = np.random.default_rng(fetch.key).permutation(fetch.row_ids.size)
    for rows, batch_size in [(order[:32], 32), (order[32:50], 24)]:
        pairs.append(
            (
                numpy_out.format(fetch, rows, batch_size),
                numba_out.format(fetch, rows, batch_size),
            )
        )
    for expected, got in pairs:
        assert sorted(got) == sorted(expected)
        for name, a in expected.items():
            np.testing.assert_array_equal(got[name], a, err_msg=name)
            assert got[name].dtype == a.dtype, name


VOCABULARIES = ["full", "ordered", "reversed", "shuffled"]


@pytest.mark.parametrize("kind", ["counts", "continuous", "positive"])
@pytest.mark.parametrize("vocabulary", VOCABULARIES)
@pytest.mark.parametrize(
    ("length", "cls", "eos", "mlm"),
    [(48, 1, 2, 0.0), (301, -1, -1, 0.0), (120, 1, -1, 0.2), (3, -1, 2, 0.0)],
    ids=["cls-eos", "long-plain", "cls-mlm", "short-eos"],
)
def test_rank_value_compiled_equals_numpy(kind, vocabulary, length, cls, eos, mlm):
    seed = zlib.crc32(f"{kind}{vocabulary}{length}".encode()) % 1000
    fetch = _fetch(seed, kind=kind)
    tokens, medians = _tokens(vocabulary, seed), _medians(seed)

    def make(kernels):
        return grain_cells.tokens.RankValueTokens(
            tokens,
            medians,
            length=length,
            pad_id=0,
            cls_id=cls,
            eos_id=eos,
            mask_id=3,
            mlm_probability=mlm,
            kernels=kernels,
        )

    _assert_same(make, fetch)


@pytest.mark.parametrize("kind", ["counts", "continuous", "positive"])
@pytest.mark.parametrize("vocabulary", VOCABULARIES)
@pytest.mark.parametrize(
    ("length", "n_bins", "cls", "pad_zeros", "mlm"),
    [
        (48, 51, 1, False, 0.0),
        (301, 7, -1, False, 0.0),
        (120, 11, 1, True, 0.0),
        (64, 3, 1, True, 0.25),
    ],
    ids=["cls", "long-plain", "zeros", "zeros-mlm"],
)
def test_value_bins_compiled_equal_numpy(
    kind, vocabulary, length, n_bins, cls, pad_zeros, mlm
):
    seed = zlib.crc32(f"{kind}{vocabulary}{length}bins".encode()) % 1000
    fetch = _fetch(seed, kind=kind)
    tokens = _tokens(vocabulary, seed)

    def make(kernels):
        return grain_cells.tokens.ValueBinTokens(
            tokens,
            length=length,
            n_bins=n_bins,
            pad_zeros=pad_zeros,
            pad_id=0,
            cls_id=cls,
            mlm_probability=mlm,
            kernels=kernels,
        )

    _assert_same(make, fetch)


def _rows_fetch(rows: list[tuple[np.ndarray, np.ndarray]], key: int) -> Fetch:
    """A fetch of the given (columns, values) rows."""
    indptr = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([c.size for c, _ in rows], out=indptr[1:])
    csr = CsrRows(
        np.concatenate([v for _, v in rows]).astype(np.float32),
        np.concatenate([c for c, _ in rows]).astype(np.int32),
        indptr,
        N_GENES,
    )
    return Fetch(None, np.arange(len(rows)), N_GENES, key=key, _csr=csr)


@pytest.mark.parametrize("vocabulary", ["full", "reversed", "shuffled"])
@pytest.mark.parametrize("length", [16, 301])
def test_value_bins_smallest_value_last(vocabulary, length):
    """The value-bin kernel's split of a row's smallest value, row by row.

    Rows of 64 values or more (the split's threshold) whose smallest value
    is: all of the row (nothing else to sort), most of it, one entry, ties
    with a duplicate column; and a row of 63 values (the plain sort), an
    all-zero cell and a cell with fewer genes than the sequence.
    """
    rng = np.random.default_rng(5)
    cols = np.arange(0, 2 * 100, 2)  # 100 columns, in order
    ones = np.ones(100)
    mostly = np.where(rng.random(100) < 0.8, 1.0, rng.integers(2, 9, 100))
    one_min = np.full(100, 3.0)
    one_min[57] = 1.0
    dup_cols = cols.copy()
    dup_cols[10] = dup_cols[9]
    rows = [
        (cols, ones),
        (cols, mostly),
        (cols, one_min),
        (dup_cols, mostly),
        (cols[:63], mostly[:63]),
        (cols[:0], ones[:0]),
        (cols[:5], mostly[:5]),
        (cols + 1, 0.5 * mostly),  # smallest value not 1
    ]
    fetch = _rows_fetch(rows * 12, key=11)
    tokens = _tokens(vocabulary, 3)

    def make(kernels):
        return grain_cells.tokens.ValueBinTokens(
            tokens, length=length, n_bins=11, pad_id=0, cls_id=1, kernels=kernels
        )

    _assert_same(make, fetch)


def test_empty_fetch_and_bad_kernels():
    fetch = Fetch(
        None,
        np.zeros(0, np.int64),
        N_GENES,
        _csr=CsrRows(
            np.zeros(0, np.float32),
            np.zeros(0, np.int32),
            np.zeros(1, np.int64),
            N_GENES,
        ),
    )
    tokens = _tokens("full", 0)
    out = grain_cells.tokens.ValueBinTokens(tokens, length=8, kernels="numba")
    assert out.tokenize(fetch)["gene_ids"].shape == (0, 8)
    with pytest.raises(ValueError, match="kernels="):
        grain_cells.tokens.ValueBinTokens(tokens, kernels="c")


def test_without_numba_auto_falls_back(monkeypatch):
    import grain_cells.tokens._base as tokens_module

    fetch = _fetch(11, kind="counts")
    compiled = grain_cells.tokens.RankValueTokens(_tokens("ordered", 11), _medians(11))
    expected = compiled.tokenize(fetch)
    monkeypatch.setattr(tokens_module, "numba_available", lambda: False)
    fallback = grain_cells.tokens.RankValueTokens(_tokens("ordered", 11), _medians(11))
    assert not fallback._compiled()
    got = fallback.tokenize(fetch)
    for name, a in expected.items():
        np.testing.assert_array_equal(got[name], a, err_msg=name)
    with pytest.raises(ImportError, match=r"grain_cells\[tokens\]"):
        grain_cells.tokens.ValueBinTokens(_tokens("full", 0), kernels="numba")


def _threaded_outputs(tokens, medians, mlm_probability: float) -> dict:
    """Both outputs (specials, masking) as functions of `threads`."""
    return {
        "rank_value": lambda threads: grain_cells.tokens.RankValueTokens(
            tokens,
            medians,
            length=60,
            cls_id=1,
            eos_id=2,
            mask_id=3,
            mlm_probability=mlm_probability,
            threads=threads,
        ),
        "value_bin": lambda threads: grain_cells.tokens.ValueBinTokens(
            tokens,
            length=60,
            n_bins=11,
            cls_id=1,
            mlm_probability=mlm_probability,
            threads=threads,
        ),
    }


@pytest.mark.parametrize("kind", ["counts", "positive"])
def test_threads_give_the_arrays_of_one_thread(kind):
    """Minibatches split over 3 threads (a slice of padding rows, an empty
    one) equal one thread's, for both outputs, with masking."""
    fetch = _fetch(5, kind=kind)
    tokens, medians = _tokens("ordered", 5), _medians(5)
    makers = _threaded_outputs(tokens, medians, 0.2)
    order = np.random.default_rng(5).permutation(fetch.row_ids.size)
    for name, make in makers.items():
        one, three = make(1), make(3)
        assert (one.threads, three.threads) == (1, 3)
        for rows, batch_size in [(order[:64], 64), (order[64:90], 64), (order[:0], 48)]:
            expected = one.format(fetch, rows, batch_size)
            got = three.format(fetch, rows, batch_size)
            assert sorted(got) == sorted(expected), name
            for key, a in expected.items():
                np.testing.assert_array_equal(got[key], a, err_msg=f"{name} {key}")
        np.testing.assert_array_equal(
            three.tokenize(fetch)["gene_ids"], one.tokenize(fetch)["gene_ids"]
        )


def test_threads_argument(monkeypatch):
    import multiprocessing

    tokens = _tokens("full", 0)
    for bad in (0, -1, 1.5, "many", True):
        with pytest.raises(ValueError, match="threads"):
            grain_cells.tokens.ValueBinTokens(tokens, threads=bad)
    assert 1 <= grain_cells.tokens.ValueBinTokens(tokens).threads <= 4
    # In a Grain worker (a child process) "auto" is one thread.
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    assert grain_cells.tokens.ValueBinTokens(tokens).threads == 1
    assert grain_cells.tokens.ValueBinTokens(tokens, threads=2).threads == 2


@pytest.mark.parametrize("mlm", [0.0, 0.2])
def test_whole_fetch_encoding_gives_the_minibatches_of_one_thread(mlm):
    """With `fetch.order` set (as `SplitFetch` sets it) and 2 threads, the
    whole fetch is encoded at its first minibatch; each minibatch, asked in
    any order and twice, equals one thread's per-minibatch arrays, and the
    padded remainder and rows off the order fall back to the minibatch's
    own encoding."""
    fetch = _fetch(8, kind="counts", n_rows=150)
    tokens, medians = _tokens("ordered", 8), _medians(8)
    order = np.random.default_rng(8).permutation(fetch.row_ids.size)[:140]
    fetch.order = order
    makers = _threaded_outputs(tokens, medians, mlm)
    m = 32
    slices = [(a, min(a + m, order.size)) for a in range(0, order.size, m)]
    for name, make in makers.items():
        one, two = make(1), make(2)
        plain = Fetch(None, fetch.row_ids, N_GENES, key=fetch.key, _csr=fetch.csr)
        for a, b in [*slices[::-1], slices[1], (3, 3 + m)]:
            rows = order[a:b]
            expected = one.format(plain, rows, m)
            got = two.format(fetch, rows, m)
            assert sorted(got) == sorted(expected), name
            for key, arr in expected.items():
                np.testing.assert_array_equal(got[key], arr, err_msg=f"{name} {key}")
        assert ("whole_fetch", id(two)) in fetch.cache
        assert ("whole_fetch", id(one)) not in plain.cache


@pytest.mark.parametrize("kind", ["counts", "continuous", "positive"])
@pytest.mark.parametrize("sort", [False, True], ids=["keys", "keys+sort"])
def test_key_steps_make_a_key_per_expressed_gene(kind, sort):
    """`rank_value_key_steps` (benchmarks/token_kernels.py) does the kernel's work."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
    from token_kernels import rank_value_key_steps

    fetch = _fetch(3, kind=kind)
    csr = fetch.csr
    tokens, medians = _tokens("partial", 3), _medians(3)
    data = np.ascontiguousarray(csr.data, np.float32)
    made = rank_value_key_steps(
        data, csr.indices, csr.indptr, tokens, medians, True, sort
    )
    expressed = (data > 0) & (tokens[csr.indices] >= 0)
    assert made == int(expressed.sum())
