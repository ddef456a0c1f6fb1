r"""The trainer process's CPU per minibatch, and the ceiling in cells/s it implies.

With worker processes, the trainer's own process only receives minibatches:
whatever CPU it spends per minibatch is the serial part of the loader, which
no number of workers (or cores) removes. So `1e6 / (CPU µs per minibatch) *
batch_size` is the most cells/s any host can reach with this loader, and it is
measurable on a small machine: CPU time of one process does not depend on how
many other processes share the cores.

Each measurement runs in a fresh child process (so that one checkout's import
never sees another's), which builds the pipeline over `--data`, takes
`--warmup` minibatches, then `--minibatches` more while it measures its own
`time.process_time()` (every thread of the trainer's process: Grain's reader
thread that unpickles what workers send included, the workers excluded), and
wall-clock time. Minibatches are dropped as they come (`--hold` keeps the last
few, as a trainer with a prefetch-to-device queue would).

Spellings (`--spellings`):

* `loader`: `grain_cells.DataLoader(data_source=..., sampler=..., operations=
  grain_cells.fetch_operations(...), worker_count=N)`;
* `card`: the same objects given to Grain's own `grain.DataLoader`;
* `card_inline`: `card` with `read_options=grain.ReadOptions(num_threads=0,
  prefetch_buffer_size=0)`: block records are cheap (ids, no I/O), and
  Grain's default read-ahead of 500 records scans its buffer of futures on
  every record it hands out;
* `card_buffered`: `card` with `worker_buffer_size=--fetch_factor`: Grain
  then lets each worker queue a fetch's minibatches instead of one, so its
  reader threads and the main thread take them in runs instead of sleeping
  and waking once per minibatch;
* `card_tuned`: `card` with both (`read_options=grain_cells.pipeline.
  READ_OPTIONS`, `worker_buffer_size=--fetch_factor`), as the README and the
  loading guide spell Grain's own loader.

`--baseline_tree=/path/to/checkout` runs every point a second time with that
checkout's `grain_cells` (`PYTHONPATH`), interleaved with this one's, so a
before/after pair comes from one run (e.g. a worktree of the previous commit:
`git worktree add --detach /tmp/base c95fdd4`).

`--breakdown` also reports, per minibatch, the thread CPU of the trainer's
parts: `queue_get_us` (Grain's reads of its workers' multiprocessing queues,
unpickling and so `receive_us` included), `receive_us` (grain_cells mapping
and leasing a minibatch's slot) and `hand_back_send_us` (grain_cells'
socket sends returning slots). What is left of the total is Grain's own
(its reader threads' hand-over to the main thread, interleave, statistics).
The wrappers cost a little CPU themselves: compare points of one run.

Wall-clock cells/s is printed too; on a loaded machine it is noise, and the
CPU figure is the one to compare.

Usage:
  python benchmarks/trainer_cpu.py --data=tahoe.h5ad
  python benchmarks/trainer_cpu.py --data=tahoe.h5ad --baseline_tree=/tmp/base \
      --repeats=3 --json=/tmp/trainer_cpu.json
  python benchmarks/trainer_cpu.py --spellings=loader,card --worker_counts=0,2 \
      --cache=cold,warm --data=tahoe.h5ad
  python benchmarks/trainer_cpu.py --spellings=card --breakdown \
      --baseline_tree=/tmp/base   # where the trainer's CPU goes
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

_DATA = flags.DEFINE_string(
    "data",
    None,
    "An .h5ad file (CSR X). Default: a Tahoe-shaped synthetic file of "
    "--n_cells cells made (once, cached) by grain_cells.synthetic.",
)
_N_CELLS = flags.DEFINE_integer(
    "n_cells", 100_000, "Cells of the synthetic file (without --data)."
)
_BATCH = flags.DEFINE_integer("batch_size", 64, "Cells per minibatch.")
_FETCH = flags.DEFINE_integer("fetch_factor", 16, "Minibatches per fetch.")
_BLOCK = flags.DEFINE_integer("block_size", 16, "Cells per block (source).")
_OBS = flags.DEFINE_list(
    "obs_columns", ["plate"], "obs columns in each minibatch (CSR is always there)."
)
_WORKERS = flags.DEFINE_list(
    "worker_counts", ["2"], "Worker processes; one point per count."
)
_SPELLINGS = flags.DEFINE_list(
    "spellings",
    ["loader"],
    "loader (grain_cells.DataLoader), card (grain.DataLoader with the same "
    "objects), card_inline (card reading records without Grain's thread pool), "
    "card_buffered (card with worker_buffer_size=--fetch_factor), card_tuned "
    "(card with both, as the README spells it).",
)
_CACHE = flags.DEFINE_list(
    "cache",
    ["warm"],
    "warm: the file is read into the page cache first; cold: its pages are "
    "dropped before each point (posix_fadvise DONTNEED).",
)
_WARMUP = flags.DEFINE_integer(
    "warmup", 200, "Minibatches taken before measuring (worker start, first reads)."
)
_N = flags.DEFINE_integer("minibatches", 2000, "Minibatches measured per point.")
_HOLD = flags.DEFINE_integer(
    "hold", 0, "Minibatches the consumer keeps alive (the latest ones)."
)
_REPEATS = flags.DEFINE_integer(
    "repeats", 1, "Runs of every point; trees and points interleaved."
)
_BASELINE = flags.DEFINE_string(
    "baseline_tree",
    None,
    "Another checkout of grain_cells: every point also runs with it, for "
    "before/after figures from one run.",
)
_BREAKDOWN = flags.DEFINE_bool(
    "breakdown",
    False,
    "Also time (thread CPU) the trainer's parts per minibatch: Grain's "
    "multiprocessing queue reads (unpickling included), grain_cells' "
    "receive (mapping and leasing a slot) and its hand-back sends.",
)
_JSON = flags.DEFINE_string("json", None, "Also write every record here.")
_CHILD = flags.DEFINE_string(
    "child", None, "Internal: run one point (spelling,workers) and print JSON."
)


def _file() -> str:
    if _DATA.value:
        return _DATA.value
    from grain_cells import synthetic

    return str(synthetic.cached_tahoe_like(_N_CELLS.value))


def _loader(spelling: str, path: str, workers: int):
    import grain

    import grain_cells

    source = grain_cells.AnnDataSource(
        [path], block_size=_BLOCK.value, obs_columns=list(_OBS.value)
    )
    sampler = grain_cells.BlockSampler(source, seed=0, num_epochs=None)
    ops = grain_cells.fetch_operations(
        source, batch_size=_BATCH.value, fetch_factor=_FETCH.value
    )
    if spelling == "loader":
        return grain_cells.DataLoader(
            data_source=source, sampler=sampler, operations=ops, worker_count=workers
        )
    more = {}
    if spelling in ("card_inline", "card_tuned"):
        more["read_options"] = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    if spelling in ("card_buffered", "card_tuned"):
        more["worker_buffer_size"] = _FETCH.value
    return grain.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=ops,
        worker_count=workers,
        **more,
    )


def _timed(owner, name: str, key: str, spent: dict) -> None:
    """Wraps `owner.name` to add its thread CPU seconds to `spent[key]`."""
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0.0) + time.thread_time() - start

    setattr(owner, name, timed)


def _breakdown() -> dict:
    """Times the trainer's parts (`--breakdown`); returns the running sums."""
    import multiprocessing.queues

    from grain_cells.transport import _ring, _views

    spent: dict[str, float] = {}
    _timed(multiprocessing.queues.Queue, "get", "queue_get_us", spent)
    _timed(_ring, "_receive", "receive_us", spent)
    _timed(_views._RingView, "hand_back", "hand_back_send_us", spent)
    return spent


