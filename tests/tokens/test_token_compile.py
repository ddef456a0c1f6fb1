"""The first compile of the token kernels: announced, locked, cached.

A fake dispatcher (the attributes `announced` reads from numba's) checks the
logic quickly; one slow test starts two processes together on an empty
numba cache (`NUMBA_CACHE_DIR`) and checks that the kernels compile once,
that a third process loads them silently, and that all three give the NumPy
kernels' tokens for a file written by anndata.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import types

import anndata
import numpy as np
import pytest
import scipy.sparse

from grain_cells.tokens import _threads as _compile


class _FakeKernel:
    """What `announced` uses of a numba dispatcher; counts its calls."""

    def __init__(self, folder: str, name: str = "kernel_rows"):
        self.stats = types.SimpleNamespace(cache_path=folder)
        self.folder = folder
        self.name = name
        self.calls = 0

        def py_func(*args):
            return args

        py_func.__name__ = name
        self.py_func = py_func

    def __call__(self, *args):
        self.calls += 1
        # What numba's cache does on a compile: write the kernel's index.
        open(os.path.join(self.folder, f"_jit.{self.name}-12.py311.nbi"), "w").close()
        return sum(args)


def _compile_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "token kernels" in r.getMessage()]


def test_first_compile_is_announced_once(tmp_path, caplog):
    kernel = _FakeKernel(str(tmp_path))
    call = _compile.announced(kernel)
    assert not _compile.is_cached(kernel)
    with caplog.at_level(logging.WARNING, logger="grain_cells"):
        assert call(1, 2) == 3
        assert call(3, 4) == 7
    lines = _compile_lines(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith("compiling token kernels")
    assert str(tmp_path) in lines[0]
    assert lines[1].startswith("token kernels compiled in")
    assert kernel.calls == 2
    assert _compile.is_cached(kernel)
    assert (tmp_path / _compile._LOCK_NAME).exists()


def test_cached_kernel_loads_silently(tmp_path, caplog):
    (tmp_path / "_jit.kernel_rows-12.py311.nbi").touch()
    kernel = _FakeKernel(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="grain_cells"):
        assert _compile.announced(kernel)(5, 6) == 11
    assert _compile_lines(caplog) == []
    assert not (tmp_path / _compile._LOCK_NAME).exists()  # no lock taken


def test_other_kernels_index_does_not_count(tmp_path):
    (tmp_path / "_jit.other_rows-12.py311.nbi").touch()
    assert not _compile.is_cached(_FakeKernel(str(tmp_path)))


def test_real_kernels_are_wrapped():
    pytest.importorskip("numba")
    from grain_cells.tokens import _jit as token_jit

    for kernel in (token_jit.encode_rows,):
        assert kernel.dispatcher.stats.cache_path  # numba's folder is known


_SCRIPT = textwrap.dedent(
    """
    import hashlib, sys
    import grain_cells
    from absl import flags
    flags.FLAGS.mark_as_parsed()
    source = grain_cells.AnnDataSource(sys.argv[1], block_size=4)
    vocab = grain_cells.tokens.GeneVocabulary.from_genes(source.var_names)
    stats = grain_cells.tokens.corpus_stats(source)
    digest = []
    for kernels in ("numba", "numpy"):
        out = grain_cells.tokens.RankValueTokens.for_source(
            source, vocab, stats, length=16, kernels=kernels)
        loader = grain_cells.DataLoader(
            data_source=source,
            sampler=grain_cells.BlockSampler(len(source), seed=0),
            operations=grain_cells.fetch_operations(
                source, batch_size=8, output=out),
            worker_count=0)
        batch = next(iter(loader))
        digest.append(hashlib.sha1(batch["gene_ids"].tobytes()).hexdigest())
    print("DIGEST", *digest)
    """
)


@pytest.mark.slow
def test_processes_compile_once_then_load(tmp_path):
    pytest.importorskip("numba")
    rows, genes = 64, 40
    x = np.zeros((rows, genes), np.float32)
    for i in range(rows):  # row i: genes i % 7 .. with counts encoding i
        x[i, np.arange(i % 7, genes, 3)] = 1 + (i + np.arange(0, genes - i % 7, 3)) % 5
    path = tmp_path / "cells.h5ad"
    anndata.AnnData(scipy.sparse.csr_matrix(x)).write_h5ad(path)
    script = tmp_path / "encode.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))

    def start():
        return subprocess.Popen(
            [sys.executable, str(script), str(path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    together = [start(), start()]
    outputs = [p.communicate(timeout=300) for p in together]
    later = start().communicate(timeout=300)
    logs = [err for _, err in [*outputs, later]]
    compiles = sum(err.count("compiling token kernels") for err in logs)
    assert compiles == 1, logs
    assert "compiling token kernels" not in later[1]
    digests = {out.split("DIGEST")[1].split()[0] for out, _ in [*outputs, later]}
    numpy_digests = {out.split("DIGEST")[1].split()[1] for out, _ in [*outputs, later]}
    assert digests == numpy_digests and len(digests) == 1
