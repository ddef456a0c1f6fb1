r"""Peak memory of each worker process, and of the trainer, at the defaults.

Issue 25: a loader at its defaults should hold under 1 GB per worker. This
binary runs `grain_cells.DataLoader` with `--workers` worker processes at
the defaults (`AnnDataSource(path, obs_columns=["plate"])` without a
`block_size`, `fetch_operations(source, batch_size=64)` without a
`fetch_factor`, CSR output, an endless `BlockSampler`) for `--minibatches`
minibatches (or `--max_seconds`), and reports, per process:

* `peak_rss_mb`: its peak resident set (`VmHWM` of `/proc/PID/status`, the
  kernel's own high-water mark; the trainer's is reset as the loader
  starts). RSS counts the shared-memory slots a worker writes minibatches
  into (and the trainer maps) in full in both processes;
* `max_pss_mb` and `max_uss_mb`: the largest proportional and unique set
  sizes seen (`/proc/PID/smaps_rollup`, sampled every `--sample_s` seconds;
  absent where the file cannot be read). PSS shares each shared page among
  the processes that map it; USS counts only the pages no other process
  maps: what killing the process would give back.

Points (`--points`), one after the other in this process, each on a file of
`--n_cells` Tahoe-shaped cells (62,710 genes, made once and cached under
`GRAIN_CELLS_CACHE`) unless `--data` names one file per point:

* `none`: uncompressed chunked CSR (the maker's default chunks);
* `gzip`: gzip-compressed with atlas-scale chunks (`--gzip_chunks` values,
  131,072: ~81 cells each), where the defaults read chunk-aligned blocks and
  fetch up to 256 MiB of decoded values at a time.

The blocks and fetch factor the defaults chose are recorded with each point.
Wall-clock figures (`cells_per_s`) on a shared machine are noise; memory is
not.

JSON (`--json`): `{"data", "files", "flags", "results": [{"point",
"block_size", "fetch_factor", "trainer": {...}, "workers": [{"pid",
"peak_rss_mb", "max_pss_mb", "max_uss_mb"}], "minibatches", "seconds",
"cells_per_s"}]}`.

Usage:
  python benchmarks/worker_memory.py                      # none and gzip, 100k
  python benchmarks/worker_memory.py --points=none --json=memory.json
  python benchmarks/worker_memory.py --data=a.h5ad --points=none
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import bench_util
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

_DATA = flags.DEFINE_list(
    "data", None, "One .h5ad file per point, in the order of --points (else synthetic)."
)
_POINTS = flags.DEFINE_list(
    "points",
    ["none", "gzip"],
    "Comma-separated storage of the synthetic file per point: none "
    "(uncompressed) or gzip (atlas-scale chunks, --gzip_chunks).",
)
_N_CELLS = flags.DEFINE_integer(
    "n_cells", 100_000, "Cells of the synthetic files (plate-sorted, 14 plates)."
)
_N_GENES = flags.DEFINE_integer("n_genes", 62_710, "Genes of the synthetic files.")
_MEAN_NNZ = flags.DEFINE_float(
    "mean_nnz", 1_600.0, "Mean stored values per cell of the synthetic files."
)
_GZIP_CHUNKS = flags.DEFINE_integer(
    "gzip_chunks",
    131_072,
    "HDF5 chunk length (values) of the gzip file: 131,072 is the issue's "
    "atlas-scale chunk (~81 Tahoe cells).",
)
_WORKERS = flags.DEFINE_integer("workers", 2, "Worker processes of the loader.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Cells per minibatch.")
_MINIBATCHES = flags.DEFINE_integer(
    "minibatches", 400, "Minibatches read per point (after the first)."
)
_MAX_SECONDS = flags.DEFINE_float(
    "max_seconds",
    120.0,
    "A point stops after this long even if short of --minibatches.",
)
_SAMPLE_S = flags.DEFINE_float(
    "sample_s", 0.2, "Seconds between samples of each process's PSS and USS."
)
_JSON = flags.DEFINE_string("json", None, "Write the files, flags and points here.")


def smaps_rollup_mb(pid: int | str) -> dict | None:
    """PSS and USS (private clean + dirty) of a process, in MiB, or None."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = {
                line.split(":")[0]: int(line.split()[1])
                for line in f
                if line.rstrip().endswith("kB")
            }
    except (OSError, ValueError, IndexError):
        return None
    uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return {"pss": fields.get("Pss", 0) / 1024, "uss": uss / 1024}


