"""The training example: kill and resume, two JAX processes, the binary, a wheel.

Most runs are subprocesses (`python -m grain_cells.examples.train`, as a user
runs it) on
a small synthetic file: 3,200 cells x 200 genes, blocks of 16 cells, the last
8 blocks held out, so 192 training blocks (3,072 cells). A kill is SIGKILL to
the run's process group (the trainer and its Grain workers) right after the
trainer reports a randomly chosen step past its first checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import portpicker
import psutil
import pytest

from grain_cells.synthetic import _tahoe as synthetic

ROOT = pathlib.Path(__file__).resolve().parents[2]
N_CELLS, BLOCK, HELD_OUT_BLOCKS = 3_200, 16, 8
TRAIN_CELLS = N_CELLS - HELD_OUT_BLOCKS * BLOCK
NUM_STEPS, CHECKPOINT_EVERY = 40, 8
# Two processes, global batch 64: an epoch of the training cells is 48 steps.
STEPS_PER_EPOCH = TRAIN_CELLS // 64
TWO_PROCESS_STEPS = STEPS_PER_EPOCH + CHECKPOINT_EVERY
RUN_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("train_data") / "cells.h5ad"
    synthetic.write_tahoe_like(path, N_CELLS, n_genes=200, mean_nnz=40)
    return str(path)


def config_flags(data_file: str, **overrides) -> list[str]:
    config = {
        "data": data_file,
        "eval_fraction": HELD_OUT_BLOCKS * BLOCK / N_CELLS,
        "num_genes": 64,
        "batch_size": 32,
        "block_size": BLOCK,
        "fetch_factor": 4,
        "hidden_size": 32,
        "num_steps": NUM_STEPS,
        "checkpoint_every": CHECKPOINT_EVERY,
        "log_every": 1,
        **overrides,
    }
    return [f"--config.{k}={v}" for k, v in config.items()]


@pytest.fixture(scope="module", autouse=True)
def _forked(forked_runs):
    """`Run` forks each trainer from one process that imported JAX, Orbax,
    Flax and grain_cells once (tests/forked_runs.py): a fresh interpreter's
    imports were most of a 40-step run's CPU."""
    global _runs
    _runs = forked_runs
    yield
    _runs = None


_runs = None


class Run:
    """One `python -m grain_cells.examples.train` process, its output in a file."""

    def __init__(self, workdir, flags, log: pathlib.Path):
        self.log = log
        log.write_text("")  # there before the run opens it
        self.proc = _runs.start(
            ["grain_cells.examples.train", f"--workdir={workdir}", *flags],
            module=True,
            cwd=ROOT,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            stdout=log,  # stderr too
            new_session=True,  # its own group: the workers die with it
        )
        self.deadline = time.monotonic() + RUN_TIMEOUT_S

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str) -> None:
        """Waits until the output has a line matching `pattern`."""
        regex = re.compile(pattern, re.MULTILINE)
        while not regex.search(self.text()):
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"exited ({self.proc.returncode}) before {pattern!r}:\n"
                    + self.text()[-3000:]
                )
            if time.monotonic() > self.deadline:
                raise AssertionError(f"timed out waiting for {pattern!r}")
            time.sleep(0.005)

    def finish(self) -> str:
        """Waits for a clean exit; returns the output."""
        try:
            self.proc.wait(max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("run timed out:\n" + self.text()[-3000:]) from None
        assert self.proc.returncode == 0, self.text()[-3000:]
        return self.text()

    def kill(self) -> None:
        """SIGKILLs the run's process group; unlinks its workers' segments."""
        if self.proc.poll() is None:
            try:
                children = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                children = []
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
            for child in children:  # grain_cells' slot rings: /gcells_<pid>_...
                for name in pathlib.Path("/dev/shm").glob(f"gcells_{child.pid}_*"):
                    name.unlink(missing_ok=True)


@contextlib.contextmanager
def runs():
    """Collects `Run`s and kills whatever is still running on the way out."""
    started: list[Run] = []
    try:
        yield started
    finally:
        for run in started:
            run.kill()


def train(workdir, flags, tmp_path, name: str, processes: int = 1) -> list[str]:
    """Runs to completion (`processes` JAX processes); returns their outputs."""
    with runs() as started:
        for run_flags in _process_flags(flags, processes):
            started.append(Run(workdir, run_flags, tmp_path / f"{name}-{len(started)}"))
        return [run.finish() for run in started]


def train_killed_then_resumed(
    workdir, flags, tmp_path, kill_step, num_steps=NUM_STEPS, processes=1
):
    """Kills the run after it reports `kill_step`, then runs it again to the end."""
    with runs() as started:
        for run_flags in _process_flags(flags, processes):
            started.append(Run(workdir, run_flags, tmp_path / f"killed-{len(started)}"))
        started[0].wait_for(rf"^(\[process 0/\d\] )?step {kill_step}:")
        for run in started:
            run.kill()
    saved = [
        int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()
    ]
    assert saved and CHECKPOINT_EVERY <= max(saved) < num_steps, saved
    outputs = train(workdir, flags, tmp_path, "resumed", processes)
    for out in outputs:
        assert re.search(rf"resumed from step {max(saved)}$", out, re.MULTILINE), out
    return outputs


def _process_flags(flags, processes: int) -> list[list[str]]:
    if processes == 1:
        return [flags]
    address = f"localhost:{portpicker.pick_unused_port()}"
    return [
        [
            *flags,
            f"--num_processes={processes}",
            f"--process_id={i}",
            f"--coordinator_address={address}",
        ]
        for i in range(processes)
    ]


def final_params(workdir, process: int = 0, processes: int = 1) -> dict:
    path = workdir / "final_params" / f"process_{process}-of-{processes}.npz"
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].tobytes() == b[key].tobytes(), key


