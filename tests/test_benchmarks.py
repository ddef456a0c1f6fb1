"""Every binary in benchmarks/ runs on a tiny config, so none of them rots.

Each runs as a subprocess, as a person runs it, on a 2,000-cell x 300-gene
synthetic file in a temporary folder (grid.py also makes its own synthetic
file, to cover the no-`--data` path), with `GRAIN_CELLS_CACHE` pointed at the
temporary folder and short windows. Checked: exit status 0, the lines each
prints and the files each writes. The peers of grid.py run where they are
installed (`.[bench]`) and must otherwise be skipped with a message.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from grain_cells.synthetic import _tahoe as synthetic

# Each test runs a benchmark binary in a subprocess: seconds each.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT_S = 120
# Cells of the synthetic files that grid.py and compressed.py make themselves,
# in the module's cache (compressed.py reuses grid.py's uncompressed one).
# No fewer: decode_ceiling.py (run by compressed.py) draws each fetch's 64
# blocks of 16 cells without replacement, and 1,000 cells hold 63.
SYNTHETIC_CELLS = 2_000
PEER_MODULES = {
    "scdataset": ("scdataset", "torch"),
    "annloader": ("torch",),
    "grain_per_cell": ("grain",),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("benchmarks")


@pytest.fixture(scope="module")
def data_file(workdir) -> str:
    path = workdir / "tiny.h5ad"
    synthetic.write_tahoe_like(path, 2_000, n_genes=300, mean_nnz=30)
    return str(path)


def synthetic_nnz(path: str) -> int:
    """Stored values of a file's X, read with anndata (the oracle)."""
    import anndata

    return int(anndata.read_h5ad(path).X.nnz)


@pytest.fixture(scope="module", autouse=True)
def _forked(forked_runs):
    """`run` below forks each binary from one pre-imported process
    (tests/forked_runs.py): the imports of a fresh interpreter were most of
    a tiny run's CPU."""
    global _runs
    _runs = forked_runs
    yield
    _runs = None


_runs = None


def run(workdir: pathlib.Path, binary: str, *flags: str) -> subprocess.CompletedProcess:
    """`python benchmarks/<binary> <flags>` in `workdir`, as a user runs it."""
    done = _runs.run(
        [str(ROOT / "benchmarks" / binary), *flags],
        timeout=TIMEOUT_S,
        cwd=workdir,
        env={**os.environ, "GRAIN_CELLS_CACHE": str(workdir / "cache")},
    )
    assert done.returncode == 0, f"{binary} failed:\n{done.stderr[-3000:]}"
    return done


def test_read_throughput(workdir, data_file):
    out = workdir / "read.json"
    done = run(
        workdir,
        "read_throughput.py",
        f"--data={data_file}",
        "--reads=5",
        "--blocks_per_read=4",
        f"--json={out}",
    )
    for state in ("cold", "warm"):
        for how in ("fetch", "read_blocks"):
            assert f"{state:5s} {how:12s}" in done.stdout
            assert json.loads(out.read_text())[f"{state}_{how}_cells_per_s"] > 0


def test_loader_throughput(workdir, data_file):
    out = workdir / "loader.json"
    done = run(
        workdir,
        "loader_throughput.py",
        f"--data={data_file}",
        "--outputs=csr,padded",
        "--worker_counts=0,1",  # a spawned worker costs seconds of imports
        "--cache=warm",
        "--padded_width=64",
        "--warmup=2",
        "--minibatches=20",
        f"--json={out}",
    )
    results = json.loads(out.read_text())["results"]
    assert [(r["output"], r["worker_count"]) for r in results] == [
        ("csr", 0),
        ("csr", 1),
        ("padded", 0),
        ("padded", 1),
    ]
    for r in results:
        assert r["cells_per_s"] > 0
        assert len(r["worker_peak_rss_mb"]) == r["worker_count"]
    assert done.stdout.count("warm") == 4
    # What was measured: the file given, its shape, not the synthetic defaults.
    record = json.loads(out.read_text())
    assert record["data"] == "given (--data)"
    (described,) = record["files"]
    assert described["path"] == data_file
    assert described["shape"] == [2_000, 300]
    assert described["encoding"] == "csr_matrix"
    assert described["nnz"] == synthetic_nnz(data_file)
    assert "n_cells" not in record["flags"] and "n_genes" not in record["flags"]
    assert record["flags"]["batch_size"] == 64


