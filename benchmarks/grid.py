r"""scDataset's block size x fetch factor grid, with the peers, and pictures.

For each block size x fetch factor x worker count x output format x cache
state, builds the loader of `loader_throughput.py` (`grain_cells.DataLoader`
over `AnnDataSource`, `BlockSampler` and `fetch_operations`), then measures:

* time to first minibatch (from opening the files, workers started included);
* cells/s over a window of `--minibatches` minibatches, and at least
  `--min_window_s` seconds, after `--warmup` minibatches (each phase cut
  short after `--max_window_s`; padding rows not counted);
* mean and standard deviation over the window's minibatches of the Shannon
  entropy (log2) of `--obs_column`, computed from the minibatches themselves
  (their `obs/<column>` codes of the rows whose `mask` is set);
* peak RSS (VmHWM) of the main process during the point and of each worker.

"cold" evicts the files from the page cache before each point; "warm" reads
them once first. Then, at the reference point (`--block_size`,
`--fetch_factor`) and on the same files, batch size and label, it measures
the peers of `peers.py` (scDataset, anndata's AnnLoader, a plain
grain.DataLoader reading one cell per record) and prints each one's ratio to
grain_cells at the same block size, fetch factor, worker count and cache
state (block 1 / fetch factor 1 for the peers that sample single cells at
random) and at the reference point.

Writes into `--output_dir`: `grid.json` and `grid.csv` (every point, updated
after each), `throughput.png` and `entropy.png` (heatmaps over block x fetch,
as in the scDataset paper's Figures 2 and 5), `tradeoff.png` (cells/s against
entropy, peers included) and `summary.md`. A progress line per point goes to
stderr.

Usage:
  python benchmarks/grid.py                           # synthetic 400k cells
  python benchmarks/grid.py --data=/tmp/synth400k.h5ad
  python benchmarks/grid.py --blocks=1,2,4,8,16,32,64 \
      --fetches=1,2,4,8,16,32,64                      # scDataset's full grid
  python benchmarks/grid.py --outputs=csr,padded --cache=cold,warm --peers=
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time

import bench_util
import loader_throughput
import numpy as np
import peers
import tqdm
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import grain_cells
from configs import grid as config_lib

_CONFIG = config_lib.get_config()
_HELP = {
    "n_cells": "Cells of the synthetic file (without --data).",
    "n_genes": "Genes of the synthetic file (without --data).",
    "obs_column": "obs column whose per-minibatch entropy is reported.",
    "batch_size": "Cells per minibatch, for grain_cells and every peer.",
    "blocks": "Block sizes of the grid (comma-separated).",
    "fetches": "Fetch factors of the grid (comma-separated).",
    "worker_counts": "grain_cells worker processes (comma-separated).",
    "outputs": "grain_cells output formats: csr, padded, dense (comma-separated).",
    "cache": "Page-cache states: cold, warm or cold,warm.",
    "padded_width": "Width of the padded output (values kept per cell); 0 fits "
    "it to the data.",
    "dense_genes": "Gene subset of the dense output (0: all genes).",
    "compression": "Synthetic file's X: none, gzip or lzf (ignored with --data).",
    "chunks": "Compressed chunks: atlas (anndata's at this size), default or a length.",
    "chunk_aligned": "N > 0: grain_cells blocks follow X's chunk grid, N chunks a "
    "block (at most --blocks cells).",
    "fetch_shuffle": "Shuffle cells inside a fetch (0 for pre-shuffled files).",
    "seed": "Seed of every sampler and shuffle.",
    "warmup": "Minibatches skipped after the first one, before the window.",
    "minibatches": "Minibatches in the measured window.",
    "max_window_s": "Cut the warm-up and the window short after this many seconds.",
    "min_window_s": "Go on past --minibatches until the window lasts this long.",
    "block_size": "Reference block size: peers run here and ratios are taken here.",
    "fetch_factor": "Reference fetch factor (see --block_size).",
    "peers": "Peers to measure (comma-separated): " + ", ".join(peers.OPEN) + ".",
    "peer_worker_counts": "Worker processes of the peers (comma-separated).",
    "output_dir": "Folder for grid.json, grid.csv, the PNGs and summary.md.",
    "plots": "Draw the PNG heatmaps and the trade-off plot (0 to skip).",
}
# loader_throughput.py already defines the flags the two binaries share
# (--data, --json and the loader's settings); this binary sets its own
# defaults on those and defines the rest.
for _key, _value in _CONFIG.items():
    _help = _HELP[_key]
    if _key in flags.FLAGS:
        flags.FLAGS.set_default(_key, _value)
        flags.FLAGS[_key].help = _help
    elif isinstance(_value, float):
        flags.DEFINE_float(_key, _value, _help)
    elif isinstance(_value, int):
        flags.DEFINE_integer(_key, _value, _help)
    else:
        flags.DEFINE_string(_key, _value, _help)
flags.adopt_module_key_flags(loader_throughput)
_POINT = flags.DEFINE_string(
    "point", None, "Internal: measure this one point (JSON) and print its figures."
)
FLAGS = flags.FLAGS

_FIELDS = [
    "loader",
    "output",
    "workers",
    "cache",
    "block",
    "fetch",
    "batch_size",
    "cells_per_s",
    "entropy_mean",
    "entropy_std",
    "first_batch_s",
    "main_peak_rss_mb",
    "worker_peak_rss_mb",
    "window_minibatches",
    "window_s",
    "speedup_same_sampling",
    "speedup_reference",
    "error",
]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def open_grain_cells(
    paths, *, output: str, workers: int, block: int, fetch: int
) -> bench_util.Loader:
    """Starts the loader that `loader_throughput.run_point` measures."""
    genes = None
    if output == "dense" and FLAGS.dense_genes:
        n_genes = grain_cells.AnnDataSource(paths[0]).num_genes
        genes = np.linspace(0, n_genes - 1, FLAGS.dense_genes).astype(np.int64)
    source = grain_cells.AnnDataSource(
        paths, block_size=block, obs_columns=[FLAGS.obs_column], genes=genes
    )
    if FLAGS.chunk_aligned:
        source = grain_cells.chunk_aligned(source, FLAGS.chunk_aligned)
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=FLAGS.seed, num_epochs=None),
        operations=grain_cells.fetch_operations(
            source,
            batch_size=FLAGS.batch_size,
            fetch_factor=fetch,
            output=loader_throughput.make_output(output),
            shuffle=bool(FLAGS.fetch_shuffle),
            seed=FLAGS.seed,
        ),
        worker_count=workers,
    )
    iterator = iter(loader)
    key = f"obs/{FLAGS.obs_column}"
    return bench_util.Loader(iterator, lambda b: b[key][b["mask"]], iterator.close)


def plan() -> list[dict]:
    """Every point of the run, grain_cells first, then the peers."""
    outputs = _names(FLAGS.outputs)
    caches = _names(FLAGS.cache)
    for c in caches:
        if c not in ("cold", "warm"):
            raise app.UsageError(f"--cache: expected cold and/or warm, got {c!r}")
    ref = (FLAGS.block_size, FLAGS.fetch_factor)
    points = []
    for output in outputs:
        for workers in _ints(FLAGS.worker_counts):
            for cache in caches:
                for block in _ints(FLAGS.blocks):
                    for fetch in _ints(FLAGS.fetches):
                        points.append(
                            _point("grain_cells", output, workers, cache, block, fetch)
                        )
    peer_points = []
    for name in _names(FLAGS.peers):
        reason = peers.missing(name)
        if reason:
            print(reason, file=sys.stderr)
            continue
        allowed = peers.WORKER_COUNTS[name]
        for workers in _ints(FLAGS.peer_worker_counts):
            if allowed is not None and workers not in allowed:
                print(
                    f"{name} skipped with {workers} workers: it runs with "
                    f"{', '.join(map(str, allowed))} only",
                    file=sys.stderr,
                )
                continue
            bf = (1, 1) if name in peers.RANDOM_SAMPLING else ref
            for cache in caches:
                peer_points.append(
                    _point(name, peers.OUTPUT[name], workers, cache, *bf)
                )
    # Ratios need grain_cells at each peer's block, fetch, workers and cache.
    have = {_key(p) for p in points}
    for p in peer_points:
        for bf in dict.fromkeys([(p["block"], p["fetch"]), ref]):
            need = _point("grain_cells", outputs[0], p["workers"], p["cache"], *bf)
            if _key(need) not in have:
                have.add(_key(need))
                points.append(need)
    return points + peer_points


def _point(loader, output, workers, cache, block, fetch) -> dict:
    return {
        "loader": loader,
        "output": output,
        "workers": workers,
        "cache": cache,
        "block": block,
        "fetch": fetch,
        "batch_size": FLAGS.batch_size,
    }


def _key(p: dict) -> tuple:
    return (p["loader"], p["output"], p["workers"], p["cache"], p["block"], p["fetch"])


def _warmup(p: dict) -> int:
    # At least one fetch per worker before the window.
    return max(FLAGS.warmup, p["fetch"] * max(1, p["workers"]))


def measure_grain_cells(paths, p: dict) -> dict:
    """Measures grain_cells at point `p` in this process."""
    return bench_util.measure_loader(
        lambda: open_grain_cells(
            paths,
            output=p["output"],
            workers=p["workers"],
            block=p["block"],
            fetch=p["fetch"],
        ),
        workers=p["workers"],
        warmup=_warmup(p),
        minibatches=FLAGS.minibatches,
        max_seconds=FLAGS.max_window_s,
        min_seconds=FLAGS.min_window_s,
    )


def run_point(paths, p: dict) -> dict:
    """Measures one point in a fresh process; a failure becomes its `error`.

    grain_cells points run this binary again with `--point`; peers run
    `peers.py`. Every point thus starts from a clean process (its RSS is its
    own) and a spawned worker imports only what its loader needs.
    """
    if p["cache"] == "cold":
        bench_util.evict_page_cache(paths)
    else:
        bench_util.warm_page_cache(paths)
    here = os.path.dirname(os.path.abspath(__file__))
    if p["loader"] == "grain_cells":
        command = [
            sys.executable,
            os.path.join(here, "grid.py"),
            *sys.argv[1:],
            f"--data={','.join(paths)}",
            f"--point={json.dumps(p)}",
        ]
    else:
        command = [
            sys.executable,
            os.path.join(here, "peers.py"),
            f"--peer={p['loader']}",
            f"--data={','.join(paths)}",
            f"--label={FLAGS.obs_column}",
            f"--batch_size={FLAGS.batch_size}",
            f"--block_size={p['block']}",
            f"--fetch_factor={p['fetch']}",
            f"--workers={p['workers']}",
            f"--seed={FLAGS.seed}",
            f"--warmup={_warmup(p)}",
            f"--minibatches={FLAGS.minibatches}",
            f"--max_window_s={FLAGS.max_window_s}",
            f"--min_window_s={FLAGS.min_window_s}",
        ]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=2 * FLAGS.max_window_s + 300,
            check=False,
        )
    except subprocess.TimeoutExpired:
        print(f"  {p['loader']} timed out", file=sys.stderr)
        return {**p, "error": "timed out"}
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = done.stderr.strip().splitlines()[-3:]
        print(f"  {p['loader']} failed: " + " / ".join(tail), file=sys.stderr)
        return {**p, "error": tail[-1] if tail else f"exit {done.returncode}"}
    return {**p, **json.loads(lines[-1])}


def add_ratios(results: list[dict]) -> None:
    """Speedup of grain_cells over each peer: same sampling, and reference."""
    rates = {
        (r["workers"], r["cache"], r["block"], r["fetch"]): r.get("cells_per_s")
        for r in results
        if r["loader"] == "grain_cells" and r["output"] == _names(FLAGS.outputs)[0]
    }
    ref = (FLAGS.block_size, FLAGS.fetch_factor)
    for r in results:
        if r["loader"] == "grain_cells" or not r.get("cells_per_s"):
            continue
        for field, bf in (
            ("speedup_same_sampling", (r["block"], r["fetch"])),
            ("speedup_reference", ref),
        ):
            ours = rates.get((r["workers"], r["cache"], *bf))
            r[field] = round(ours / r["cells_per_s"], 2) if ours else None


def machine() -> dict:
    """What the figures were taken on."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if "model name" in line),
                cpu,
            )
    except OSError:
        pass
    versions = {}
    for package in ("grain", "anndata", "h5py", "numpy", "scdataset", "torch"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gb": round(
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        ),
        "python": platform.python_version(),
        "versions": versions,
    }


