"""Helpers shared by the benchmark binaries: page cache, RSS, data, timing.

`measure_loader` times any loader (cells/s, label entropy, first batch, RSS).

Imports nothing heavy at module level: peer loaders' spawned workers import
it too (see `peers.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


def evict_page_cache(paths) -> None:
    """Drops the files' pages from the OS page cache (for cold-read figures)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(paths, chunk: int = 1 << 24) -> None:
    """Reads the files once so that every page is cached."""
    buf = bytearray(chunk)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def peak_rss_mb() -> float:
    """Peak resident set size of this process over its life, in MiB."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024


def reset_peak_rss() -> bool:
    """Restarts this process's VmHWM from its current RSS (Linux >= 4.0).

    Lets one process report a peak per measurement (`vm_hwm_mb`). Returns
    False where the kernel does not allow it.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def vm_hwm_mb(pid: int | str = "self") -> float | None:
    """A process's peak RSS since start or `reset_peak_rss` (VmHWM), in MiB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def children_peak_rss_mb() -> list[float]:
    """VmHWM of this process's children (Linux), in MiB."""
    return [m for m in (vm_hwm_mb(k) for k in _children()) if m is not None]


def parse_options(text: str) -> dict:
    """`key=value,...` as a dict (ints where they parse)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            out[key] = int(value)
        except ValueError:
            out[key] = value
    return out


def parse_compression(compression: str, chunks: str) -> dict:
    """`--compression` and `--chunks` flags as `write_tahoe_like` arguments.

    `compression`: `none`, `gzip` or `lzf`. `chunks`: `atlas` (anndata's
    chunking for a file of the full size: h5py's guess), `default` (the
    maker's fixed 2**16 elements when compressed), or an element count.
    Chunks matter only for compressed files (uncompressed ones keep the
    maker's default, so existing cached files are reused).
    """
    if compression in ("", "none", None):
        return {}
    if compression not in ("gzip", "lzf"):
        raise ValueError(
            f"--compression must be none, gzip or lzf, got {compression!r}"
        )
    out = {"compression": compression}
    if chunks == "atlas":
        out["chunks"] = "atlas"
    elif chunks not in ("", "default"):
        out["chunks"] = int(chunks)
    return out


def _children() -> list[int]:
    pid = os.getpid()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    kids = []
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                kids += [int(k) for k in f.read().split()]
        except OSError:
            pass
    return kids


def s3_server(kind: str, root: str, *, rtt_s=0.0, via_proxy=False, objects=None):
    """The local S3 stand-in a `--server` flag names (not started).

    `nginx`: `grain_cells.testing.NginxFolder` (`immutable`: the benchmarks'
    files do not change while served); `python`: `ServedFolder`
    (`S3FolderServer`, behind `FaultProxy` with `via_proxy`).
    """
    from absl import app

    from grain_cells.testing import NginxFolder, ServedFolder

    if kind == "nginx":
        if via_proxy:
            raise app.UsageError("--via_proxy needs --server=python")
        return NginxFolder(root, rtt_s=rtt_s, objects=objects, immutable=True)
    return ServedFolder(root, rtt_s=rtt_s, via_proxy=via_proxy, objects=objects)


def process_cpu_s(pid: int) -> float:
    """CPU time (user + system) of one live process, 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_read_bytes(pid: int) -> int:
    """Bytes one live process has had read from storage (0 if unknown).

    `read_bytes` of `/proc/PID/io`: what the block layer fetched for the
    process (page-cache fills, kernel read-ahead included), not what it
    asked for.
    """
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its live children.

    On a shared machine, cells per CPU-second compares loaders where wall
    time mostly measures the neighbours' load.
    """
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for kid in _children():
        try:
            with open(f"/proc/{kid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def resolve_data(
    data: list[str] | None,
    n_cells: int,
    n_genes: int,
    compression: str = "none",
    chunks: str = "atlas",
) -> list[str]:
    """The files to benchmark: `data`, or a cached synthetic Tahoe-like file.

    `compression` and `chunks` pick the synthetic file (see
    `parse_compression`); they are ignored when `data` is given.
    """
    if data:
        return list(data)
    kwargs = parse_compression(compression, chunks)
    print(
        f"no --data: using a synthetic Tahoe-shaped file of {n_cells} cells "
        f"x {n_genes} genes {kwargs or ''}(made once, cached)",
        file=sys.stderr,
    )
    from grain_cells.synthetic import _tahoe as synthetic  # imports Grain and JAX

    path = synthetic.cached_tahoe_like(
        n_cells, n_genes=n_genes, progress=True, **kwargs
    )
    return [str(path)]


@dataclasses.dataclass
class Loader:
    """A started loader, as `measure_loader` takes it.

    Attributes:
        batches: Iterator of minibatches.
        labels: The label codes (integers) of a minibatch's cells, padding
            rows excluded.
        close: Stops the loader and its workers.
    """

    batches: Iterator
    labels: Callable[[Any], np.ndarray]
    close: Callable[[], None]


def entropies(labels: list[np.ndarray]) -> np.ndarray:
    """Shannon entropy (log2) of the label codes of each minibatch."""
    out = np.empty(len(labels))
    for i, codes in enumerate(labels):
        counts = np.unique(codes, return_counts=True)[1]
        p = counts / counts.sum()
        out[i] = -(p * np.log2(p)).sum()
    return out


def measure_loader(
    start: Callable[[], Loader],
    *,
    workers: int,
    warmup: int,
    minibatches: int,
    max_seconds: float,
    min_seconds: float = 0.0,
) -> dict:
    """Times a loader: first minibatch, warm-up, then a window of minibatches.

    Args:
        start: Opens the files and starts the loader (timed as part of the
            first minibatch).
        workers: The loader's worker processes (the largest children).
        warmup: Minibatches skipped after the first one.
        minibatches: Minibatches in the measured window (at least one).
        max_seconds: The warm-up and the window each stop after this long.
        min_seconds: The window goes on past `minibatches` until this long.

    Returns:
        cells/s over the window (real cells), mean and std of the label's
        per-minibatch entropy over the window, the time to the first
        minibatch, cells per CPU-second of this process and its children over
        the window, this process's peak RSS since `start` (VmHWM), the peak
        RSS of each worker, the window's length in minibatches and seconds.
    """
    reset_peak_rss()
    t0 = time.perf_counter()
    loader = start()
    try:
        next(loader.batches)
        first = time.perf_counter() - t0
        deadline = time.perf_counter() + max_seconds
        for _ in range(warmup):
            next(loader.batches)
            if time.perf_counter() > deadline:
                break
        labels = []
        c1 = cpu_seconds()
        t1 = time.perf_counter()
        while True:
            labels.append(np.asarray(loader.labels(next(loader.batches))))
            seconds = time.perf_counter() - t1
            if seconds > max_seconds or (
                len(labels) >= minibatches and seconds >= min_seconds
            ):
                break
        cpu = cpu_seconds() - c1
        # The workers are the largest children; the others are helpers such
        # as multiprocessing's resource tracker.
        kids = sorted(children_peak_rss_mb(), reverse=True)[:workers]
        main = vm_hwm_mb()
    finally:
        loader.close()
    e = entropies(labels)
    return {
        "cells_per_s": round(sum(x.size for x in labels) / seconds),
        "cells_per_cpu_s": round(sum(x.size for x in labels) / max(cpu, 1e-9)),
        "entropy_mean": round(float(e.mean()), 3),
        "entropy_std": round(float(e.std()), 3),
        "first_batch_s": round(first, 3),
        "main_peak_rss_mb": None if main is None else round(main, 1),
        "worker_peak_rss_mb": [round(k, 1) for k in kids],
        "window_minibatches": len(labels),
        "window_s": round(seconds, 2),
    }


def write_json(path: str, files: list[str], flag_values: dict, results: list) -> None:
    """Writes a binary's files, flags and result points as indented JSON."""
    with open(path, "w") as f:
        json.dump(
            {"files": files, "flags": flag_values, "results": results}, f, indent=2
        )