def test_loader_throughput_on_a_zarr_store(workdir, data_file):
    """A zarr store (a directory) is warmed and evicted file by file, and the
    worker RSS column has one value per worker (not multiprocessing's
    resource tracker)."""
    import warnings

    import anndata

    store = workdir / "tiny.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        anndata.read_h5ad(data_file).write_zarr(store)
    out = workdir / "loader_zarr.json"
    done = run(
        workdir,
        "loader_throughput.py",
        f"--data={store}",
        "--outputs=csr",
        "--worker_counts=2",
        "--cache=warm,cold",
        "--warmup=2",
        "--minibatches=10",
        f"--json={out}",
    )
    results = json.loads(out.read_text())["results"]
    assert [r["cache"] for r in results] == ["warm", "cold"]
    for r in results:
        assert r["cells_per_s"] > 0
        assert len(r["worker_peak_rss_mb"]) == 2, r
    assert done.stdout.count(" warm ") == 1
    (described,) = json.loads(out.read_text())["files"]
    assert described["shape"] == [2_000, 300] and described["bytes"] > 0


def test_page_cache_helpers_walk_a_store_directory(tmp_path, monkeypatch):
    bench_util = _bench_util(monkeypatch)
    store = tmp_path / "s.zarr"
    (store / "X" / "data" / "c").mkdir(parents=True)
    (store / "zarr.json").write_text("{}")
    (store / "X" / "data" / "c" / "0").write_bytes(b"x" * 5000)
    single = tmp_path / "a.h5ad"
    single.write_bytes(b"y" * 10)
    assert bench_util.files_under([str(store), str(single)]) == [
        str(store / "zarr.json"),
        str(store / "X" / "data" / "c" / "0"),
        str(single),
    ]
    bench_util.warm_page_cache([str(store), str(single)])  # IsADirectoryError before
    bench_util.evict_page_cache([str(store), str(single)])


@pytest.mark.parametrize("server", ["python", "nginx"])
def test_object_store(workdir, data_file, server):
    pytest.importorskip("obstore", reason="obstore is not installed (.[cloud])")
    from grain_cells.testing import nginx_folder

    if server == "nginx" and (
        nginx_folder.find_nginx() is None or nginx_folder.echo_module() is None
    ):
        pytest.skip(
            f"nginx with its echo module is not installed: {nginx_folder.INSTALL_HINT}"
        )
    out = workdir / f"object_store_{server}.json"
    done = run(
        workdir,
        "object_store.py",
        f"--data={data_file}",
        f"--bucket_root={workdir / 'buckets'}",
        f"--server={server}",
        "--worker_counts=0",
        "--rtt_ms=2",
        "--warmup=1",
        "--minibatches=10",
        "--repeats=2",
        f"--json={out}",
    )
    results = json.loads(out.read_text())["results"]
    rows = [r for r in results if "repeats" not in r]
    assert [(r["repeat"], r["server_cache"]) for r in rows] == [
        (0, "cold"),
        (0, "warm"),
        (1, "cold"),
        (1, "warm"),
    ]
    medians = [r for r in results if "repeats" in r]
    assert [(m["server_cache"], m["repeats"]) for m in medians] == [
        ("cold", 2),
        ("warm", 2),
    ]
    for m, cache in zip(medians, ["cold", "warm"], strict=True):
        ratios = sorted(r["ratio"] for r in rows if r["server_cache"] == cache)
        assert m["median_ratio"] == pytest.approx(sum(ratios) / 2)
    assert "medians:" in done.stdout
    for row in rows:
        assert row["worker_count"] == 0 and row["server"] == server
        assert row["local_cold_cells_per_s"] > 0 and row["s3_cells_per_s"] > 0
        assert row["range_gets_per_fetch"] > 0 and row["mb_per_fetch"] > 0
        assert row["server_cpu_us_per_get"] >= 0
        assert row["server_disk_per_byte_served"] >= 0
    assert rows[0]["local"] == rows[1]["local"]  # one local point per round
    assert "server us/GET" in done.stdout and "disk/served" in done.stdout