def write_tables(path_json, path_csv, header: dict, results: list[dict]) -> None:
    """Writes every point so far as JSON and CSV."""
    with open(path_json, "w") as f:
        json.dump({**header, "points": results}, f, indent=1)
    with open(path_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, _FIELDS)
        writer.writeheader()
        for r in results:
            row = {k: r.get(k) for k in _FIELDS}
            row["worker_peak_rss_mb"] = ";".join(
                str(x) for x in r.get("worker_peak_rss_mb") or []
            )
            writer.writerow(row)


def _panels(results: list[dict]) -> list[tuple[str, int, str, dict]]:
    """grain_cells grid points by (output, workers, cache): block x fetch."""
    blocks, fetches = _ints(FLAGS.blocks), _ints(FLAGS.fetches)
    panels = {}
    for r in results:
        if (
            r["loader"] == "grain_cells"
            and "cells_per_s" in r
            and r["block"] in blocks
            and r["fetch"] in fetches
        ):
            key = (r["output"], r["workers"], r["cache"])
            panels.setdefault(key, {})[(r["block"], r["fetch"])] = r
    return [(*k, v) for k, v in panels.items()]


def heatmap(
    results,
    field: str,
    title: str,
    path: str,
    fmt,
    cmap: str,
    *,
    per_cache: bool = True,
    value_range: tuple[float, float] | None = None,
    spread: str | None = None,
) -> None:
    """One heatmap over block x fetch per (output, workers, cache).

    With `per_cache=False`, one per (output, workers): for figures that do
    not depend on the page cache, such as the entropy. `value_range` fixes
    the colour scale (else the points' own min and max); `spread` names a
    field printed under each value as `±spread` (the entropy's standard
    deviation over minibatches), so a difference smaller than it reads as
    noise. Titles are wrapped to fit (`bench_util.fit_titles`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    panels = _panels(results)
    if not per_cache:
        firsts = {}
        for output, workers, _, grid in panels:
            firsts.setdefault((output, workers), (output, workers, "any cache", grid))
        panels = list(firsts.values())
    if not panels:
        return
    blocks, fetches = _ints(FLAGS.blocks), _ints(FLAGS.fetches)
    values = [r[field] for *_, grid in panels for r in grid.values()]
    vmin, vmax = value_range or (min(values), max(values))
    cols = min(len(panels), 2)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(0.9 * len(fetches) * cols + 2.2, 0.75 * len(blocks) * rows + 1.6),
        squeeze=False,
        constrained_layout=True,
    )
    image = None
    for ax, (output, workers, cache, grid) in zip(axes.flat, panels, strict=False):
        m = np.full((len(blocks), len(fetches)), np.nan)
        sd = np.full_like(m, np.nan)
        for (b, f), r in grid.items():
            m[blocks.index(b), fetches.index(f)] = r[field]
            if spread:
                sd[blocks.index(b), fetches.index(f)] = r.get(spread, np.nan)
        image = ax.imshow(m, origin="lower", cmap=cmap, vmin=vmin, vmax=vmax)
        mid = (vmin + vmax) / 2
        for i in range(len(blocks)):
            for j in range(len(fetches)):
                if not np.isnan(m[i, j]):
                    ax.text(
                        j,
                        i,
                        fmt(m[i, j])
                        + ("" if np.isnan(sd[i, j]) else f"\n±{fmt(sd[i, j])}"),
                        ha="center",
                        va="center",
                        fontsize=7 if spread else 8,
                        color="white" if m[i, j] < mid else "black",
                    )
        ax.set_xticks(range(len(fetches)), [str(f) for f in fetches])
        ax.set_yticks(range(len(blocks)), [str(b) for b in blocks])
        ax.set_xlabel("fetch factor")
        ax.set_ylabel("block size")
        ax.set_title(f"{output}, {workers} workers, {cache}", fontsize=9)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, shrink=0.8, format=FuncFormatter(lambda v, _: fmt(v)))
    suptitle = fig.suptitle(title, fontsize=10)
    bench_util.fit_titles(fig, suptitle)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tradeoff_plot(results, path: str, title: str) -> None:
    """cells/s against minibatch entropy, one panel per cache state.

    grain_cells' grid points are small dots labelled block/fetch (labels on
    the first series only); each peer is one large marker per worker count.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    panels = _panels(results)
    caches = list(dict.fromkeys(c for *_, c, _ in panels))
    caches += [
        r["cache"]
        for r in results
        if r["loader"] != "grain_cells" and r["cache"] not in caches
    ]
    caches = list(dict.fromkeys(caches))
    if not caches:
        return
    fig, axes = plt.subplots(
        1,
        len(caches),
        figsize=(5.2 * len(caches), 5.2),
        sharey=True,
        squeeze=False,
        constrained_layout=True,
    )
    series = list(dict.fromkeys((o, w) for o, w, *_ in panels))
    peer_names = list(dict.fromkeys(r["loader"] for r in results))
    peer_names = [n for n in peer_names if n != "grain_cells"]
    peer_colors = {n: f"C{len(series) + i}" for i, n in enumerate(peer_names)}
    for ax, cache in zip(axes[0], caches, strict=True):
        for output, workers, c, grid in panels:
            if c != cache:
                continue
            k = series.index((output, workers))
            pts = sorted(grid.values(), key=lambda r: (r["block"], r["fetch"]))
            ax.scatter(
                [r["entropy_mean"] for r in pts],
                [r["cells_per_s"] for r in pts],
                s=16,
                color=f"C{k}",
                label=f"grain_cells {output}, {workers} workers",
            )
            for r in pts if k == 0 else ():
                ax.annotate(
                    f"{r['block']}/{r['fetch']}",
                    (r["entropy_mean"], r["cells_per_s"]),
                    fontsize=6,
                    xytext=(3, -2),
                    textcoords="offset points",
                )
        for r in results:
            if r["loader"] == "grain_cells" or r["cache"] != cache:
                continue
            if "cells_per_s" not in r:
                continue
            ax.scatter(
                [r["entropy_mean"]],
                [r["cells_per_s"]],
                s=70,
                marker="s" if r["workers"] == 0 else "D",
                color=peer_colors[r["loader"]],
                edgecolors="black",
                label=f"{r['loader']}, {r['workers']} workers",
            )
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _k(v)))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.set_xlabel(f"mean {FLAGS.obs_column} entropy per minibatch (log2)")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"{cache} page cache", fontsize=9)
    axes[0][0].set_ylabel("cells/s")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="outside lower center", ncol=3, fontsize=7, frameon=False
    )
    suptitle = fig.suptitle(
        f"{title}: throughput against diversity (dots: block/fetch)", fontsize=10
    )
    bench_util.fit_titles(fig, suptitle)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _k(x: float) -> str:
    return f"{x / 1000:.0f}k" if x >= 10_000 or x == 0 else f"{x / 1000:.1f}k"


