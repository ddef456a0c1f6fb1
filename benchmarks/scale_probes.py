"""The measures of `scale.py`, each run alone in a fresh process.

Every function takes the files and a dict of options and returns a dict of
figures (JSON-ready). They use only grain_cells' public API, so that another
checkout can be measured with the same code (`PYTHONPATH`). Memory words:

* `rss`: resident set (`VmRSS`); `hwm`: its peak (`VmHWM`, reset by
  `bench_util.reset_peak_rss` before the measured step where the figure
  says "peak");
* `anon`: resident anonymous memory (`RssAnon`): the process's own heap and
  arrays, what grows with cells and does not come back from the page cache;
* `pss`: proportional set size (`smaps_rollup`): shared pages divided among
  the processes that map them (shared-memory slots, libraries).
"""

from __future__ import annotations

import os
import pickle
import statistics
import time

import bench_util

_MIB = 1 << 20
# Minibatches per part of `throughput`'s window (ten fetches of 16 minibatches).
_PART = 160


def proc_memory(pid: int | str = "self") -> dict:
    """RSS, peak, anonymous, file and shmem resident MiB, PSS, fds of a process."""
    out: dict = {}
    keys = {
        "VmRSS": "rss_mb",
        "VmHWM": "hwm_mb",
        "RssAnon": "anon_mb",
        "RssFile": "file_mb",
        "RssShmem": "shmem_mb",
    }
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name = line.split(":")[0]
                if name in keys:
                    out[keys[name]] = round(int(line.split()[1]) / 1024, 1)
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Pss:", "Pss_Anon:")):
                    key = "pss_mb" if line.startswith("Pss:") else "pss_anon_mb"
                    out[key] = round(int(line.split()[1]) / 1024, 1)
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError, IndexError):
        pass
    return out


def worker_pids() -> list[int]:
    """This process's children other than multiprocessing's resource tracker.

    A child still between its fork and its exec (a spawned worker or the
    resource tracker starting) is left out too: until it execs it shares
    this process's memory (`vfork`) or its pages (`fork`), so its `RssAnon`
    reads as this process's. Told by its command line, still this one's.
    (A 10,000-file epoch once recorded the trainer's 967 MiB as a worker's.)
    """
    out = []
    with open("/proc/self/cmdline", "rb") as f:
        mine = f.read()
    for pid in bench_util._children():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"resource_tracker" not in cmdline and cmdline != mine:
            out.append(pid)
    return out


class Step:
    """Wall, CPU (this process) and peak-RSS growth of a block of code."""

    def __enter__(self):
        bench_util.reset_peak_rss()
        self.rss0 = proc_memory()
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall_s = time.perf_counter() - self.t0
        self.cpu_s = time.process_time() - self.c0
        self.after = proc_memory()

    def record(self, prefix: str) -> dict:
        """The figures, named `{prefix}_s`, `{prefix}_cpu_s`, ..."""
        return {
            f"{prefix}_s": round(self.wall_s, 3),
            f"{prefix}_cpu_s": round(self.cpu_s, 3),
            f"{prefix}_peak_growth_mb": round(
                self.after.get("hwm_mb", 0) - self.rss0.get("rss_mb", 0), 1
            ),
            f"{prefix}_anon_growth_mb": round(
                self.after.get("anon_mb", 0) - self.rss0.get("anon_mb", 0), 1
            ),
        }


def _source(paths, opts):
    import grain_cells

    return grain_cells.AnnDataSource(
        paths,
        obs_columns=opts["obs_columns"],
        block_size=opts.get("block_size"),
        storage_options=opts.get("storage_options"),
        **({"max_open_files": n} if (n := opts.get("max_open_files")) else {}),
    )


def server_stats(opts, reset: bool = False) -> dict:
    """The S3 server's counters (`--s3`), else {}."""
    if not opts.get("stats_url"):
        return {}
    import json
    import urllib.request

    url = opts["stats_url"] + ("?reset=1" if reset else "")
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def per_minibatch(before: dict, after: dict, n: int) -> dict:
    """Requests and response KiB per minibatch between two `server_stats`."""
    if not after:
        return {}
    got = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {
        "requests_per_minibatch": round(got.get("requests", 0) / n, 2),
        "response_kib_per_minibatch": round(got.get("response_bytes", 0) / n / 1024, 1),
    }


def _loader(source, opts, workers: int, num_epochs: int | None = None):
    import grain_cells

    return grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=0, num_epochs=num_epochs),
        operations=grain_cells.fetch_operations(source, batch_size=opts["batch_size"]),
        worker_count=workers,
    )


def _close(iterator) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


def construct(paths, opts) -> dict:
    """Source construction: wall/CPU-s, peak RSS and anon growth, per file."""
    import grain_cells  # noqa: F401 (imported before the step is timed)

    with Step() as step:
        source = _source(paths, opts)
    return {
        **step.record("construct"),
        "construct_cpu_ms_per_file": round(1e3 * step.cpu_s / len(paths), 3),
        "cells": int(source.num_cells) if hasattr(source, "num_cells") else None,
        "blocks": len(source),
        "block_size": source.block_size,
        "after": step.after,
    }