def test_range_get_cpu(workdir, data_file):
    pytest.importorskip("obstore", reason="obstore is not installed (.[cloud])")
    out = workdir / "range_get_cpu.json"
    run(
        workdir,
        "range_get_cpu.py",
        f"--data={data_file}",
        "--gets=20",
        "--range_kib=4",
        "--styles=threads=4,async=4,get_ranges",
        f"--json={out}",
    )
    rows = json.loads(out.read_text())["results"]
    assert [r["style"] for r in rows] == ["threads=4", "async=4", "get_ranges"]
    assert all(r["gets_per_s"] > 0 and r["cpu_us_per_get"] > 0 for r in rows)


def test_object_store_cpu(workdir, data_file):
    pytest.importorskip("obstore", reason="obstore is not installed (.[cloud])")
    out = workdir / "object_store_cpu.json"
    run(
        workdir,
        "object_store_cpu.py",
        f"--data={data_file}",
        "--via_proxy",  # the default holds answers in the server: cover the relay
        "--in_flight=4",
        "--rtt_ms=2",
        "--warmup=1",
        "--minibatches=5",
        f"--json={out}",
    )
    (row,) = json.loads(out.read_text())["results"]
    assert row["max_in_flight"] == 4 and row["cells_per_s"] > 0
    assert row["reader_cores"] > 0 and "server_cores" in row and "proxy_cores" in row


def test_s3_servers(workdir):
    pytest.importorskip("moto", reason="moto is not installed (.[test])")
    pytest.importorskip("obstore", reason="obstore is not installed (.[cloud])")
    out = workdir / "s3_servers.json"
    done = run(workdir, "s3_servers.py", "--sizes_mb=1", "--gets=2", f"--json={out}")
    (row,) = json.loads(out.read_text())["results"]
    assert row["moto_ms_per_get"] > 0 and row["folder_ms_per_get"] > 0
    assert "folder ms/GET" in done.stdout


def test_call_paths(workdir):
    out = workdir / "call_paths.json"
    done = run(workdir, "call_paths.py", f"--json={out}")
    got = json.loads(out.read_text())
    for fmt in ("h5ad", "zarr"):
        for path in ("inspect", "fetch_cold", "fetch"):
            assert got[f"{fmt}/{path}"]["crossings"] > 0, (fmt, path)
        # A warm fetch's calls only go down the layers (BUILD.md, "Call paths");
        # a first fetch and an inspection climb back up along at most 5 edges.
        assert got[f"{fmt}/fetch"]["climbs"] == 0, got[f"{fmt}/fetch"]["edges"]
        for path in ("inspect", "fetch_cold"):
            point = got[f"{fmt}/{path}"]
            assert point["climbing_edges"] <= 5, (fmt, path, point["edges"])
    assert "climbing_edges=" in done.stdout


def test_transport_throughput(workdir):
    baseline = workdir / "transport_copy.py"  # "another checkout's" ring
    ring = ROOT / "grain_cells" / "transport" / "_ring.py"
    baseline.write_text(ring.read_text())
    done = run(
        workdir,
        "transport_throughput.py",
        "--minibatches=30",
        "--repeats=1",
        "--values_per_cell=50",
        "--ways=baseline,ring,pickle",
        f"--baseline={baseline}",
    )
    lines = done.stdout.splitlines()
    for way in ("baseline", "ring", "pickle"):
        assert any(line.startswith(way) and "minibatches/s" in line for line in lines)