def summary(header: dict, results: list[dict]) -> str:
    """The markdown summary: grid matrices, then the peer table."""
    blocks, fetches = _ints(FLAGS.blocks), _ints(FLAGS.fetches)
    lines = [
        "# grain_cells block x fetch grid",
        "",
        f"Files: {', '.join(f['path'] for f in header['files'])} "
        f"({header['cells']:,} cells). "
        f"Batch {FLAGS.batch_size}, label `{FLAGS.obs_column}`. "
        f"{header['machine']['cores']} cores, {header['machine']['cpu']}; "
        f"load average {header['load_start']} at start, {header['load_end']} "
        f"at end; {header['started']}, {header['minutes']} min.",
        "",
        "Cells: cells/s and mean entropy (log2) of the label per minibatch.",
    ]
    for output, workers, cache, grid in _panels(results):
        lines += [
            "",
            f"## grain_cells, {output}, {workers} workers, {cache}",
            "",
            "| block \\ fetch | " + " | ".join(str(f) for f in fetches) + " |",
            "| --- |" + " --- |" * len(fetches),
        ]
        for b in blocks:
            cells = []
            for f in fetches:
                r = grid.get((b, f))
                cells.append(
                    f"{r['cells_per_s']:,} / {r['entropy_mean']:.2f}" if r else ""
                )
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
    peer_rows = [r for r in results if r["loader"] != "grain_cells"]
    if peer_rows:
        lines += [
            "",
            "## Peers",
            "",
            f"grain_cells x: its cells/s divided by the peer's, at the peer's "
            f"block/fetch (1/1 for single-cell random sampling), and at the "
            f"reference {FLAGS.block_size}/{FLAGS.fetch_factor}; same workers "
            f"and cache.",
            "",
            "| loader | workers | cache | block/fetch | cells/s | entropy | "
            "first batch (s) | main / worker RSS (MiB) | grain_cells x (same) | "
            "grain_cells x (ref) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in peer_rows:
            if "error" in r:
                lines.append(
                    f"| {r['loader']} | {r['workers']} | {r['cache']} | "
                    f"{r['block']}/{r['fetch']} | failed: {r['error']} |"
                    " | | | | |"
                )
                continue
            lines.append(
                f"| {r['loader']} | {r['workers']} | {r['cache']} | "
                f"{r['block']}/{r['fetch']} | {r['cells_per_s']:,} | "
                f"{r['entropy_mean']:.2f} | {r['first_batch_s']:.2f} | "
                f"{r['main_peak_rss_mb']:.0f} / "
                f"{', '.join(f'{w:.0f}' for w in r['worker_peak_rss_mb']) or '-'} | "
                f"{r.get('speedup_same_sampling') or '-'} | "
                f"{r.get('speedup_reference') or '-'} |"
            )
    lines += [
        "",
        "## Every point",
        "",
        "| loader | output | workers | cache | block | fetch | cells/s | entropy "
        "(mean +- std) | first batch (s) | main RSS (MiB) | worker RSS (MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if "error" in r:
            continue
        lines.append(
            f"| {r['loader']} | {r['output']} | {r['workers']} | {r['cache']} | "
            f"{r['block']} | {r['fetch']} | {r['cells_per_s']:,} | "
            f"{r['entropy_mean']:.2f} +- {r['entropy_std']:.2f} | "
            f"{r['first_batch_s']:.2f} | {r['main_peak_rss_mb']:.0f} | "
            f"{', '.join(f'{w:.0f}' for w in r['worker_peak_rss_mb']) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def _describe(p: dict) -> str:
    return (
        f"{p['loader']} {p['output']} workers={p['workers']} {p['cache']} "
        f"block={p['block']} fetch={p['fetch']}"
    )


def main(argv):
    del argv
    if _POINT.value:  # one point, run by run_point in a process of its own
        print(json.dumps(measure_grain_cells(FLAGS.data, json.loads(_POINT.value))))
        return
    started = time.time()
    paths = bench_util.resolve_data(
        FLAGS.data, FLAGS.n_cells, FLAGS.n_genes, FLAGS.compression, FLAGS.chunks
    )
    points = plan()
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    out = lambda name: os.path.join(FLAGS.output_dir, name)  # noqa: E731
    labelled = grain_cells.AnnDataSource(paths, obs_columns=[FLAGS.obs_column])
    categories = labelled.categories[FLAGS.obs_column]
    header = {
        "data": "given (--data)" if FLAGS.data else "synthetic",
        "files": [bench_util.describe_file(p) for p in paths],
        "cells": labelled.num_cells,
        # Distinct labels: the entropy's scale is [0, log2(min(labels, batch))].
        "labels": int(
            len(categories)
            if categories is not None
            else np.unique(labelled.obs_values(FLAGS.obs_column)).size
        ),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "flags": bench_util.data_record(
            [], {k: getattr(FLAGS, k) for k in _CONFIG}, synthetic=not FLAGS.data
        )["flags"],
        "machine": machine(),
        "load_start": [round(x, 2) for x in os.getloadavg()],
    }
    results = []
    print(
        f"{len(points)} points on {', '.join(paths)}; writing to {FLAGS.output_dir}",
        file=sys.stderr,
    )
    bar = tqdm.tqdm(points, desc="grid", unit="point", file=sys.stderr)
    for p in bar:
        bar.set_postfix_str(_describe(p))
        r = run_point(paths, p)
        results.append(r)
        if "error" not in r:
            tqdm.tqdm.write(
                f"{_describe(p)}: {r['cells_per_s']:,} cells/s, entropy "
                f"{r['entropy_mean']:.2f} +- {r['entropy_std']:.2f}, first "
                f"{r['first_batch_s']:.2f} s, RSS main {r['main_peak_rss_mb']} "
                f"workers {r['worker_peak_rss_mb']} MiB",
                file=sys.stdout,
            )
        add_ratios(results)
        write_tables(out("grid.json"), out("grid.csv"), header, results)
    header["load_end"] = [round(x, 2) for x in os.getloadavg()]
    header["minutes"] = round((time.time() - started) / 60, 1)
    write_tables(out("grid.json"), out("grid.csv"), header, results)
    if FLAGS.json:
        write_tables(FLAGS.json, os.devnull, header, results)
    plots = bool(FLAGS.plots)
    if plots and importlib.util.find_spec("matplotlib") is None:
        plots = False
        print(
            'matplotlib not installed: no pictures (pip install -e ".[bench]")',
            file=sys.stderr,
        )
    if plots:
        title = (
            f"{os.path.basename(paths[0])}{' +' if len(paths) > 1 else ''}, "
            f"batch {FLAGS.batch_size}"
        )
        heatmap(
            results,
            "cells_per_s",
            f"grain_cells cells/s over block size x fetch factor ({title})",
            out("throughput.png"),
            _k,
            "viridis",
        )
        heatmap(
            results,
            "entropy_mean",
            f"mean {FLAGS.obs_column} entropy per minibatch, log2 ({title}); "
            f"scale 0 to log2({header['labels']}), ± the std over minibatches",
            out("entropy.png"),
            lambda v: f"{v:.2f}",
            "magma",
            per_cache=False,
            value_range=bench_util.entropy_range(header["labels"], FLAGS.batch_size),
            spread="entropy_std",
        )
        tradeoff_plot(results, out("tradeoff.png"), title)
    text = summary(header, results)
    with open(out("summary.md"), "w") as f:
        f.write(text)
    peer_part = text.split("## Peers", 1)
    if len(peer_part) == 2:
        print("\n## Peers" + peer_part[1].split("## Every point", 1)[0].rstrip())
    print(
        f"done in {header['minutes']} min; wrote {FLAGS.output_dir}/"
        "{grid.json,grid.csv,summary.md" + (",*.png}" if plots else "}"),
        file=sys.stderr,
    )


if __name__ == "__main__":
    app.run(main)
