r"""The GPU-host benchmark: one table of trainer, loader, peer and decode figures.

Run by `run.sh` (which installs what the host lacks from a wheel folder);
makes its own data and needs no network. In order, each stage in its own
process and cut short when the time budget (`--budget_s`) runs out:

1. data: a Tahoe-shaped synthetic file, uncompressed and gzip (`--n_cells`
   x `--n_genes`), made once into `<out>/data`;
2. the device feed: CPU and wall microseconds per step of
   `grain_cells.feed.device_iterator` against plain `jax.device_put`, with
   and without page-locked staging (`benchmarks/feed_overhead.py`);
3. the training example's `--measure_loader_overhead`: steps/s of the MLP at
   batch `--mlp_batch` and of the transformer at `--tx_batch`, fed by the
   loader (`--train_workers` workers) and from memory, and the loader alone;
4. the loader alone (`benchmarks/grid.py`, warm page cache, block 16, fetch
   16, CSR): worker counts `--workers` x batch sizes `--batches` x both
   files, and scDataset at `--scdataset_workers` workers (batch 64);
5. the decode ceiling of the gzip file on every core
   (`benchmarks/decode_ceiling.py`).

Prints the table (Markdown) and writes it with every raw figure to
`<out>/table.md` and `<out>/results.json`; each stage's log is in `<out>/logs`.

Usage:
  python benchmarks/gpu_host/driver.py --out=/tmp/gc-gpu      # about 7 minutes
  python benchmarks/gpu_host/driver.py --quick --out=/tmp/gc  # tiny, any CPU
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
sys.path.insert(0, ROOT)

_OUT = flags.DEFINE_string("out", "/tmp/gc-gpu-host", "Data, logs and results.")
_QUICK = flags.DEFINE_bool("quick", False, "Tiny sizes: checks the script anywhere.")
_BUDGET = flags.DEFINE_integer("budget_s", 440, "Stop starting stages after this.")
_N_CELLS = flags.DEFINE_integer("n_cells", 60_000, "Cells of each synthetic file.")
_N_GENES = flags.DEFINE_integer("n_genes", 62_710, "Genes of the synthetic files.")
_MEAN_NNZ = flags.DEFINE_float("mean_nnz", 1_600.0, "Stored values per cell.")
_MLP_BATCH = flags.DEFINE_integer("mlp_batch", 1024, "Batch of the MLP runs.")
_TX_BATCH = flags.DEFINE_integer("tx_batch", 256, "Batch of the transformer runs.")
_TRAIN_WORKERS = flags.DEFINE_integer("train_workers", 8, "Loader workers in training.")
_STEPS = flags.DEFINE_integer("steps", 300, "Timed steps per training variant.")
_WORKERS = flags.DEFINE_list("workers", ["2", "4", "8", "15"], "Loader-alone workers.")
_BATCHES = flags.DEFINE_list("batches", ["64", "256"], "Loader-alone batch sizes.")
_SCD_WORKERS = flags.DEFINE_integer("scdataset_workers", 15, "scDataset's workers.")

_STAGES = flags.DEFINE_list(
    "stages",
    ["feed", "mlp", "transformer", "loader", "decode"],
    "Stages to run after making the data.",
)

QUICK = {
    "n_cells": 3_000,
    "n_genes": 300,
    "mean_nnz": 30.0,
    "mlp_batch": 256,
    "tx_batch": 64,
    "train_workers": 2,
    "steps": 10,
    "workers": ["0", "2"],
    "batches": ["64"],
    "scdataset_workers": 2,
}


class Stages:
    """Runs stages as subprocesses within one time budget; keeps the rows."""

    def __init__(self, out: str, budget_s: float):
        self.out = out
        self.deadline = time.monotonic() + budget_s
        self.rows: list[dict] = []
        self.raw: dict = {}
        os.makedirs(os.path.join(out, "logs"), exist_ok=True)

    def left(self) -> float:
        """Seconds left of the budget."""
        return self.deadline - time.monotonic()

    def run(self, name: str, command: list[str], cap_s: float, env=None) -> str | None:
        """Output of `command`, or None (the reason becomes a row)."""
        left = min(cap_s, self.left())
        if left < 10:
            self.rows.append({"what": name, "note": "skipped: time budget spent"})
            return None
        log = os.path.join(self.out, "logs", re.sub(r"\W+", "_", name) + ".log")
        print(
            f"[{time.strftime('%H:%M:%S')}] {name} (at most {left:.0f} s)", flush=True
        )
        try:
            with open(log, "w") as f:
                done = subprocess.run(
                    command,
                    cwd=ROOT,
                    env={**os.environ, **(env or {})},
                    stdout=subprocess.PIPE,
                    stderr=f,
                    text=True,
                    timeout=left,
                    check=False,
                )
        except subprocess.TimeoutExpired:
            self.rows.append({"what": name, "note": f"timed out after {left:.0f} s"})
            return None
        with open(log, "a") as f:
            f.write("\n--- stdout ---\n" + done.stdout)
        if done.returncode:
            with open(log) as f:
                tail = f.read().strip().splitlines()[-1:] or [""]
            note = f"failed ({done.returncode}): {tail[0][:120]}"
            self.rows.append({"what": name, "note": note})
            return None
        return done.stdout


def _load(path: str):
    with open(path) as f:
        return json.load(f)


def make_data(out: str, n_cells: int, n_genes: int, mean_nnz: float) -> dict:
    """The uncompressed and the gzip file (made once, cached in `out`)."""
    import bench_util

    from grain_cells.synthetic import _tahoe as synthetic

    files = {}
    for name in ("none", "gzip"):
        kwargs = bench_util.parse_compression(name, "atlas")
        files[name] = str(
            synthetic.cached_tahoe_like(
                n_cells,
                n_genes=n_genes,
                mean_nnz=mean_nnz,
                cache_dir=os.path.join(out, "data"),
                progress=False,
                **kwargs,
            )
        )
    return files


def feed_stage(s: Stages, quick: bool) -> None:
    path = os.path.join(s.out, "feed.json")
    size = ["--steps=50", "--rounds=1"] if quick else ["--steps=500", "--rounds=3"]
    command = [sys.executable, os.path.join(BENCH, "feed_overhead.py"), *size]
    if s.run("device feed", [*command, f"--json={path}"], 120) is None:
        return
    results = _load(path)
    s.raw["feed"] = results
    for r in results:
        for name, v in r["variants"].items():
            per = "call" if v["wall_us"] is None else "step"
            wall = "" if v["wall_us"] is None else f", wall {v['wall_us']:.0f} us"
            s.rows.append(
                {
                    "what": f"feed: {name}",
                    "setting": f"batch {r['batch_size']}, width {r['width']}",
                    "note": f"CPU {v['cpu_us']:.0f} us/{per}{wall} ({r['device']})",
                }
            )


_LINE = re.compile(r"^(?:\[.*?\] )?(.*?): steps/s=([\d.]+), cells/s=(\d+)", re.M)


def train_stage(s: Stages, files: dict, model: str, batch: int, workers: int):
    flags_ = [
        f"--config.data={files['none']}",
        f"--config.batch_size={batch}",
        f"--config.worker_count={workers}",
        f"--config.overhead_steps={_STEPS.value}",
    ]
    if _QUICK.value:
        flags_ += ["--config.overhead_warmup=3", "--config.num_genes=64"]
    if model == "transformer":
        config = os.path.join(ROOT, "grain_cells/examples/train/configs/transformer.py")
        flags_.insert(0, f"--config={config}")
        if _QUICK.value:
            flags_ += ["--config.hidden_size=16", "--config.token_length=16"]
    command = [
        sys.executable,
        "-m",
        "grain_cells.examples.train",
        "--measure_loader_overhead",
        *flags_,
    ]
    env = {"GRAIN_CELLS_CACHE": os.path.join(s.out, "cache")}
    out = s.run(f"train {model}", command, 200, env)
    if out is None:
        return
    setting = f"batch {batch}, {workers} workers"
    for what, steps, cells in _LINE.findall(out):
        s.rows.append(
            {
                "what": f"{model}: {what}",
                "setting": setting,
                "steps_per_s": float(steps),
                "cells_per_s": int(cells),
            }
        )
    s.raw.setdefault("train", {})[model] = out


def loader_stage(s: Stages, files: dict, quick: bool) -> None:
    window = (
        ["--warmup=5", "--minibatches=20", "--min_window_s=0.5", "--max_window_s=3"]
        if quick
        else [
            "--warmup=100",
            "--minibatches=500",
            "--min_window_s=2",
            "--max_window_s=4",
        ]
    )
    import importlib.util

    if importlib.util.find_spec("scdataset") is None:
        s.rows.append({"what": "scdataset alone", "note": "skipped: not installed"})
    for compression, path in files.items():
        for batch in (int(b) for b in _BATCHES.value):
            peers = (
                ["--peers=scdataset", f"--peer_worker_counts={_SCD_WORKERS.value}"]
                if batch == 64
                else ["--peers="]
            )
            folder = os.path.join(s.out, f"grid_{compression}_{batch}")
            command = [
                sys.executable,
                os.path.join(BENCH, "grid.py"),
                f"--data={path}",
                "--blocks=16",
                "--fetches=16",
                f"--worker_counts={','.join(_WORKERS.value)}",
                "--outputs=csr",
                "--cache=warm",
                f"--batch_size={batch}",
                "--plots=0",
                f"--output_dir={folder}",
                *window,
                *peers,
            ]
            name = f"loader alone {compression} batch {batch}"
            if s.run(name, command, 240) is None:
                continue
            points = _load(os.path.join(folder, "grid.json"))["points"]
            s.raw.setdefault("loader", []).extend(points)
            for p in points:
                row = {
                    "what": f"{p['loader']} alone, {compression}",
                    "setting": f"batch {p['batch_size']}, {p['workers']} workers",
                }
                if p.get("error"):
                    row["note"] = f"error: {p['error']}"
                else:
                    row["cells_per_s"] = p["cells_per_s"]
                    row["steps_per_s"] = p["cells_per_s"] / p["batch_size"]
                s.rows.append(row)


def decode_stage(s: Stages, files: dict) -> None:
    path = os.path.join(s.out, "decode.json")
    command = [
        sys.executable,
        os.path.join(BENCH, "decode_ceiling.py"),
        f"--data={files['gzip']}",
        f"--json={path}",
    ]
    if s.run("decode ceiling", command, 120) is None:
        return
    r = _load(path)
    s.raw["decode"] = r
    s.rows.append(
        {
            "what": "decode ceiling, gzip",
            "setting": f"{r['threads']} threads, block {r['block_size']}",
            "cells_per_s": r["fetch_cells_per_s"],
            "note": f"chunk-aligned {r['chunk_aligned_cells_per_s']} cells/s",
        }
    )


def table(rows: list[dict]) -> str:
    lines = [
        "| measurement | setting | steps/s | cells/s | note |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        steps = r.get("steps_per_s")
        cells = r.get("cells_per_s")
        lines.append(
            f"| {r['what']} | {r.get('setting', '')} | "
            f"{'' if steps is None else f'{steps:.1f}'} | "
            f"{'' if cells is None else f'{cells:,}'} | {r.get('note', '')} |"
        )
    return "\n".join(lines)


def machine() -> str:
    import jax

    devices = jax.devices()
    return (
        f"{platform.node()}: {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, jax {jax.__version__}, devices: "
        f"{devices[0].device_kind} x {len(devices)} ({devices[0].platform})"
    )


def main(argv):
    del argv
    if _QUICK.value:
        for key, value in QUICK.items():
            if not flags.FLAGS[key].present:
                flags.FLAGS[key].value = value
    out = os.path.abspath(_OUT.value)
    s = Stages(out, _BUDGET.value)
    t0 = time.monotonic()
    print(f"[{time.strftime('%H:%M:%S')}] data", flush=True)
    files = make_data(out, _N_CELLS.value, _N_GENES.value, _MEAN_NNZ.value)
    s.rows.append(
        {
            "what": "data",
            "setting": f"{_N_CELLS.value} cells x {_N_GENES.value} genes",
            "note": f"made or found in {time.monotonic() - t0:.0f} s",
        }
    )
    stages = set(_STAGES.value)
    if "feed" in stages:
        feed_stage(s, _QUICK.value)
    if "mlp" in stages:
        train_stage(s, files, "mlp", _MLP_BATCH.value, _TRAIN_WORKERS.value)
    if "transformer" in stages:
        train_stage(s, files, "transformer", _TX_BATCH.value, _TRAIN_WORKERS.value)
    if "loader" in stages:
        loader_stage(s, files, _QUICK.value)
    if "decode" in stages:
        decode_stage(s, files)
    text = f"{machine()}; {time.monotonic() - t0:.0f} s in all\n\n{table(s.rows)}"
    print(text)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"rows": s.rows, "raw": s.raw}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
