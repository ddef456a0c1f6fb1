r"""Compressed .h5ad in one run: grain_cells vs scDataset vs the decode ceiling.

Runs, back to back on the same machine state and writes one table:

1. `decode_ceiling.py` on the compressed file (all cores decoding only the
   chunks block-`--block_size` fetches need; and the chunk-aligned case);
2. `grid.py` on the compressed file at block / fetch `--block_size` /
   `--fetch_factor`: grain_cells and scDataset 0.3.0, every worker count and
   cache state;
3. `grid.py` on the compressed file with chunk-aware blocks at each
   `--aligned` point (chunks per block / block size / fetch factor);
4. `grid.py` on the uncompressed file of the same cells at the reference
   point (grain_cells only), and, with `--baseline_checkout`, the same with
   another checkout's code (to show the uncompressed path did not regress).

Figures are cells/s (real cells), mean plate entropy, worker peak RSS, and
ratios: grain_cells / scDataset at the same workers and cache, chunk-aware /
decode ceiling. The files are the cached synthetic Tahoe-shaped ones
(`--n_cells`, `--compression`, `--chunks`).

Usage:
  python benchmarks/compressed.py                    # 400k cells, gzip, ~10 min
  python benchmarks/compressed.py --baseline_checkout=/tmp/grain_cells_before
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import bench_util
from absl import app, flags

_N_CELLS = flags.DEFINE_integer("n_cells", 400_000, "Cells of the synthetic files.")
_N_GENES = flags.DEFINE_integer("n_genes", 62_710, "Genes of the synthetic files.")
_COMPRESSION = flags.DEFINE_string("compression", "gzip", "gzip or lzf.")
_CHUNKS = flags.DEFINE_string(
    "chunks",
    "atlas",
    "Chunks of the compressed file: atlas (anndata's for a file this size), "
    "default (2**16 values) or a number of values.",
)
_BLOCK = flags.DEFINE_integer("block_size", 16, "Reference block size.")
_FETCH = flags.DEFINE_integer("fetch_factor", 16, "Reference fetch factor.")
_ALIGNED = flags.DEFINE_list(
    "aligned",
    ["4/128/96", "1/32/32"],
    "Chunk-aware points, each chunks per block / most cells per block (at "
    "least that many chunks' cells) / fetch factor. 4/128/96: 48 blocks per "
    "fetch, plate entropy 3.47; 1/32/32: 64 blocks per fetch, 3.50.",
)
_WORKERS = flags.DEFINE_string(
    "worker_counts", "0,2", "Comma-separated worker process counts to measure."
)
_CACHE = flags.DEFINE_string(
    "cache",
    "cold,warm",
    "Comma-separated page-cache states: cold (file evicted first), warm.",
)
_MINIBATCHES = flags.DEFINE_integer("minibatches", 1_000, "Window per point.")
_MAX_WINDOW = flags.DEFINE_float(
    "max_window_s",
    15.0,
    "Seconds after which the warm-up and the window are each cut short.",
)
_PEERS = flags.DEFINE_string("peers", "scdataset", "Peers on the compressed file.")
_CEILING_FETCHES = flags.DEFINE_integer(
    "ceiling_fetches", 30, "decode_ceiling.py's --fetches (its sample)."
)
_CEILING_REPEATS = flags.DEFINE_integer(
    "ceiling_repeats", 3, "decode_ceiling.py's --repeats (the best is kept)."
)
_BASELINE = flags.DEFINE_string(
    "baseline_checkout",
    None,
    "Another checkout of grain_cells (e.g. before this change): its grid.py "
    "measures the uncompressed reference point too.",
)
_OUT = flags.DEFINE_string(
    "output_dir",
    "benchmarks/out/compressed",
    "Folder for compressed.json (created if missing).",
)

HERE = os.path.dirname(os.path.abspath(__file__))


def _grid(name: str, data: str, extra: list[str], checkout: str | None = None):
    """Runs grid.py (this checkout's or another's) and returns its points."""
    root = checkout or os.path.dirname(HERE)
    out = os.path.join(os.path.abspath(_OUT.value), name)
    command = [
        sys.executable,
        os.path.join(root, "benchmarks", "grid.py"),
        f"--data={data}",
        f"--worker_counts={_WORKERS.value}",
        f"--peer_worker_counts={_WORKERS.value}",
        f"--cache={_CACHE.value}",
        f"--minibatches={_MINIBATCHES.value}",
        f"--max_window_s={_MAX_WINDOW.value}",
        "--plots=0",
        f"--output_dir={out}",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": root}
    print(f"== {name}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True, cwd=root, env=env)
    with open(os.path.join(out, "grid.json")) as f:
        return json.load(f)["points"]


def main(argv):
    del argv
    os.makedirs(_OUT.value, exist_ok=True)
    started = time.time()
    load_start = os.getloadavg()
    packed = bench_util.resolve_data(
        None, _N_CELLS.value, _N_GENES.value, _COMPRESSION.value, _CHUNKS.value
    )[0]
    plain = bench_util.resolve_data(None, _N_CELLS.value, _N_GENES.value)[0]
    ceiling_json = os.path.join(_OUT.value, "decode_ceiling.json")
    subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "decode_ceiling.py"),
            f"--data={packed}",
            f"--block_size={_BLOCK.value}",
            f"--fetch_factor={_FETCH.value}",
            "--codecs",
            f"--fetches={_CEILING_FETCHES.value}",
            f"--repeats={_CEILING_REPEATS.value}",
            f"--json={ceiling_json}",
        ],
        check=True,
    )
    with open(ceiling_json) as f:
        ceiling = json.load(f)
    ref = [f"--blocks={_BLOCK.value}", f"--fetches={_FETCH.value}"]
    ref += [f"--block_size={_BLOCK.value}", f"--fetch_factor={_FETCH.value}"]
    rows = []
    aligned = []
    for point in _ALIGNED.value:
        chunks, block, fetch = (int(x) for x in point.split("/"))
        extra = [f"--chunk_aligned={chunks}", f"--blocks={block}"]
        extra += [f"--fetches={fetch}", f"--block_size={block}"]
        extra += [f"--fetch_factor={fetch}", "--peers="]
        aligned.append((f"compressed_aligned_c{chunks}", packed, extra, None))
    for name, data, extra, checkout in (
        ("compressed", packed, [*ref, f"--peers={_PEERS.value}"], None),
        *aligned,
        # Before and after alternate, twice, so drift in the machine's load
        # does not read as a difference.
        ("uncompressed_baseline", plain, [*ref, "--peers="], _BASELINE.value),
        ("uncompressed", plain, [*ref, "--peers="], None),
        ("uncompressed_baseline_2", plain, [*ref, "--peers="], _BASELINE.value),
        ("uncompressed_2", plain, [*ref, "--peers="], None),
    ):
        if name.startswith("uncompressed_") and not _BASELINE.value:
            continue  # the repeat is there to pair with the baseline
        for p in _grid(name, data, extra, checkout):
            rows.append({"run": name, **p})
    scd = {
        (r["workers"], r["cache"]): r.get("cells_per_s")
        for r in rows
        if r["loader"] == "scdataset"
    }
    for r in rows:
        rate = r.get("cells_per_s")
        if r["loader"] == "grain_cells" and rate:
            peer = scd.get((r["workers"], r["cache"]))
            r["x_scdataset"] = round(rate / peer, 2) if peer else None
            if r["run"].startswith("compressed"):
                r["x_fetch_ceiling"] = round(rate / ceiling["fetch_cells_per_s"], 2)
                r["x_aligned_ceiling"] = round(
                    rate / ceiling["chunk_aligned_cells_per_s"], 2
                )
                # Per CPU-second on both sides: what load on a shared
                # machine disturbs least.
                per_cpu = r.get("cells_per_cpu_s")
                if per_cpu:
                    r["x_fetch_ceiling_cpu"] = round(
                        per_cpu / ceiling["fetch_cells_per_cpu_s"], 2
                    )
                    r["x_aligned_ceiling_cpu"] = round(
                        per_cpu / ceiling["chunk_aligned_cells_per_cpu_s"], 2
                    )
    result = {
        "command": " ".join(sys.argv),
        "files": {
            "compressed": bench_util.describe_file(packed),
            "uncompressed": bench_util.describe_file(plain),
        },
        "file_bytes": {
            "compressed": os.path.getsize(packed),
            "uncompressed": os.path.getsize(plain),
        },
        "decode_ceiling": ceiling,
        "points": rows,
        "load": [round(x, 2) for x in (*load_start, *os.getloadavg())],
        "minutes": round((time.time() - started) / 60, 1),
    }
    with open(os.path.join(_OUT.value, "compressed.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        "| run | loader | workers | cache | block/fetch | cells/s | cells/CPU-s | "
        "entropy | worker RSS MiB | x scDataset | x ceiling (fetch / aligned) | "
        "x ceiling per CPU-s (fetch / aligned) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | {r['loader']} | error: {r['error']} |")
            continue
        rss = r.get("worker_peak_rss_mb") or []
        lines.append(
            f"| {r['run']} | {r['loader']} | {r['workers']} | {r['cache']} | "
            f"{r['block']}/{r['fetch']} | {r['cells_per_s']:,} | "
            f"{r.get('cells_per_cpu_s', 0):,} | "
            f"{r['entropy_mean']:.2f} | {max(rss) if rss else '-'} | "
            f"{r.get('x_scdataset', '')} | {r.get('x_fetch_ceiling', '-')} / "
            f"{r.get('x_aligned_ceiling', '-')} | "
            f"{r.get('x_fetch_ceiling_cpu', '-')} / "
            f"{r.get('x_aligned_ceiling_cpu', '-')} |"
        )
    lines.append(
        f"\ndecode ceiling ({ceiling['threads']} threads): block-{_BLOCK.value} "
        f"fetches {ceiling['fetch_cells_per_s']:,} cells/s, chunk-aligned "
        f"{ceiling['chunk_aligned_cells_per_s']:,} cells/s (per CPU-s: "
        f"{ceiling['fetch_cells_per_cpu_s']:,} / "
        f"{ceiling['chunk_aligned_cells_per_cpu_s']:,}); chunk-aware blocks of "
        f"n chunks {ceiling.get('aligned_blocks_cells_per_s')} (per CPU-s "
        f"{ceiling.get('aligned_blocks_cells_per_cpu_s')}); codecs (MB/s, one "
        f"core): {ceiling.get('codec_mb_per_s_one_core')}"
    )
    text = "\n".join(lines)
    with open(os.path.join(_OUT.value, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    app.run(main)
