"""Runs Python programs as `python <script>` or `python -m <module>` does,
without paying for the interpreter's imports in each run.

A tiny benchmark run or training run spends 2-4 CPU-seconds importing numpy,
h5py, anndata, jax, Grain, Orbax and grain_cells before its first line of
work, and the suite starts about a hundred of them. `ForkedRuns` keeps one
process per environment that imported those libraries once, and forks a
child from it for each run. The child runs the program as `__main__`
(`runpy`, so a spawned Grain worker imports the script again as it does
under `python <script>`), with the run's argv, working folder and
environment, its stdout and stderr in files, and exits as an interpreter
does at the program's end: `SystemExit`'s code, an uncaught exception
printed with status 1, threads joined, atexit handlers run. So its exit
status, output and files are those of a fresh interpreter.

What a fork cannot give, the programs run here do not use: nothing of the
program itself (no binary, no module of benchmarks/ or the example) is
imported before the fork, so absl's flags are defined in the child; the
libraries read `GRAIN_CELLS_CACHE` when called; any other variable (PYTHONPATH,
JAX_PLATFORMS, the JAX cache settings) gets a process of its own started
with that environment, since the libraries read those at import. Programs
that time their own start (benchmarks/startup.py) still run as fresh
interpreters.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time

# Variables the libraries read when called, not at import, or not at all
# (pytest names the running test in PYTEST_CURRENT_TEST): runs that differ
# only in these share a process.
READ_WHEN_CALLED = frozenset({"GRAIN_CELLS_CACHE", "PYTEST_CURRENT_TEST"})
# Processes kept at once (a few hundred MB each).
MAX_SERVERS = 3

# Reads JSON requests from stdin, one a line: {"argv", "module", "cwd",
# "env", "stdout", "stderr" (null: with stdout), "new_session"}; answers
# {"pid"} when the child started and {"pid", "returncode"} when it ended.
_SERVER = r"""
# forked_runs server (tests/processes.worker_pids leaves it out)
import json, os, runpy, select, sys

for name in (
    "numpy", "scipy.sparse", "pandas", "h5py", "anndata", "zarr", "psutil",
    "jax", "grain", "grain_cells", "orbax.checkpoint", "optax", "flax.linen",
    "flax.training.train_state", "ml_collections",
):
    try:
        __import__(name)
    except ImportError:
        pass


def child(request):
    if request["new_session"]:
        os.setsid()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    out = os.open(request["stdout"], flags, 0o644)
    err = os.open(request["stderr"], flags, 0o644) if request["stderr"] else out
    opened = [os.open(os.devnull, os.O_RDONLY), out, err]
    for fd, source in enumerate(opened):
        os.dup2(source, fd)
    for source in set(opened):
        os.close(source)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    # As the interpreter at a program's end: SystemExit's code, or a
    # traceback and status 1, then threads joined and atexit run.
    if request["module"]:
        sys.path[0] = os.getcwd()
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(0)


reply = os.fdopen(os.dup(1), "w")
requests = os.dup(0)
pending = b""
while True:
    if select.select([requests], [], [], 0.02)[0]:
        chunk = os.read(requests, 65536)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                reply.close()
                os.close(requests)
                child(request)
            reply.write(json.dumps({"pid": pid}) + "\n")
            reply.flush()
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        code = os.waitstatus_to_exitcode(status)
        reply.write(json.dumps({"pid": pid, "returncode": code}) + "\n")
        reply.flush()
"""


class _Server:
    """One pre-imported process and the exits it reported."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,  # read through its fd, not the buffer
            env=env,
        )
        self.pending = b""
        self.exits: dict[int, int] = {}
        self.running: set[int] = set()

    def send(self, request: dict) -> int:
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        while True:
            answer = self.read(time.monotonic() + 120)
            if answer is None:
                raise RuntimeError("the forking process did not answer in 120 s")
            if "returncode" not in answer:
                self.running.add(answer["pid"])
                return answer["pid"]

    def read(self, deadline: float | None) -> dict | None:
        """The next answer (an exit is recorded), or None at `deadline`
        (None: no deadline)."""
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self.pending:
                left = None if deadline is None else deadline - time.monotonic()
                if not selector.select(None if left is None else max(0.0, left)):
                    return None
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(
                        f"the forking process ended ({self.proc.wait()})"
                    )
                self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        answer = json.loads(line)
        if "returncode" in answer:
            self.exits[answer["pid"]] = answer["returncode"]
            self.running.discard(answer["pid"])
        return answer

    def close(self) -> None:
        for pid in self.running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


class ForkedProcess:
    """What `subprocess.Popen` offers for a forked run: `pid`, `poll`,
    `wait`, `returncode`. The pid is the run's own (its process group's too
    when started with `new_session`)."""

    def __init__(self, server: _Server, pid: int, args: list[str]):
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.pid not in self._server.exits:
            if self._server.read(deadline) is None:
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = self._server.exits[self.pid]
        return self.returncode


class ForkedRuns:
    """Pre-imported processes, one per environment, that fork the runs."""

    def __init__(self):
        self._servers: dict[tuple, _Server] = {}
        self._folder = tempfile.TemporaryDirectory(prefix="forked_runs_")
        self._count = 0

    def _server(self, env: dict) -> _Server:
        key = tuple(sorted((k, v) for k, v in env.items() if k not in READ_WHEN_CALLED))
        server = self._servers.pop(key, None)
        if server is not None and server.proc.poll() is not None:
            server = None
        if server is None:
            while len(self._servers) >= MAX_SERVERS:
                oldest = next(iter(self._servers))
                self._servers.pop(oldest).close()
            server = _Server(env)
        self._servers[key] = server  # the last used last
        return server

    def start(
        self,
        argv: list[str],
        *,
        cwd,
        env: dict,
        stdout,
        stderr=None,
        module: bool = False,
        new_session: bool = False,
    ) -> ForkedProcess:
        """`subprocess.Popen([sys.executable, *argv], ...)` (`argv[0]` a
        script, or a module with `module=True`: `python -m`), forked, its
        output in the file `stdout` (stderr too unless given a file)."""
        env = {k: str(v) for k, v in env.items()}
        argv = [str(a) for a in argv]
        if not module:
            argv[0] = os.path.abspath(argv[0])
        request = {
            "argv": argv,
            "module": module,
            "cwd": os.fspath(cwd),
            "env": env,
            "stdout": os.fspath(stdout),
            "stderr": None if stderr is None else os.fspath(stderr),
            "new_session": new_session,
        }
        server = self._server(env)
        args = [sys.executable, *(["-m"] if module else []), *argv]
        return ForkedProcess(server, server.send(request), args)

    def run(
        self, argv: list[str], *, cwd, env: dict, timeout: float, module=False
    ) -> subprocess.CompletedProcess:
        """`subprocess.run([sys.executable, *argv], capture_output=True,
        text=True, cwd=cwd, env=env, timeout=timeout)`, forked."""
        self._count += 1
        out = os.path.join(self._folder.name, f"{self._count}.out")
        err = os.path.join(self._folder.name, f"{self._count}.err")
        proc = self.start(argv, cwd=cwd, env=env, stdout=out, stderr=err, module=module)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        with open(out, errors="replace") as f, open(err, errors="replace") as g:
            stdout, stderr = f.read(), g.read()
        os.unlink(out)
        os.unlink(err)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()
        self._folder.cleanup()