def test_diversity(workdir, data_file):
    out = workdir / "diversity.json"
    done = run(
        workdir,
        "diversity.py",
        f"--data={data_file}",
        "--blocks=4,16",
        "--fetches=4,16",
        "--minibatches=50",
        f"--json={out}",
    )
    assert "random sampling (block 1, fetch 1)" in done.stdout
    results = json.loads(out.read_text())["results"]
    assert len(results) == 4
    for r in results:
        assert 0 <= r["mean"] <= math.log2(14)


def test_disk_ceiling(workdir, data_file):
    out = workdir / "disk.json"
    done = run(
        workdir,
        "disk_ceiling.py",
        f"--data={data_file}",
        "--depths=1,4",
        "--bytes=200000",
        f"--json={out}",
    )
    assert "sequential 8 MiB reads" in done.stdout
    assert done.stdout.count("random ") == 2
    figures = json.loads(out.read_text())
    assert figures["bytes_per_cell"] > 0
    assert "random_qd4_GBps" in figures


def test_preshuffle(workdir, data_file):
    out = workdir / "preshuffled"
    done = run(
        workdir,
        "preshuffle.py",
        f"--data={data_file}",
        f"--output_dir={out}",
        "--cells_per_file=1000",
        "--cache=asis",
        f"--json={workdir / 'preshuffle.json'}",
    )
    assert done.stdout.strip()
    assert len(list(out.glob("*.h5ad"))) == 2


def test_preshuffle_bucket_to_bucket(workdir, data_file, s3):
    """The binary's URL inputs and output (moto on localhost)."""
    url = s3.upload(data_file, "bench-in/tiny.h5ad")
    options = ",".join(f"{k}={v}" for k, v in s3.options.items())
    for _ in range(2):  # the second run deletes the first's parts first
        done = run(
            workdir,
            "preshuffle.py",
            f"--data={url}",
            f"--output_dir=s3://{s3.bucket}/bench-out",
            f"--storage_options={options}",
            "--cells_per_file=1000",
            f"--staging_dir={workdir / 'staging'}",
            f"--json={workdir / 'preshuffle-s3.json'}",
        )
        assert "into 2 part(s)" in done.stdout
    listed = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix="bench-out/")
    assert sorted(o["Key"] for o in listed["Contents"]) == [
        "bench-out/part-00000.h5ad",
        "bench-out/part-00001.h5ad",
        "bench-out/preshuffle.json",
    ]
    figures = json.loads((workdir / "preshuffle-s3.json").read_text())
    assert figures["cells"] == 2000 and figures["output_gb"] > 0


