"""Worker processes: what one knows of itself, its parent, its death, its script.

Design notes: docs/reference/design.md#transport-worker, #transport-children,
#transport-main-guard.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import Callable

from grain_cells._util import cores, fork
from grain_cells._util.main_guard import unguarded_site
from grain_cells.errors import MainGuardError, WorkerDiedError

ORPHAN_EXIT_CODE = 70  # EX_SOFTWARE: a worker that outlived its parent
GRACE_S = 2.0  # seconds a closing iterator's workers get to stop on their own
_lock = threading.Lock()
_watcher: threading.Thread | None = None
_cleanups: list[Callable[[], None]] = []
_fetches_seen = 0  # fetches started in this process
_in_worker = False


@fork.in_child
def _forget_parent() -> None:
    """A forked child counts its own fetches (and owns no lock of the parent's)."""
    global _fetches_seen, _lock
    _fetches_seen = 0
    _lock = threading.Lock()


def in_child_process() -> bool:
    """Whether this process was started by `multiprocessing` (a worker)."""
    return multiprocessing.parent_process() is not None


def worker_init(worker_index: int = 0, worker_count: int = 0) -> None:
    """Sets up a worker process (`mp_prefetch`'s `worker_init_fn`; idempotent)."""
    global _in_worker
    if in_child_process():
        cores.set_worker_count(worker_count)  # sizes read_threads="auto"
        _in_worker = True
        exit_with_parent()


def in_worker() -> bool:
    """Whether `worker_init` ran in this process (minibatches go via slots)."""
    return _in_worker


def fetch_starting() -> None:
    """Called as a worker starts a fetch: freezes the GC's old objects at the second."""
    global _fetches_seen
    if not (_in_worker and in_child_process()):
        return
    with _lock:
        _fetches_seen += 1
        seen = _fetches_seen
    if seen == 2:  # the imports are long-lived (see the design notes)
        gc.collect()
        gc.freeze()


def on_orphaned(cleanup: Callable[[], None]) -> None:
    """Runs `cleanup` before this process exits because its parent died."""
    with _lock:
        _cleanups.append(cleanup)


def exit_with_parent() -> None:
    """In a `multiprocessing` child: exit as soon as the parent is gone (idempotent)."""
    global _watcher
    if (parent := multiprocessing.parent_process()) is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        with _lock:
            cleanups = list(_cleanups)
        for cleanup in cleanups:
            with contextlib.suppress(Exception):  # exiting anyway: free what we can
                cleanup()
        os._exit(ORPHAN_EXIT_CODE)

    with _lock:
        if _watcher is None or not _watcher.is_alive():
            name = "grain_cells-exit-with-parent"
            _watcher = threading.Thread(target=watch, name=name, daemon=True)
            _watcher.start()


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
        with contextlib.suppress(RuntimeError):  # at exit no thread can start
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
    names = {-s.value: s.name for s in signal.Signals}
    return f"was killed by {names.get(code, f'signal {-code}')} (exit code {code})"


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


def check_main_guard(what: str) -> None:
    """`MainGuardError` if `what` starts workers from a script's unguarded top level."""
    site = unguarded_site()
    if site is not None:
        raise main_guard_error(what, site)


def main_guard_error(what: str, site: tuple[str, int]) -> MainGuardError:
    """The error for `what` starting workers from `site`'s unguarded line."""
    path, line = site
    return MainGuardError(
        f"{what} was started from the top level of {path} (line {line}), "
        'outside an `if __name__ == "__main__":` block. Grain starts worker '
        "processes with spawn, and each one imports this script again and "
        "would run this code again (its workers then die with 'Worker process "
        "was terminated unexpectedly', or the loader hangs). Put the code that "
        "builds and iterates the loader in a function and call it under the "
        "guard:\n\n"
        "    def main():\n"
        "        ...  # build the source, the loader, and train\n\n"
        '    if __name__ == "__main__":\n'
        "        main()\n\n"
        "or pass worker_count=0."
    )
