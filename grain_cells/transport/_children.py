"""The worker processes of one data iterator, and the error when one dies.

Design notes: docs/reference/design.md#transport-children.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading

from grain_cells.errors import WorkerDiedError

# Seconds a closing iterator's workers get to stop on their own.
GRACE_S = 2.0


class WorkerWatch:
    """The children a data iterator's workers are, as they appear."""

    def __init__(self, worker_count: int):  # before the workers start
        self.worker_count = worker_count
        self._before = {p.pid for p in multiprocessing.active_children()}
        self._workers: dict[int, multiprocessing.process.BaseProcess] = {}

    def look(self) -> None:
        """Notes the new children (cheap: once per fetch, until all are seen)."""
        if len(self._workers) >= self.worker_count:
            return
        for process in multiprocessing.active_children():
            if process.pid not in self._before:
                self._workers.setdefault(process.pid, process)

    @contextlib.contextmanager
    def killing_after(self, grace_s: float = GRACE_S):
        """A block (Grain's close) after whose first `grace_s` s workers are killed."""
        self.look()
        killed: list = []

        def kill() -> None:
            for process in list(self._workers.values()):
                with contextlib.suppress(Exception):  # gone meanwhile
                    if process.is_alive():
                        process.kill()
                        killed.append(process)

        timer = threading.Timer(grace_s, kill)
        timer.daemon = True
        # At interpreter shutdown (atexit) no thread can start: no grace kill.
        with contextlib.suppress(RuntimeError):
            timer.start()
        try:
            yield
        finally:
            timer.cancel()
            for process in killed:  # up to 1 s each to end (their names swept)
                with contextlib.suppress(Exception):
                    process.join(1.0)

    def dead(self) -> list:
        """The workers seen that have ended with a signal or a failure code."""
        return [p for p in self._workers.values() if p.exitcode not in (None, 0)]


def _how_it_ended(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name} (exit code {code})"


def death_error(dead: list, worker_count: int, where: str) -> WorkerDiedError:
    """The error to raise for `dead` workers, `where` naming the iterator's place."""
    ends = "; ".join(f"worker pid {p.pid} {_how_it_ended(p.exitcode)}" for p in dead)
    killed = any(p.exitcode == -signal.SIGKILL for p in dead)
    why = (
        "A SIGKILL that nobody sent is most often the kernel's out-of-memory "
        "killer (see `dmesg` or the container's memory events): each worker "
        "holds the fetch it reads (batch_size * fetch_factor cells) and "
        "worker_buffer_size minibatches' worth of finished fetches; lower "
        "worker_count, fetch_factor or worker_buffer_size, or give the machine "
        "more memory."
        if killed
        else "The worker's own error, if it printed one, is in the output above."
    )
    return WorkerDiedError(
        f"a data worker process died ({ends}; {worker_count} workers) while "
        f"the trainer waited for {where}. {why} The iterator cannot go on "
        "without that worker's fetch: start a new iterator and restore the "
        "last saved state into it (it resumes where the state was saved), "
        "or start over with iter(loader)."
    )