def run_child(spelling: str, workers: int) -> dict:
    """One point in this process: CPU and wall time over `--minibatches`."""
    import grain_cells

    spent = _breakdown() if _BREAKDOWN.value else {}
    path = _file()
    it = iter(_loader(spelling, path, workers))
    held = []
    for _ in range(_WARMUP.value):
        next(it)
    spent.clear()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(_N.value):
        batch = next(it)
        if _HOLD.value:
            held.append(batch)
            del held[: -_HOLD.value]
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - wall0
    keys = sorted(batch)
    close = getattr(it, "close", None)
    if close is not None:
        close()
    n, m = _N.value, _BATCH.value
    us = cpu / n * 1e6
    return {
        "grain_cells": os.path.dirname(grain_cells.__file__),
        "spelling": spelling,
        "worker_count": workers,
        "trainer_cpu_us_per_minibatch": round(us, 1),
        "ceiling_cells_per_s": round(m * 1e6 / us) if us else None,
        "wall_cells_per_s": round(n * m / wall),
        "minibatch_keys": keys,
        **{key: round(v / n * 1e6, 1) for key, v in spent.items()},
    }


def _point(tree: str | None, spelling: str, workers: int, cache: str, path: str):
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.path.abspath(tree)
    if cache == "cold":
        from bench_util import evict_page_cache

        evict_page_cache([path])
    argv = [sys.executable, os.path.abspath(__file__), f"--child={spelling},{workers}"]
    argv += [f"--data={path}"]
    for flag in (_BATCH, _FETCH, _BLOCK, _WARMUP, _N, _HOLD, _BREAKDOWN):
        argv.append(f"--{flag.name}={flag.value}")
    argv.append(f"--obs_columns={','.join(_OBS.value)}")
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{argv} failed:\n{out.stderr[-4000:]}")
    record = json.loads(out.stdout.strip().splitlines()[-1])
    record["cache"] = cache
    record["tree"] = "baseline" if tree else "this"
    return record