def test_grid(workdir):
    """No --data: the synthetic file is made in GRAIN_CELLS_CACHE."""
    out = workdir / "grid"
    # Each point is a process of its own (seconds of imports): two points,
    # and the reference point (16, 1) is one of them, so the peers add none.
    blocks, fetches = [1, 16], [1]
    done = run(
        workdir,
        "grid.py",
        f"--n_cells={SYNTHETIC_CELLS}",
        "--n_genes=2000",
        "--blocks=1,16",
        "--fetches=1",
        "--worker_counts=0",
        "--cache=cold",
        "--block_size=16",
        "--fetch_factor=1",
        "--warmup=2",
        "--minibatches=20",
        "--min_window_s=0",
        "--max_window_s=2",
        "--peers=scdataset,annloader,grain_per_cell",
        "--peer_worker_counts=0",
        f"--output_dir={out}",
    )
    assert list((workdir / "cache").glob(f"tahoe_like-n{SYNTHETIC_CELLS}-g2000-*.h5ad"))
    assert "grid: 100%" in done.stderr  # the progress bar

    points = json.loads((out / "grid.json").read_text())["points"]
    ours = {(p["block"], p["fetch"]): p for p in points if p["loader"] == "grain_cells"}
    assert set(ours) == {(b, f) for b in blocks for f in fetches}
    for p in ours.values():
        assert "error" not in p, p
        assert p["cells_per_s"] > 0
        assert 0 <= p["entropy_mean"] <= math.log2(14)
        assert p["first_batch_s"] > 0
        assert p["main_peak_rss_mb"] > 0
    # Block 16 x fetch factor 1: each minibatch holds four blocks of 16 cells,
    # so fewer plates than a random minibatch.
    assert ours[(16, 1)]["entropy_mean"] < ours[(1, 1)]["entropy_mean"]

    for name, modules in PEER_MODULES.items():
        runs = [p for p in points if p["loader"] == name]
        if all(importlib.util.find_spec(m) for m in modules):
            assert len(runs) == 1 and "error" not in runs[0], runs
            assert runs[0]["cells_per_s"] > 0
            assert runs[0]["speedup_reference"] > 0
            assert f"| {name} | 0 |" in done.stdout
        else:
            assert f"{name} skipped: " in done.stderr

    with open(out / "grid.csv") as f:
        assert len(list(csv.DictReader(f))) == len(points)
    if importlib.util.find_spec("matplotlib"):
        for picture in ("throughput.png", "entropy.png", "tradeoff.png"):
            assert (out / picture).read_bytes()[:4] == b"\x89PNG"
    else:
        assert "matplotlib not installed" in done.stderr
    summary = (out / "summary.md").read_text()
    assert "## grain_cells, csr, 0 workers, cold" in summary
    assert "## Every point" in summary


def test_identity_cost(workdir, data_file):
    out = workdir / "identity.json"
    done = run(
        workdir,
        "identity_cost.py",
        f"--data={data_file}",
        "--repeats=2",
        "--checks=100",
        "--fetches=5",
        "--blocks_per_read=4",
        f"--json={out}",
    )
    assert "check_share_of_fetch" in done.stdout
    figures = json.loads(out.read_text())
    assert figures["check_us"] > 0 and figures["fetch_ms"] > 0


def test_token_throughput(workdir, data_file):
    out = workdir / "tokens.json"
    done = run(
        workdir,
        "token_throughput.py",
        f"--data={data_file}",
        "--worker_counts=0",
        "--length=32",
        "--n_bins=5",
        "--warmup=2",
        "--minibatches=10",
        f"--json={out}",
    )
    results = json.loads(out.read_text())["results"]
    assert [r["output"] for r in results] == ["csr", "rank_value", "value_bin"]
    assert results[0]["ratio_to_csr"] == 1.0
    assert all(r["cells_per_s"] > 0 and r["ratio_to_csr"] > 0 for r in results)
    assert "rank_value" in done.stdout


def test_token_steps(workdir, data_file):
    out = workdir / "token_steps.json"
    done = run(
        workdir,
        "token_steps.py",
        f"--data={data_file}",
        "--fetches=1",
        "--repeats=1",
        "--length=32",
        "--n_bins=5",
        f"--json={out}",
    )
    steps = {
        r["step"]: r["ms_per_1024_cells"]
        for r in json.loads(out.read_text())["results"]
    }
    assert {"read", "csr", "rank_value/numba", "value_bin/numpy"} <= set(steps)
    assert all(ms >= 0 for ms in steps.values())
    assert "kernel: + sort" in done.stdout


@pytest.fixture(scope="module")
def gzip_file(workdir) -> str:
    path = workdir / "tiny-gzip.h5ad"
    synthetic.write_tahoe_like(
        path, 2_000, n_genes=300, mean_nnz=30, compression="gzip", chunks=500
    )
    return str(path)


