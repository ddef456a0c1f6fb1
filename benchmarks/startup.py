r"""How long grain_cells takes to start, before and after a change, in one run.

Every figure comes from a fresh Python process (a *probe*: this file run
again with `--probe=...`), started with `PYTHONPATH` pointing at the tree
being measured, so that each tree's imports, worker start and numba cache
are measured as a user meets them. With `--baseline=PATH` every probe runs
on both trees, alternating, on the same files and machine state.

Probes (each repeated `--repeats` times, in fresh processes):

* `first_inline`, `first_workers`: `import grain_cells`, then the time from
  `grain_cells.DataLoader(...)` to its first minibatch, with 0 and
  `--workers` worker processes (block 16, fetch 16, batch 64, CSR + one obs
  column). The worker figure is mostly process start: each spawned worker
  imports Python, NumPy, h5py, Grain (with JAX) and grain_cells.
* `iterators`: `--iterators` iterators of one loader (0 workers, batch 8 x
  fetch 4) made, advanced once and dropped; total seconds and CPU seconds.
  This is what every new iterator pays before its first minibatch (issue
  27, item 7).
* `tokens_cold`, `tokens_cached`: the first rank-value token minibatch (0
  workers) with an empty numba cache (`NUMBA_CACHE_DIR`, a new folder: the
  kernels compile) and then with the cache that run filled (they load).
  `tokens_workers` (not run by default): the same with `--workers`
  workers, both starting on an empty cache (`*_cpu_s` of the trainer and
  its workers once every worker has formatted minibatches): they compile
  once, or each compile, depending on the tree.
* `main_command` (only with `--main_command`): the README's first command,
  `python -m grain_cells.examples.train --workdir=...`, in a new workdir and
  a new synthetic-data folder, so it makes its data too; seconds to its
  first line of output, to its first `step` line and to the end, and CPU
  seconds of the command and its children.

Each record of the JSON file (`--json`) is one probe run::

    {"tree": "after" | "before", "probe": "first_workers", "repeat": 0,
     "path": ".../grain_cells/__init__.py", "import_s": 1.2, "first_s": 2.1,
     "cpu_s": 3.4, "load_avg": 1.9, ...}

with the figures of that probe (seconds; `*_cpu_s` is CPU time of the
process and its children, less sensitive to other processes than wall
time), and a `summary` list of medians per (tree, probe, figure).

Wall-clock figures depend on the machine's load (the 1-minute load average
is recorded beside each); compare trees only within one run.

Usage:
  python benchmarks/startup.py                            # this tree only
  git worktree add /tmp/base c95fdd4
  python benchmarks/startup.py --baseline=/tmp/base --main_command \
      --json=startup.json
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_HERE = os.path.dirname(os.path.abspath(__file__))
_TREE = os.path.dirname(_HERE)

_BASELINE = flags.DEFINE_string(
    "baseline",
    None,
    "Another checkout of grain_cells (e.g. `git worktree add /tmp/base "
    "c95fdd4`): every probe also runs with PYTHONPATH pointing at it, "
    "recorded as tree 'before'.",
)
_PROBES = flags.DEFINE_list(
    "probes",
    ["first_inline", "first_workers", "iterators", "tokens"],
    "Probes to run (see the module docstring): first_inline, first_workers, "
    "iterators, tokens (cold and cached), tokens_workers (cold and cached, "
    "with --workers workers). --main_command adds main_command.",
)
_MAIN = flags.DEFINE_bool(
    "main_command",
    False,
    "Also time the README's first command (data making and a full training "
    "run: about half a minute to a few minutes per tree).",
)
_REPEATS = flags.DEFINE_integer(
    "repeats", 3, "Fresh-process runs per probe and tree (main command: once)."
)
_WORKERS = flags.DEFINE_integer("workers", 2, "Worker processes of first_workers.")
_ITERATORS = flags.DEFINE_integer(
    "iterators", 1_000, "Iterators made and dropped by the iterators probe."
)
_N_CELLS = flags.DEFINE_integer(
    "n_cells", 100_000, "Cells of the synthetic file the probes read."
)
_N_GENES = flags.DEFINE_integer("n_genes", 2_000, "Genes of that file.")
_MEAN_NNZ = flags.DEFINE_float("mean_nnz", 300.0, "Stored values per cell.")
_CACHE_DIR = flags.DEFINE_string(
    "cache_dir",
    None,
    "Folder of the synthetic file (made once; default: a temporary folder "
    "removed at the end).",
)
_JSON = flags.DEFINE_string("json", None, "Write every record and the medians here.")
_FLAG_NAMES = (
    "baseline",
    "probes",
    "main_command",
    "repeats",
    "workers",
    "iterators",
    "n_cells",
    "n_genes",
    "mean_nnz",
)
# Internal: one probe in this process (set by the parent run).
_PROBE = flags.DEFINE_string("probe", None, "Internal: run one probe and print JSON.")
_DATA = flags.DEFINE_string("data", None, "Internal: the probe's .h5ad file.")


def _load_avg() -> float:
    return os.getloadavg()[0]


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


# ----------------------------------------------------------------- probes
# They run in a fresh process and use only the public API that both trees
# have, so that `--baseline` can measure an older checkout.


def _probe_first(path: str, workers: int) -> dict:
    t0 = time.perf_counter()
    import grain_cells

    t1, c1 = time.perf_counter(), bench_cpu_with_children()
    source = grain_cells.AnnDataSource([path], block_size=16, obs_columns=["plate"])
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=0),
        operations=grain_cells.fetch_operations(source, batch_size=64),
        worker_count=workers,
    )
    iterator = iter(loader)
    next(iterator)
    t2 = time.perf_counter()
    cpu_first = bench_cpu_with_children() - c1
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
    return {
        "path": grain_cells.__file__,
        "workers": workers,
        "import_s": t1 - t0,
        "first_s": t2 - t1,
        "first_cpu_s": cpu_first,
    }


def bench_cpu_with_children() -> float:
    """CPU seconds of this process and its live children (workers)."""
    sys.path.insert(0, _HERE)
    import bench_util

    return bench_util.cpu_seconds()


def _probe_iterators(path: str, count: int) -> dict:
    import grain_cells

    source = grain_cells.AnnDataSource([path], block_size=16)
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=0),
        operations=grain_cells.fetch_operations(source, batch_size=8, fetch_factor=4),
        worker_count=0,
    )
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(count):
        iterator = iter(loader)
        next(iterator)
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
        del iterator
    return {
        "path": grain_cells.__file__,
        "iterators": count,
        "total_s": time.perf_counter() - t0,
        "total_cpu_s": time.process_time() - c0,
        "per_iterator_ms": 1e3 * (time.perf_counter() - t0) / count,
    }


def _probe_tokens(path: str, workers: int = 0) -> dict:
    import grain_cells

    source = grain_cells.AnnDataSource([path], block_size=16, obs_columns=["plate"])
    vocab = grain_cells.tokens.GeneVocabulary.from_genes(source.var_names)
    stats = grain_cells.tokens.corpus_stats(source)
    output = grain_cells.tokens.RankValueTokens.for_source(
        source, vocab, stats, length=64, kernels="numba"
    )
    c0, t0 = bench_cpu_with_children(), time.perf_counter()
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=0),
        operations=grain_cells.fetch_operations(source, batch_size=64, output=output),
        worker_count=workers,
    )
    iterator = iter(loader)
    next(iterator)
    first_s = time.perf_counter() - t0
    if workers:  # both workers have formatted (compiled or loaded) by now
        for _ in range(2 * 16 * workers):
            next(iterator)
    record = {
        "path": grain_cells.__file__,
        "workers": workers,
        "numba_cache_dir": os.environ.get("NUMBA_CACHE_DIR"),
        "first_s": first_s,
        "first_cpu_s": bench_cpu_with_children() - c0,
    }
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
    return record


def _run_probe(name: str, path: str) -> dict:
    from absl import flags as absl_flags

    absl_flags.FLAGS.mark_as_parsed()  # Grain's workers read an absl flag
    if name == "first_inline":
        return _probe_first(path, 0)
    if name == "first_workers":
        return _probe_first(path, _WORKERS.value)
    if name == "iterators":
        return _probe_iterators(path, _ITERATORS.value)
    if name == "tokens":
        return _probe_tokens(path)
    if name == "tokens_workers":
        return _probe_tokens(path, _WORKERS.value)
    raise app.UsageError(f"unknown --probe={name!r}")


# ----------------------------------------------------------------- parent


def _env(tree: str, **extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = tree
    env.update(extra)
    return env


def _spawn_probe(tree: str, name: str, path: str, **env) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        f"--probe={name}",
        f"--data={path}",
        f"--workers={_WORKERS.value}",
        f"--iterators={_ITERATORS.value}",
    ]
    load = _load_avg()
    t0 = time.perf_counter()
    done = subprocess.run(
        cmd, env=_env(tree, **env), capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"probe {name} in {tree} failed:\n{done.stderr[-3000:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    record.update(process_s=wall, load_avg=load)
    return record


def _main_command(tree: str, scratch: str) -> dict:
    """The README's first command in a new workdir and data folder."""
    workdir = tempfile.mkdtemp(prefix="run-", dir=scratch)
    data_dir = tempfile.mkdtemp(prefix="data-", dir=scratch)
    cmd = [
        sys.executable,
        "-m",
        "grain_cells.examples.train",
        f"--workdir={workdir}",
        f"--config.synthetic_dir={data_dir}",
    ]
    load = _load_avg()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    first_output = first_step = None
    proc = subprocess.Popen(
        cmd,
        env=_env(tree, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=scratch,
    )
    tail = []
    line = b""
    while True:
        byte = proc.stdout.read(1)
        if not byte:
            break
        if first_output is None:
            first_output = time.perf_counter() - t0
        if byte in (b"\n", b"\r"):
            text = line.decode(errors="replace")
            if first_step is None and text.startswith("step "):
                first_step = time.perf_counter() - t0
            if text.strip():
                tail = [*tail[-20:], text]
            line = b""
        else:
            line += byte
    proc.wait()
    total = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"main command in {tree} failed:\n" + "\n".join(tail))
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.rmtree(data_dir, ignore_errors=True)
    return {
        "first_output_s": first_output,
        "first_step_line_s": first_step,
        "total_s": total,
        "total_cpu_s": cpu,
        "last_line": tail[-1] if tail else "",
        "load_avg": load,
    }