def kill_step(seed: int, num_steps: int = NUM_STEPS) -> int:
    """A reproducible 'random' step after the first checkpoint, well before the end
    (the run goes on for the few milliseconds the test takes to notice)."""
    rng = np.random.default_rng(seed)
    return int(rng.integers(CHECKPOINT_EVERY + 1, num_steps - CHECKPOINT_EVERY))


@pytest.fixture(scope="module")
def uninterrupted(data_file, tmp_path_factory):
    """Uninterrupted single-process runs, by worker count: (workdir, output)."""
    done = {}

    def get(worker_count: int):
        if worker_count not in done:
            tmp = tmp_path_factory.mktemp(f"uninterrupted{worker_count}")
            flags = config_flags(
                data_file, worker_count=worker_count, dump_row_ids="true"
            )
            (out,) = train(tmp / "work", flags, tmp, "run")
            done[worker_count] = (tmp / "work", out)
        return done[worker_count]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("worker_count", [0, 2])
def test_sigkill_and_resume_is_bitwise_identical(
    data_file, uninterrupted, tmp_path, worker_count
):
    # The minibatches do not depend on the worker count: both resume to the
    # 0-worker run's parameters (one uninterrupted run fewer).
    reference, _ = uninterrupted(0)
    workdir = tmp_path / "work"
    flags = config_flags(data_file, worker_count=worker_count)
    train_killed_then_resumed(workdir, flags, tmp_path, kill_step(worker_count))
    assert_bitwise_equal(final_params(workdir), final_params(reference))


@pytest.mark.slow
def test_sigkill_and_resume_on_zarr_is_bitwise_identical(
    data_file, uninterrupted, tmp_path
):
    """Killed and resumed on a zarr copy of the `.h5ad` file, 2 workers: the
    parameters of the uninterrupted run on the `.h5ad` file, bit for bit.
    Here, not in tests/checkpoint/test_zarr_resume.py, to share this
    module's uninterrupted run (one trainer run fewer)."""
    from zarr_copies import copy_as

    reference, _ = uninterrupted(0)
    (store,) = copy_as([data_file], tmp_path / "zarr", "zarr-v3-sharded", chunk=4096)
    workdir = tmp_path / "work"
    flags = config_flags(store, worker_count=2)
    train_killed_then_resumed(workdir, flags, tmp_path, kill_step(2))
    assert_bitwise_equal(final_params(workdir), final_params(reference))


@pytest.mark.slow
def test_main_prints_figures(uninterrupted):
    _, out = uninterrupted(0)
    done = re.search(r"^done at step (\d+): (.*)$", out, re.MULTILINE)
    assert done, out[-2000:]
    assert int(done.group(1)) == NUM_STEPS
    pairs = re.findall(r"([a-z/ ]+)=([^,\s]+)", done.group(2))
    figures = {name.strip(): float(value) for name, value in pairs}
    for name in ("steps/s", "cells/s", "loss", "accuracy"):
        assert figures[name] > 0, (name, done.group(0))
    assert figures["accuracy"] <= 1
    assert re.search(rf"^checkpoint saved at step {NUM_STEPS}$", out, re.MULTILINE)


@pytest.mark.slow
def test_measure_loader_overhead(data_file, tmp_path):
    flags = config_flags(data_file, overhead_steps=40, overhead_warmup=5)
    (out,) = train(
        tmp_path / "work", [*flags, "--measure_loader_overhead"], tmp_path, "m"
    )
    for what in ("fed by the loader", "fed from memory", "the loader alone"):
        line = re.search(rf"{what}: steps/s=([\d.]+), cells/s=(\d+)", out)
        assert line and float(line.group(1)) > 0, out[-2000:]