def test_decode_ceiling(workdir, gzip_file):
    out = workdir / "ceiling.json"
    run(
        workdir,
        "decode_ceiling.py",
        f"--data={gzip_file}",
        "--fetches=3",
        "--repeats=1",
        "--codecs",
        f"--json={out}",
    )
    figures = json.loads(out.read_text())
    assert figures["pipeline"] == {"data": "deflate", "indices": "deflate"}
    assert figures["chunk_elements"]["data"] == 500
    assert figures["fetch_cells_per_s"] > 0
    assert figures["chunk_aligned_cells_per_s"] > 0
    assert figures["codec_mb_per_s_one_core"]["zlib"]["data"] > 0


def test_compressed_suite(workdir):
    """The one-run comparison, tiny: no peers, one worker count, warm only."""
    out = workdir / "compressed"
    done = run(
        workdir,
        "compressed.py",
        f"--n_cells={SYNTHETIC_CELLS}",
        "--n_genes=2000",
        "--worker_counts=0",
        "--cache=warm",
        "--minibatches=10",
        "--max_window_s=0.2",  # warm-up and window of each point
        "--peers=",
        "--aligned=2/64/32",
        "--ceiling_fetches=3",  # the ceiling's own test samples more
        "--ceiling_repeats=1",
        f"--output_dir={out}",
    )
    points = json.loads((out / "compressed.json").read_text())["points"]
    assert {p["run"] for p in points} == {
        "compressed",
        "compressed_aligned_c2",
        "uncompressed",
    }
    assert all(p["cells_per_s"] > 0 for p in points)
    assert "| compressed_aligned_c2 | grain_cells | 0 | warm | 64/32 |" in done.stdout
    packed = f"tahoe_like-n{SYNTHETIC_CELLS}-g2000-s0-gzip-katlas.h5ad"
    assert list((workdir / "cache").glob(packed))


def test_object_store_choice(workdir):
    pytest.importorskip("moto.server", reason="needs moto[server] (test extra)")
    out = workdir / "choice.json"
    done = run(
        workdir,
        "object_store_choice.py",
        "--object_mb=1",
        "--sizes=256,16384",
        "--reps=2",
        "--ranges=4",
        "--range_kb=16",
        "--batches=2",
        f"--json={out}",
    )
    assert "GET       256 B  obstore" in done.stdout
    rates = json.loads(out.read_text())["batch_mb_s"]
    assert rates["grain_cells RemoteByteReader"] > 0


# -- every flag explained, plots with honest scales -------------------------------

BINARIES = sorted(
    p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "bench_util.py"
)
# Runs each binary as `__main__` with `--help` (as a user would) and prints, per
# binary, one line of JSON: what `--help` printed, the flags the binary or
# bench_util defines (with help and default), and the names of every flag the
# binary's own code defines (in the binary or a module of benchmarks/ or
# configs/; not absl's, Grain's or other libraries'). One process serves both
# tests below for every binary: it imports the third-party modules most
# binaries use once, then runs each binary in a child forked from it, so that
# each starts with absl's flags as a fresh interpreter has them (no binary,
# bench_util or configs module is imported before the fork). One interpreter
# per binary, as before, cost 37 CPU-s for the 30 binaries.
_HELP_AND_FLAGS = """
import contextlib, io, json, os, runpy, sys, traceback
for name in ("numpy", "scipy.sparse", "h5py", "anndata", "jax", "grain", "grain_cells"):
    try:
        __import__(name)
    except ImportError:
        pass


def help_and_flags(path):
    root = os.path.dirname(os.path.dirname(path))
    sys.path[:0] = [os.path.dirname(path), root]
    sys.argv = [path, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit:
            pass
    from absl import flags
    ours = (os.path.join(root, "benchmarks"), os.path.join(root, "configs"))
    listed, own = [], set()
    for name, defined in flags.FLAGS.flags_by_module_dict().items():
        main = name in (path, sys.argv[0])
        if main or name.endswith("bench_util"):
            listed += [
                {"name": f.name, "help": f.help or "", "default": f.default}
                for f in defined
            ]
        file = getattr(sys.modules.get(name), "__file__", None) or ""
        if main or os.path.abspath(file).startswith(ours):
            own.update(f.name for f in defined)
    return {"help": out.getvalue(), "flags": listed, "own": sorted(own)}


for path in map(os.path.abspath, sys.argv[1:]):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            found = help_and_flags(path)
        except BaseException:
            found = {"error": traceback.format_exc()}
        sys.__stdout__.write(json.dumps({"path": path, **found}) + "\\n")
        sys.__stdout__.flush()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status:
        print(json.dumps({"path": path, "error": f"exit status {status}"}), flush=True)
"""