def worker_pids() -> list[int]:
    """This process's children other than multiprocessing's resource tracker.

    Children not yet exec'd (command line still this one's) are left out:
    their memory is this process's (`scale_probes.worker_pids`).
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


class Sampler(threading.Thread):
    """Samples the PSS and USS of the trainer and its workers until stopped."""

    def __init__(self, every_s: float):
        super().__init__(daemon=True, name="worker-memory-sampler")
        self.every_s = every_s
        self.peaks: dict[int | str, dict] = {}
        self.done = threading.Event()

    def sample(self) -> None:
        """One sample of every process; keeps the largest."""
        for pid in ["self", *worker_pids()]:
            now = smaps_rollup_mb(pid)
            if now is None:
                continue
            peak = self.peaks.setdefault(pid, {"pss": 0.0, "uss": 0.0})
            for key in peak:
                peak[key] = max(peak[key], now[key])

    def run(self) -> None:
        """Samples every `every_s` seconds until `done` is set."""
        while not self.done.wait(self.every_s):
            self.sample()


def _file_for(point: str, index: int) -> str:
    if _DATA.value:
        if len(_DATA.value) != len(_POINTS.value):
            raise app.UsageError(
                f"--data names {len(_DATA.value)} files for "
                f"{len(_POINTS.value)} points; give one per point"
            )
        return _DATA.value[index]
    if point not in ("none", "gzip"):
        raise app.UsageError(f"--points: unknown point {point!r}; none or gzip")
    from grain_cells.synthetic import _tahoe as synthetic

    kwargs = {"n_genes": _N_GENES.value, "progress": True}
    if _MEAN_NNZ.value != 1_600.0:
        kwargs["mean_nnz"] = _MEAN_NNZ.value
    if point == "gzip":
        kwargs |= {"compression": "gzip", "chunks": _GZIP_CHUNKS.value}
    return str(synthetic.cached_tahoe_like(_N_CELLS.value, **kwargs))


def measure(point: str, path: str) -> dict:
    """Runs the loader at its defaults on `path`; the memory of every process."""
    import grain_cells
    from grain_cells.pipeline import _config as pipeline_config

    bench_util.reset_peak_rss()
    source = grain_cells.AnnDataSource(path, obs_columns=["plate"])
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=None),
        operations=grain_cells.fetch_operations(source, batch_size=_BATCH.value),
        worker_count=_WORKERS.value,
    )
    sampler = Sampler(_SAMPLE_S.value)
    sampler.start()
    iterator = iter(loader)
    cells = count = 0
    try:
        next(iterator)
        start = time.perf_counter()
        while count < _MINIBATCHES.value:
            batch = next(iterator)
            cells += int(batch["mask"].sum())
            count += 1
            if time.perf_counter() - start > _MAX_SECONDS.value:
                break
        seconds = time.perf_counter() - start
        sampler.sample()
        pids = worker_pids()
        peaks = {pid: bench_util.vm_hwm_mb(pid) for pid in pids}
        trainer_peak = bench_util.vm_hwm_mb()
    finally:
        sampler.done.set()
        sampler.join()
        iterator.close()

    def record(pid, peak) -> dict:
        seen = sampler.peaks.get(pid, {})
        return {
            "peak_rss_mb": None if peak is None else round(peak, 1),
            "max_pss_mb": round(seen["pss"], 1) if seen else None,
            "max_uss_mb": round(seen["uss"], 1) if seen else None,
        }

    return {
        "point": point,
        "path": path,
        "block_size": source.block_size,
        "fetch_factor": pipeline_config.default_fetch_factor(source, _BATCH.value),
        "trainer": record("self", trainer_peak),
        "workers": [{"pid": pid, **record(pid, peaks[pid])} for pid in pids],
        "minibatches": count,
        "seconds": round(seconds, 2),
        "cells_per_s": round(cells / max(seconds, 1e-9)),
    }


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    files = [_file_for(p, i) for i, p in enumerate(_POINTS.value)]
    results = []
    for point, path in zip(_POINTS.value, files, strict=True):
        r = {"load_avg": round(os.getloadavg()[0], 2)} | measure(point, path)
        results.append(r)
        workers = ", ".join(
            f"{w['peak_rss_mb']} MiB (PSS {w['max_pss_mb']}, USS {w['max_uss_mb']})"
            for w in r["workers"]
        )
        print(
            f"{point}: block {r['block_size']}, fetch factor {r['fetch_factor']}; "
            f"peak RSS per worker {workers}; trainer {r['trainer']['peak_rss_mb']} "
            f"MiB (PSS {r['trainer']['max_pss_mb']})",
            flush=True,
        )
        print(json.dumps(r), flush=True)
    if _JSON.value:
        bench_util.write_json(
            _JSON.value,
            files,
            {
                name: flags.FLAGS[name].value
                for name in (
                    "points",
                    "n_cells",
                    "n_genes",
                    "mean_nnz",
                    "gzip_chunks",
                    "workers",
                    "batch_size",
                    "minibatches",
                    "max_seconds",
                    "sample_s",
                )
            },
            results,
            synthetic=not _DATA.value,
        )


if __name__ == "__main__":
    app.run(main)
