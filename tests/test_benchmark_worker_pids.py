"""The benchmarks' worker memory leaves out children not yet exec'd (issue 33).

Between its fork and its exec, a spawned worker shares the trainer's memory
(`vfork`) or pages (`fork`), and its `/proc` figures read as the trainer's:
a 10,000-file epoch recorded the trainer's 967 MiB as a worker's anonymous
memory. Such a child still has the trainer's command line.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
import warnings

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

import scale_probes
import worker_memory


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux /proc")
@pytest.mark.parametrize("module", [scale_probes, worker_memory])
def test_worker_pids_leave_out_a_child_not_yet_execd(module):
    started = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
        forked = os.fork()
    if forked == 0:  # the child: this process's memory and command line
        time.sleep(60)
        os._exit(0)
    try:
        pids = module.worker_pids()
        assert started.pid in pids
        assert forked not in pids
    finally:
        os.kill(forked, signal.SIGKILL)
        os.waitpid(forked, 0)
        started.kill()
        started.wait()