def construct_warm(paths, opts) -> dict:
    """`construct` again: after the earlier measures filled the caches."""
    return construct(paths, opts)


def first_batch(paths, opts) -> dict:
    """0 workers: source to first minibatch, then cells/s and CPU per fetch."""
    source = _source(paths, opts)
    t0 = time.perf_counter()
    iterator = iter(_loader(source, opts, 0))
    next(iterator)
    first = time.perf_counter() - t0
    n, cells = opts["minibatches"], 0
    s0 = server_stats(opts)
    t1, c1 = time.perf_counter(), time.process_time()
    for _ in range(n):
        cells += int(next(iterator)["mask"].sum())
    wall, cpu = time.perf_counter() - t1, time.process_time() - c1
    _close(iterator)
    return {
        **per_minibatch(s0, server_stats(opts), n),
        "first_batch_s": round(first, 3),
        "minibatches": n,
        "cells_per_s": round(cells / wall),
        "cells_per_cpu_s": round(cells / max(cpu, 1e-9)),
        "cpu_ms_per_minibatch": round(1e3 * cpu / n, 3),
        "after": proc_memory(),
    }


def throughput(paths, opts) -> dict:
    """0 workers, steady state: cells/s over `--throughput_minibatches`.

    Also the median over parts of 160 minibatches of cells per CPU-second
    (`cells_per_cpu_s_median_part`): on a shared machine a few parts that
    other processes slowed move it less than the whole window's figure.

    Timed after `--minibatches` minibatches (so that opening the first files
    is not counted); compare a collection with the one file of the same
    cells (`vs_one_file.throughput_ratio` in the JSON).
    """
    source = _source(paths, opts)
    iterator = iter(_loader(source, opts, 0))
    for _ in range(opts["minibatches"]):
        next(iterator)
    n, cells = opts["throughput_minibatches"], 0
    s0 = server_stats(opts)
    t0, c0 = time.perf_counter(), time.process_time()
    rates, part_cells, part_c0 = [], 0, c0
    for k in range(n):
        got = int(next(iterator)["mask"].sum())
        cells += got
        part_cells += got
        if (k + 1) % _PART == 0:  # CPU per part: a median that load spikes skew less
            now = time.process_time()
            rates.append(part_cells / max(now - part_c0, 1e-9))
            part_cells, part_c0 = 0, now
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    _close(iterator)
    return {
        **per_minibatch(s0, server_stats(opts), n),
        "minibatches": n,
        "cells_per_s": round(cells / wall),
        "cells_per_cpu_s": round(cells / max(cpu, 1e-9)),
        "cells_per_cpu_s_median_part": round(statistics.median(rates))
        if rates
        else None,
        "parts": len(rates),
        "after": proc_memory(),
    }


def _run_workers(paths, opts, workers: int) -> dict:
    source = _source(paths, opts)
    t0 = time.perf_counter()
    iterator = iter(_loader(source, opts, workers))
    try:
        next(iterator)
        first = time.perf_counter() - t0
        n, cells = opts["minibatches"], 0
        s0, t1 = server_stats(opts), time.perf_counter()
        for _ in range(n):
            cells += int(next(iterator)["mask"].sum())
        wall = time.perf_counter() - t1
        pids = worker_pids()
        return {
            **per_minibatch(s0, server_stats(opts), n),
            "workers": workers,
            "first_batch_s": round(first, 3),
            "cells_per_s": round(cells / wall),
            "trainer": proc_memory(),
            "worker": [proc_memory(pid) for pid in pids],
        }
    finally:
        _close(iterator)