@pytest.mark.slow  # compiles the step in this process
def test_loader_alone_is_timed_on_a_new_iterator(data_file, monkeypatch):
    """The 'loader alone' line once drained the buffers the workers had filled
    during the in-memory phase (millions of cells/s): it needs its own loader."""
    from grain_cells.examples.train import input_pipeline, overhead

    made = []
    real = input_pipeline.train_loader

    def counting(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(input_pipeline, "train_loader", counting)
    config = small_config(data_file, overhead_steps=4, overhead_warmup=2)
    result = overhead.measure_loader_overhead(config)
    assert len(made) == 2  # training, then the loader alone
    assert made[0] is not made[1]
    for name in ("loader", "in_memory", "loader_only"):
        assert result[name]["cells_per_sec"] > 0


def test_timed_window_spans_eight_fetches_per_worker():
    from grain_cells.examples.train import get_config
    from grain_cells.examples.train.overhead import timed_steps

    config = get_config()
    config.overhead_steps, config.fetch_factor = 10, 16
    config.worker_count = 4
    assert timed_steps(config) == 8 * 4 * 16
    config.worker_count = 0
    assert timed_steps(config) == 8 * 16
    config.overhead_steps = 5_000
    assert timed_steps(config) == 5_000


@pytest.fixture(scope="module")
def two_processes(data_file, tmp_path_factory):
    """An uninterrupted two-process run with per-step dumps: (workdir, flags)."""
    tmp = tmp_path_factory.mktemp("two_processes")
    flags = config_flags(
        data_file,
        batch_size=64,
        num_steps=TWO_PROCESS_STEPS,
        dump_row_ids="true",
        dump_params_hash="true",
    )
    train(tmp / "work", flags, tmp, "run", processes=2)
    return tmp / "work", flags


def _per_step(path: pathlib.Path) -> dict[int, list[str]]:
    out = {}
    for line in path.read_text().splitlines():
        step, *rest = line.split()
        out[int(step)] = rest
    return out


@pytest.mark.slow
def test_two_processes_see_each_cell_of_an_epoch_once(two_processes):
    workdir, _ = two_processes
    seen = []
    for p in range(2):
        rows = _per_step(workdir / "row_ids" / f"process_{p}-of-2.txt")
        assert sorted(rows) == list(range(1, TWO_PROCESS_STEPS + 1))
        seen.append(
            np.array([int(r) for s in rows if s <= STEPS_PER_EPOCH for r in rows[s]])
        )
        held_out = [int(r) for s in rows for r in rows[s] if int(r) >= TRAIN_CELLS]
        assert not held_out, f"process {p} trained on held-out cells {held_out[:5]}"
    assert seen[0].size == seen[1].size == TRAIN_CELLS // 2
    everything = np.concatenate(seen)
    np.testing.assert_array_equal(np.sort(everything), np.arange(TRAIN_CELLS))


@pytest.mark.slow
def test_two_processes_keep_identical_parameters(two_processes):
    workdir, _ = two_processes
    hashes = [
        _per_step(workdir / "params_hash" / f"process_{p}-of-2.txt") for p in range(2)
    ]
    assert sorted(hashes[0]) == list(range(1, TWO_PROCESS_STEPS + 1))
    assert hashes[0] == hashes[1]
    assert len({h[0] for h in hashes[0].values()}) == TWO_PROCESS_STEPS  # they move
    assert_bitwise_equal(final_params(workdir, 0, 2), final_params(workdir, 1, 2))


@pytest.mark.slow
def test_two_processes_sigkill_and_resume(two_processes, tmp_path):
    reference, flags = two_processes
    workdir = tmp_path / "work"
    train_killed_then_resumed(
        workdir,
        flags,
        tmp_path,
        kill_step(7, TWO_PROCESS_STEPS),
        num_steps=TWO_PROCESS_STEPS,
        processes=2,
    )
    for p in range(2):
        assert_bitwise_equal(final_params(workdir, p, 2), final_params(reference, p, 2))
    for p in range(2):  # the checkpoint holds each process's own iterator
        data = workdir / "checkpoints" / str(TWO_PROCESS_STEPS) / "data"
        assert (data / f"process_{p}-of-2.json").is_file()


def _epoch_rows(workdir, processes: int, steps) -> np.ndarray:
    """The row ids the `processes` processes trained on at `steps`."""
    out = []
    for p in range(processes):
        rows = _per_step(workdir / "row_ids" / f"process_{p}-of-{processes}.txt")
        out += [int(r) for s in steps for r in rows[s]]
    return np.array(out, dtype=np.int64)


@pytest.mark.slow
def test_two_processes_resume_on_one(two_processes, data_file, tmp_path):
    """A checkpoint of 2 JAX processes restores on 1 (same per-process batch):
    the rest of the epoch visits every remaining training cell once."""
    reference, _ = two_processes
    workdir = tmp_path / "work"
    shutil.copytree(reference, workdir)
    saved = TWO_PROCESS_STEPS  # 8 steps (512 cells) into the second epoch
    rest = (TRAIN_CELLS - (saved - STEPS_PER_EPOCH) * 64) // 32
    flags = config_flags(
        data_file, batch_size=32, num_steps=saved + rest, dump_row_ids="true"
    )
    (out,) = train(workdir, flags, tmp_path, "one")
    assert re.search(rf"^resumed from step {saved}$", out, re.MULTILINE), out
    seen = np.concatenate(
        [
            _epoch_rows(workdir, 2, range(STEPS_PER_EPOCH + 1, saved + 1)),
            _epoch_rows(workdir, 1, range(saved + 1, saved + rest + 1)),
        ]
    )
    np.testing.assert_array_equal(np.sort(seen), np.arange(TRAIN_CELLS))


@pytest.mark.slow
def test_one_process_resumes_on_two(uninterrupted, data_file, tmp_path):
    """A checkpoint of 1 JAX process restores on 2 (global batch 64, 32 each):
    the rest of the epoch visits every remaining training cell once."""
    reference, _ = uninterrupted(0)
    workdir = tmp_path / "work"
    shutil.copytree(reference, workdir)
    rest = (TRAIN_CELLS - NUM_STEPS * 32) // 64
    flags = config_flags(
        data_file, batch_size=64, num_steps=NUM_STEPS + rest, dump_row_ids="true"
    )
    outputs = train(workdir, flags, tmp_path, "two", processes=2)
    for out in outputs:
        assert re.search(rf"resumed from step {NUM_STEPS}$", out, re.MULTILINE), out
    seen = np.concatenate(
        [
            _epoch_rows(workdir, 1, range(1, NUM_STEPS + 1)),
            _epoch_rows(workdir, 2, range(NUM_STEPS + 1, NUM_STEPS + rest + 1)),
        ]
    )
    np.testing.assert_array_equal(np.sort(seen), np.arange(TRAIN_CELLS))


def small_config(data_file: str, **overrides):
    from grain_cells.examples.train import get_config

    config = get_config()
    config.data = data_file
    config.eval_fraction = HELD_OUT_BLOCKS * BLOCK / N_CELLS
    config.num_genes = 64
    config.batch_size = 32
    config.fetch_factor = 4
    config.hidden_size = 32
    config.log_every = 1
    config.update(overrides)
    return config


@pytest.mark.slow
def test_train_and_evaluate_one_step_in_process(data_file, tmp_path, capsys):
    from grain_cells.examples.train import train_and_evaluate

    config = small_config(data_file, num_steps=1, checkpoint_every=1)
    result = train_and_evaluate(config, str(tmp_path))
    assert result["step"] == 1 and result["resumed_from"] is None
    assert np.isfinite(result["loss"]) and 0 <= result["train_accuracy"] <= 1
    assert result["eval_cells"] == HELD_OUT_BLOCKS * BLOCK
    assert 0 <= result["eval_accuracy"] <= 1
    assert (result["num_genes"], result["num_classes"]) == (64, 4)
    assert (tmp_path / "checkpoints" / "1").is_dir()
    assert (tmp_path / "final_params" / "process_0-of-1.npz").is_file()
    first = final_params(tmp_path)

    # Run again: already at num_steps, so it says so and only evaluates.
    capsys.readouterr()
    again = train_and_evaluate(config, str(tmp_path))
    out = capsys.readouterr().out
    assert again["resumed_from"] == 1 and again["step"] == 1
    assert "already at step 1 (num_steps=1): nothing to train" in out
    assert "nan" not in out, out
    assert again["eval_accuracy"] == result["eval_accuracy"]
    assert_bitwise_equal(final_params(tmp_path), first)


def test_random_held_out_split_is_disjoint_from_training(data_file):
    from grain_cells.examples.train import input_pipeline

    data = input_pipeline.prepare_data(
        small_config(data_file, eval_split="random", eval_fraction=0.25)
    )
    try:
        train_rows = data.train.read_blocks(np.arange(len(data.train))).row_ids
        eval_rows = data.eval.read_blocks(np.arange(len(data.eval))).row_ids
    finally:
        data.close()
    np.testing.assert_array_equal(
        np.sort(np.concatenate([train_rows, eval_rows])), np.arange(N_CELLS)
    )
    assert 0.2 < eval_rows.size / N_CELLS < 0.3
    assert eval_rows.min() < N_CELLS // 2  # drawn, not the last blocks


@pytest.mark.parametrize("padded_width", [0, 48])
def test_the_padded_width_is_fitted_as_pipelines_fit_it(data_file, padded_width):
    """No guessed width: `padded_width=0` takes `PaddedSparseOutput()`'s fit
    to the training cells (over the chosen genes); a given one is kept."""
    import grain_cells
    from grain_cells.examples.train import input_pipeline

    data = input_pipeline.prepare_data(
        small_config(data_file, padded_width=padded_width)
    )
    try:
        fitted = grain_cells.PaddedSparseOutput().fit_to_source(data.train).width
        assert data.width == (padded_width or fitted)
        assert data.output == grain_cells.PaddedSparseOutput(data.width)
    finally:
        data.close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            {"eval_split": "middle"},
            "config.eval_split must be 'last' or 'random', got 'middle'",
            id="eval_split",
        ),
        pytest.param(
            {"num_steps": 0}, "config.num_steps must be positive, got 0", id="steps"
        ),
        pytest.param(
            {"eval_fraction": 1.0},
            r"config.eval_fraction must lie in \[0, 1\), got 1.0",
            id="eval_fraction",
        ),
    ],
)
def test_bad_config_value_is_refused_by_name(data_file, tmp_path, overrides, message):
    from grain_cells.examples.train import train_and_evaluate

    with pytest.raises(ValueError, match=message):
        train_and_evaluate(small_config(data_file, **overrides), str(tmp_path))
    assert not any(tmp_path.iterdir())  # refused before touching the workdir