def main(argv):
    del argv
    if _CHILD.value:
        spelling, workers = _CHILD.value.split(",")
        print(json.dumps(run_child(spelling, int(workers))))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import h5py
    from bench_util import warm_page_cache

    path = _file()
    with h5py.File(path, "r") as f:
        shape = [int(v) for v in f["X"].attrs["shape"]]
        nnz = int(f["X/data"].shape[0])
    header = {
        "file": os.path.abspath(path),
        "shape": shape,
        "stored_values": nnz,
        "file_bytes": os.path.getsize(path),
        "batch_size": _BATCH.value,
        "fetch_factor": _FETCH.value,
        "block_size": _BLOCK.value,
        "obs_columns": list(_OBS.value),
        "warmup": _WARMUP.value,
        "minibatches": _N.value,
        "hold": _HOLD.value,
        "cpus": os.cpu_count(),
        "this_tree": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "baseline_tree": _BASELINE.value,
    }
    print(json.dumps(header))
    trees = [None] + ([_BASELINE.value] if _BASELINE.value else [])
    records = []
    for _ in range(_REPEATS.value):
        for cache in _CACHE.value:
            for workers in [int(w) for w in _WORKERS.value]:
                for spelling in _SPELLINGS.value:
                    for tree in trees:
                        if cache == "warm":
                            warm_page_cache([path])
                        rec = _point(tree, spelling, workers, cache, path)
                        records.append(rec)
                        print(
                            f"{rec['tree']:8s} {spelling:11s} workers={workers} "
                            f"{cache}: {rec['trainer_cpu_us_per_minibatch']:8.1f} "
                            f"CPU µs/minibatch, ceiling "
                            f"{rec['ceiling_cells_per_s']:>10,} cells/s; wall "
                            f"{rec['wall_cells_per_s']:,} cells/s",
                            flush=True,
                        )
                        parts = {k: v for k, v in rec.items() if k.endswith("_us")}
                        if parts:
                            print(f"         parts, CPU µs/minibatch: {parts}")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump({"setup": header, "records": records}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
