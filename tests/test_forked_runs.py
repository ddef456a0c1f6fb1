"""tests/forked_runs.py gives what `python <script>` gives, and shares its
pre-imported process between runs that differ only in what is read late.

The oracle is a fresh interpreter running the same script.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# Each test starts a process that imports JAX, Grain, grain_cells: seconds.
pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys, threading, time

    atexit.register(lambda: print("atexit ran", flush=True))

    def late():
        time.sleep(0.2)
        print("thread joined", flush=True)

    threading.Thread(target=late).start()
    print(sys.argv[1:], os.getcwd(), os.environ.get("GC_TEST_VALUE"), __name__)
    print(os.path.basename(sys.path[0]), file=sys.stderr)
    print("fds", sorted(os.listdir("/proc/self/fd"))[:3])
    if sys.argv[1] == "raise":
        raise ValueError("raised at the top level")
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.mark.parametrize("how", ["0", "3", "raise"])
def test_a_run_gives_what_a_fresh_interpreter_gives(forked_runs, tmp_path, how):
    script = tmp_path / "bin" / "script.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    env = {**os.environ, "GC_TEST_VALUE": "given"}
    fresh = subprocess.run(
        [sys.executable, str(script), how, "--flag=1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
    )
    forked = forked_runs.run(
        [str(script), how, "--flag=1"], cwd=tmp_path, env=env, timeout=60
    )
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout)
    # The traceback's frames differ (runpy's); its first and last lines not.
    got, want = forked.stderr.splitlines(), fresh.stderr.splitlines()
    assert (got[0], got[-1]) == (want[0], want[-1]), forked.stderr
    assert len(got) == len(want) == 1 or how == "raise"
    assert "thread joined\natexit ran\n" in forked.stdout


def _parent(forked_runs, tmp_path, env) -> int:
    script = tmp_path / "parent.py"
    script.write_text("import os\nprint(os.getppid())\n")
    done = forked_runs.run([str(script)], cwd=tmp_path, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_one_process_serves_runs_that_differ_only_in_late_read_values(
    forked_runs, tmp_path, monkeypatch
):
    first = _parent(forked_runs, tmp_path, dict(os.environ))
    # pytest names each test in PYTEST_CURRENT_TEST; the cache is read late.
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")
    env = {**os.environ, "GRAIN_CELLS_CACHE": str(tmp_path / "cache")}
    assert _parent(forked_runs, tmp_path, env) == first
    # Read at import: a process of its own.
    env = {**os.environ, "JAX_PLATFORMS": "cpu,other"}
    assert _parent(forked_runs, tmp_path, env) != first


def test_a_run_past_its_timeout_is_killed(forked_runs, tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        forked_runs.run([str(script)], cwd=tmp_path, env=dict(os.environ), timeout=2)