def _summary(records: list[dict]) -> list[dict]:
    groups: dict[tuple, dict[str, list[float]]] = {}
    for r in records:
        figures = groups.setdefault((r["tree"], r["probe"]), {})
        for key, value in r.items():
            if key.endswith(("_s", "_ms")) and isinstance(value, int | float):
                figures.setdefault(key, []).append(value)
    return [
        {"tree": tree, "probe": probe}
        | {k: statistics.median(v) for k, v in sorted(figures.items())}
        for (tree, probe), figures in sorted(groups.items())
    ]


def _print_summary(rows: list[dict]) -> None:
    for row in rows:
        figures = ", ".join(
            f"{k}={v:.3g}" for k, v in row.items() if k not in ("tree", "probe")
        )
        print(f"{row['tree']:>6} {row['probe']:<14} {figures}", flush=True)


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _PROBE.value:
        print(json.dumps(_run_probe(_PROBE.value, _DATA.value)))
        return
    trees = [("after", _TREE)]
    if _BASELINE.value:
        trees.append(("before", os.path.abspath(_BASELINE.value)))
    scratch = tempfile.mkdtemp(prefix="grain_cells_startup-")
    cache_dir = _CACHE_DIR.value or os.path.join(scratch, "data")
    try:
        sys.path.insert(0, _TREE)
        from grain_cells.synthetic import cached_tahoe_like

        path = str(
            cached_tahoe_like(
                _N_CELLS.value,
                n_genes=_N_GENES.value,
                mean_nnz=_MEAN_NNZ.value,
                cache_dir=cache_dir,
            )
        )
        records = []
        for name in _PROBES.value:
            for repeat in range(_REPEATS.value):
                for tree, where in trees:
                    if name in ("tokens", "tokens_workers"):
                        numba_dir = tempfile.mkdtemp(prefix="numba-", dir=scratch)
                        for probe in (f"{name}_cold", f"{name}_cached"):
                            r = _spawn_probe(
                                where, name, path, NUMBA_CACHE_DIR=numba_dir
                            )
                            records.append(
                                {"tree": tree, "probe": probe, "repeat": repeat} | r
                            )
                            print(json.dumps(records[-1]), flush=True)
                        continue
                    r = _spawn_probe(where, name, path)
                    records.append({"tree": tree, "probe": name, "repeat": repeat} | r)
                    print(json.dumps(records[-1]), flush=True)
        if _MAIN.value:
            for tree, where in trees:
                r = _main_command(where, scratch)
                records.append({"tree": tree, "probe": "main_command", "repeat": 0} | r)
                print(json.dumps(records[-1]), flush=True)
        rows = _summary(records)
        _print_summary(rows)
        if _JSON.value:
            with open(_JSON.value, "w") as f:
                json.dump(
                    {
                        "flags": {
                            name: flags.FLAGS[name].value for name in _FLAG_NAMES
                        },
                        "file": path,
                        "records": records,
                        "summary": rows,
                    },
                    f,
                    indent=2,
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