@pytest.mark.slow
def test_main_job_runs_from_an_installed_wheel(data_file, tmp_path):
    """`python -m build --wheel`, installed in a venv, run outside the source tree.

    The venv sees the test venv's dependencies through a `.pth` file (pip
    installs the wheel alone, `--no-deps`); its own site-packages comes
    first, so `grain_cells` is the wheel's.
    """
    import shutil
    import sysconfig

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    # Build from a copy: no build/ or egg-info left in the source tree, and no
    # stale build/lib of an earlier build slips into the wheel.
    src = tmp_path / "src"
    # Hidden folders (.git, .hypothesis, caches) and any virtual environment
    # (CI makes .venv and .venv312 inside the clone: 3 GB) stay behind.
    skipped = shutil.ignore_patterns(
        ".*", "build", "dist", "*.egg-info", "__pycache__", "*.h5ad", "out",
    )  # fmt: skip

    def ignore(folder, names):
        venvs = {n for n in names if pathlib.Path(folder, n, "pyvenv.cfg").exists()}
        return set(skipped(folder, names)) | venvs

    shutil.copytree(ROOT, src, ignore=ignore)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(src)],
        check=True,
        capture_output=True,
        env=env,
        timeout=600,
    )
    (wheel,) = dist.glob("grain_cells-*.whl")
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True
    )
    python = str(venv / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    deps = sysconfig.get_paths()["purelib"]
    pathlib.Path(purelib, "test_venv_deps.pth").write_text(deps + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "--no-deps",
            "--quiet",
            str(wheel),
        ],
        check=True,
        env=env,
        timeout=300,
    )
    workdir = tmp_path / "work"
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    flags = config_flags(data_file, num_steps=4, checkpoint_every=2)
    # One process (one JAX import): it says which grain_cells it imported,
    # then runs the module as `python -m` does.
    script = (
        "import runpy, sys, grain_cells; print(grain_cells.__file__, flush=True); "
        "runpy.run_module('grain_cells.examples.train', run_name='__main__', "
        "alter_sys=True)"
    )
    run = subprocess.run(
        [python, "-c", script, f"--workdir={workdir}", *flags],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=RUN_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    where = run.stdout.splitlines()[0]
    assert where.startswith(purelib), where
    assert re.search(r"^done at step 4: ", run.stdout, re.MULTILINE), run.stdout


@pytest.mark.slow  # a subprocess that imports JAX
def test_unknown_config_key_is_named_without_a_traceback(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = _runs.run(
        [
            "grain_cells.examples.train",
            f"--workdir={tmp_path}",
            "--config.num_step=3",
        ],
        module=True,
        cwd=ROOT,
        env=env,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode != 0
    assert "names a key the config does not have: 'num_step'" in done.stderr
    assert 'Did you mean "num_steps"' in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
