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


def files_under(paths) -> list[str]:
    """The files of `paths`, a directory (a zarr store) as each file below it."""
    out = []
    for path in paths:
        if os.path.isdir(path):
            for folder, _, names in sorted(os.walk(path)):
                out += [os.path.join(folder, n) for n in sorted(names)]
        else:
            out.append(path)
    return out


def evict_page_cache(paths) -> None:
    """Drops the files' pages from the OS page cache (for cold-read figures).

    A directory (a zarr store) stands for every file below it.
    """
    os.sync()
    for path in files_under(paths):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(paths, chunk: int = 1 << 24) -> None:
    """Reads the files once so that every page is cached.

    A directory (a zarr store) stands for every file below it.
    """
    buf = bytearray(chunk)
    for path in files_under(paths):
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


# Children that multiprocessing starts for itself, not workers: the
# resource tracker (started with the first shared-memory segment) and a
# forkserver.
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def children_peak_rss_mb() -> list[float]:
    """VmHWM of this process's worker children (Linux), in MiB.

    multiprocessing's own helper processes (`_HELPERS`) are not workers and
    are left out.
    """
    kids = [k for k in _children() if not _is_helper(k)]
    return [m for m in (vm_hwm_mb(k) for k in kids) if m is not None]


def _is_helper(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace")
    except OSError:
        return False
    return any(helper in cmdline for helper in _HELPERS)


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


# Flags that only shape the synthetic file made when --data is not given.
SYNTHETIC_FLAGS = ("n_cells", "n_genes", "mean_nnz", "compression", "chunks")


def _describe_store(path: str, out: dict) -> dict:
    """`describe_file` of a zarr store (its X: metadata only)."""
    import zarr

    out["bytes"] = sum(os.path.getsize(f) for f in files_under([path]))
    x = zarr.open_group(path, mode="r").get("X")
    if isinstance(x, zarr.Group):
        data = x["data"]
        out["encoding"] = _text(x.attrs.get("encoding-type", "csr_matrix"))
        out["shape"] = [int(n) for n in x.attrs.get("shape", (0, 0))]
        out["nnz"] = int(data.shape[0])
        if out["shape"][0]:
            out["mean_nnz_per_cell"] = round(out["nnz"] / out["shape"][0], 1)
    elif isinstance(x, zarr.Array):
        data = x
        out["encoding"] = "array"
        out["shape"] = [int(n) for n in x.shape]
    else:
        return out
    out["dtype"] = str(data.dtype)
    out["zarr_format"] = data.metadata.zarr_format
    out["chunks"] = list(data.chunks)
    out["codecs"] = [str(c) for c in data.compressors]
    return out


def describe_file(path: str) -> dict:
    """What a benchmark measured: a file's path, size and X's shape and storage.

    Reads only HDF5 (or zarr) metadata, no values. URLs are recorded by
    name only.
    """
    out: dict[str, Any] = {"path": str(path)}
    if "://" in str(path):
        return out
    if os.path.isdir(path):  # a zarr store
        return _describe_store(str(path), out)
    import h5py

    out["bytes"] = os.path.getsize(path)
    with h5py.File(path, "r") as f:
        x = f.get("X")
        if isinstance(x, h5py.Group):  # sparse: data, indices, indptr
            data = x["data"]
            out["encoding"] = _text(x.attrs.get("encoding-type", "csr_matrix"))
            out["shape"] = [int(n) for n in x.attrs.get("shape", (0, 0))]
            out["nnz"] = int(data.shape[0])
        elif isinstance(x, h5py.Dataset):
            data = x
            out["encoding"] = "array"
            out["shape"] = [int(n) for n in x.shape]
        else:
            return out
        out["dtype"] = str(data.dtype)
        out["compression"] = data.compression
        out["chunks"] = None if data.chunks is None else list(data.chunks)
    if "nnz" in out and out["shape"][0]:
        out["mean_nnz_per_cell"] = round(out["nnz"] / out["shape"][0], 1)
    return out


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def data_record(files, flag_values: dict, *, synthetic: bool) -> dict:
    """The `files` and `flags` of a JSON record: what was measured, how.

    Args:
        files: The files read (`resolve_data`'s answer).
        flag_values: The binary's flags.
        synthetic: Whether the files are the synthetic one made from the
            flags; when False (`--data` given) the flags that only shape the
            synthetic file (`SYNTHETIC_FLAGS`) are left out, so the record
            does not claim a shape the files do not have.
    """
    flags_ = dict(flag_values)
    if not synthetic:
        flags_ = {k: v for k, v in flags_.items() if k not in SYNTHETIC_FLAGS}
    return {
        "data": "synthetic" if synthetic else "given (--data)",
        "files": [describe_file(p) for p in files],
        "flags": flags_,
    }


def write_json(
    path: str,
    files: list[str],
    flag_values: dict,
    results: list,
    *,
    synthetic: bool,
) -> None:
    """Writes a binary's files (path, shape, storage), flags and result points.

    See `data_record` for `synthetic`.
    """
    record = data_record(files, flag_values, synthetic=synthetic)
    with open(path, "w") as f:
        json.dump({**record, "results": results}, f, indent=2)


def define_config_flags(config: dict, helps: dict) -> None:
    """Defines one absl flag per key of a `get_config()` dict.

    Each flag's help is `helps[key]` followed by its default; a key without
    help gets "(no help yet)", which `tests/test_benchmarks.py` refuses.
    """
    from absl import flags

    for key, value in config.items():
        text = f"{helps.get(key, '(no help yet)')} Default: {value!r}."
        if isinstance(value, bool):
            flags.DEFINE_boolean(key, value, text)
        elif isinstance(value, int):
            flags.DEFINE_integer(key, value, text)
        elif isinstance(value, float):
            flags.DEFINE_float(key, value, text)
        else:
            flags.DEFINE_string(key, value, text)


def entropy_range(n_labels: int, batch_size: int) -> tuple[float, float]:
    """The fixed colour range of a per-minibatch entropy: `[0, log2(k)]`.

    `k = min(n_labels, batch_size)`: no minibatch can do better. On this
    fixed scale a 0.01 spread between points looks like the noise it is,
    where a scale stretched over the points' own range made it look like
    signal.
    """
    k = max(2, min(int(n_labels), int(batch_size)))
    return 0.0, float(np.log2(k))


def fit_titles(fig, suptitle=None, *, min_fontsize: float = 6.0) -> None:
    """Wraps (then shrinks) the figure's titles until each fits its box.

    `suptitle` (the `Text` that `fig.suptitle` returns) must fit the
    figure's width, each axes title its axes' width: a long title is
    otherwise clipped at the image's edge. Call it last, before `savefig`.
    """
    import textwrap

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(suptitle, fig.bbox)] if suptitle is not None else []
    boxes += [(ax.title, ax.bbox) for ax in fig.axes if ax.get_title()]
    for text, box in boxes:
        words = text.get_text().replace("\n", " ")
        width = len(words)
        while text.get_window_extent(renderer).width > box.width * 0.98:
            if width > 20:
                width = int(width * 0.8)
                text.set_text(textwrap.fill(words, width))
            elif text.get_fontsize() > min_fontsize:
                text.set_fontsize(text.get_fontsize() - 1)
            else:
                break
    fig.canvas.draw()


def titles_fit(fig, suptitle=None) -> bool:
    """Whether `suptitle` and every axes title lie inside the figure's width."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [suptitle] if suptitle is not None else []
    texts += [ax.title for ax in fig.axes if ax.get_title()]
    for text in texts:
        extent = text.get_window_extent(renderer)
        if extent.x0 < 0 or extent.x1 > fig.bbox.width:
            return False
    return True