def epoch(paths, opts) -> dict:
    """One whole epoch with `--workers` workers: every cell once.

    Also the most fds and anonymous memory any worker held and the
    trainer held (sampled every 0.5 s), wall, and CPU-s of the trainer and
    of the workers together.
    """
    import resource
    import threading

    source = _source(paths, opts)
    most = {
        "trainer_fds": 0,
        "worker_fds": 0,
        "worker_anon_mb": 0.0,
        "trainer_anon_mb": 0.0,
    }
    done = threading.Event()

    def sample():
        while not done.wait(0.5):
            me = proc_memory()
            most["trainer_fds"] = max(most["trainer_fds"], me.get("fds", 0))
            most["trainer_anon_mb"] = max(
                most["trainer_anon_mb"], me.get("anon_mb", 0.0)
            )
            for pid in worker_pids():
                w = proc_memory(pid)
                most["worker_fds"] = max(most["worker_fds"], w.get("fds", 0))
                most["worker_anon_mb"] = max(
                    most["worker_anon_mb"], w.get("anon_mb", 0.0)
                )

    sampler = threading.Thread(target=sample, daemon=True)
    t0, c0 = time.perf_counter(), time.process_time()
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    sampler.start()
    import numpy as np

    cells = minibatches = 0
    seen = np.zeros(source.num_cells, np.uint8)
    iterator = iter(_loader(source, opts, opts["workers"], num_epochs=1))
    try:
        for batch in iterator:
            rows = batch["row_ids"][batch["mask"]]
            np.add.at(seen, rows, 1)
            cells += int(rows.size)
            minibatches += 1
    finally:
        done.set()
        _close(iterator)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    workers_cpu = (kids.ru_utime + kids.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    return {
        "workers": opts["workers"],
        "cells": cells,
        "all_cells_once": bool((seen == 1).all()),
        "minibatches": minibatches,
        "epoch_s": round(wall, 1),
        "cells_per_s": round(cells / wall),
        "trainer_cpu_s": round(cpu, 1),
        "workers_cpu_s": round(workers_cpu, 1),
        **most,
    }


def workers(paths, opts) -> dict:
    """`--workers` workers: RSS/PSS/anon/fds of each and of the trainer."""
    return _run_workers(paths, opts, opts["workers"])


def fds(paths, opts) -> dict:
    """Open fds of the trainer and each worker, at each `--fd_workers` count."""
    out = {}
    for n in opts["fd_workers"]:
        r = _run_workers(paths, opts, n)
        out[str(n)] = {
            "trainer_fds": r["trainer"].get("fds"),
            "worker_fds": [w.get("fds") for w in r["worker"]],
        }
    return {"fds_by_workers": out}


def get_state(paths, opts) -> dict:
    """0 workers: `get_state()` after a few minibatches, median of 5, size."""
    source = _source(paths, opts)
    iterator = iter(_loader(source, opts, 0))
    for _ in range(4):
        next(iterator)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        state = iterator.get_state()
        times.append(time.perf_counter() - t0)
    _close(iterator)
    size = len(state) if isinstance(state, bytes | str) else len(pickle.dumps(state))
    return {
        "get_state_ms": round(1e3 * statistics.median(times), 3),
        "state_bytes": size,
    }


def _pickled(obj) -> int:
    import cloudpickle

    return len(cloudpickle.dumps(obj))


def weights(paths, opts) -> dict:
    """`balanced_block_weights` on `--label`: CPU, memory, pickled sampler."""
    import grain_cells

    source = _source(paths, opts)
    with Step() as step:
        w = grain_cells.balanced_block_weights(source, opts["label"])
    sampler = grain_cells.WeightedBlockSampler(source, w, seed=0)
    return {
        **step.record("weights"),
        "weights_bytes": int(w.nbytes),
        "source_pickled_bytes": _pickled(source),
        "sampler_pickled_bytes": _pickled(sampler),
    }


def splits(paths, opts) -> dict:
    """`split_by_obs` on `--split_column` (10% of its categories held out)."""
    import grain_cells

    source = _source(paths, opts)
    n = opts["split_categories"]
    width = len(str(n))
    held = [f"{opts['split_column']}_{i:0{width}d}" for i in range(0, n, 10)]
    with Step() as step:
        views = grain_cells.split_by_obs(source, opts["split_column"], {"val": held})
    return {
        **step.record("split"),
        "held_out_categories": len(held),
        "source_pickled_bytes": _pickled(source),
        "split_pickled_bytes": {k: _pickled(v) for k, v in views.items()},
    }


def length(paths, opts) -> dict:
    """`grain_cells.loader(split=...)`: construction and `len()` CPU-s."""
    import grain_cells

    with Step() as build:
        loader = grain_cells.loader(
            paths,
            batch_size=opts["batch_size"],
            obs_columns=opts["obs_columns"],
            split=("train", {"train": 0.9, "val": 0.1}),
        )
    with Step() as count:
        n = len(loader)
    return {**build.record("split_loader"), **count.record("len"), "len": n}


def preshuffle(paths, opts) -> dict:
    """`grain_cells.preshuffle` into `--scratch`: wall/CPU-s and peak RSS."""
    import shutil
    import tempfile

    import grain_cells

    out = tempfile.mkdtemp(prefix="preshuffle-", dir=opts["scratch"])
    try:
        with Step() as step:
            files = grain_cells.preshuffle(paths, out, progress=False)
        return {
            **step.record("preshuffle"),
            "output_files": len(files),
            "children_peak_rss_mb": bench_util.children_peak_rss_mb(),
        }
    finally:
        shutil.rmtree(out, ignore_errors=True)


MEASURES = {
    "construct": construct,
    "construct_warm": construct_warm,
    "first_batch": first_batch,
    "throughput": throughput,
    "epoch": epoch,
    "workers": workers,
    "fds": fds,
    "get_state": get_state,
    "splits": splits,
    "weights": weights,
    "len": length,
    "preshuffle": preshuffle,
}