_help_and_flags_cache: dict[str, dict] = {}


def _help_and_flags(binary: str) -> dict:
    if not _help_and_flags_cache:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                _HELP_AND_FLAGS,
                *(str(ROOT / "benchmarks" / b) for b in BINARIES),
            ],
            capture_output=True,
            text=True,
            timeout=5 * TIMEOUT_S,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        for line in done.stdout.splitlines():
            if line.startswith('{"path": '):
                found = json.loads(line)
                _help_and_flags_cache[pathlib.Path(found.pop("path")).name] = found
    found = _help_and_flags_cache.get(binary, {"error": "no line printed"})
    assert "error" not in found, f"{binary} --help: {found['error'][-2000:]}"
    return found


@pytest.mark.parametrize("binary", BINARIES)
def test_help_shows_every_flag_of_the_binary(binary):
    """`--help` lists the binary's flags, those bench_util (or a binary it
    imports) defines for it included, not only under `--helpfull`."""
    found = _help_and_flags(binary)
    shown, own = found["help"], found["own"]
    assert "flags:" in shown or not own, shown[-2000:]
    missing = [
        name
        for name in own
        if f"--{name}:" not in shown and f"--[no]{name}:" not in shown
    ]
    assert not missing, f"{binary} --help lacks {missing} (only under --helpfull)"


def _says_more_than_its_default(flag: dict) -> bool:
    """Help that, without its "Default: ..." part, still says something."""
    import re

    text = re.sub(r"\(?[Dd]efault:?[^.)]*[.)]?", "", flag["help"]).strip()
    return (
        len(text.split()) >= 3
        and len(text) > len(str(flag["default"]))
        and "(no help yet)" not in text
    )


@pytest.mark.parametrize("binary", BINARIES)
def test_every_flag_is_explained(binary):
    defined = _help_and_flags(binary)["flags"]
    vague = [
        (f["name"], f["help"]) for f in defined if not _says_more_than_its_default(f)
    ]
    assert not vague, (
        f"{binary}: flags whose help says no more than the default: {vague}"
    )


def _bench_util(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_util

    return bench_util


def test_entropy_scale_is_fixed(monkeypatch):
    bench_util = _bench_util(monkeypatch)
    # 14 plates, minibatches of 64: the best a minibatch can do is log2(14).
    assert bench_util.entropy_range(14, 64) == (0.0, math.log2(14))
    assert bench_util.entropy_range(50, 16) == (0.0, 4.0)  # 16 cells: 16 labels


def test_long_titles_are_wrapped_to_fit(monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bench_util = _bench_util(monkeypatch)
    fig, axes = plt.subplots(1, 2, figsize=(3.5, 2.5), constrained_layout=True)
    title = (
        "mean plate entropy per minibatch, log2 (tahoe_like-n400000.h5ad +, batch 64)"
    )
    suptitle = fig.suptitle(title, fontsize=10)
    for ax in axes:
        ax.set_title("dense, 2 workers, any cache", fontsize=9)
    assert not bench_util.titles_fit(fig, suptitle)  # clipped as drawn before
    bench_util.fit_titles(fig, suptitle)
    assert bench_util.titles_fit(fig, suptitle)
    assert suptitle.get_text().replace("\n", " ") == title  # wrapped, not cut
    plt.close(fig)
