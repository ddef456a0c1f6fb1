"""Detecting a script that starts worker processes without the `__main__` guard.

Design notes: docs/reference/design.md#transport-main-guard.
"""

from __future__ import annotations

import ast
import inspect
import sys
import threading

from grain_cells.errors import MainGuardError

_MAIN_NAMES = ("__main__", "__mp_main__")


def check_main_guard(what: str) -> None:
    """`MainGuardError` if `what` starts workers from a script's unguarded top level."""
    site = unguarded_site()
    if site is not None:
        raise main_guard_error(what, site)


def unguarded_site(frame=None) -> tuple[str, int] | None:
    """`(script, line)` if the main script's unguarded top level called us, or None."""
    frame = frame or inspect.currentframe()
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if frame.f_code.co_name == "<module>" and name in _MAIN_NAMES:
            path, line = frame.f_globals.get("__file__"), frame.f_lineno
            break
        frame = frame.f_back
    else:
        return None  # the main script's top level is not running: nothing re-runs
    del frame
    if not path or getattr(sys.modules.get("__main__"), "__file__", None) != path:
        return None  # the REPL, `python -c`, a notebook: spawn re-runs nothing
    guarded = _guarded_lines(path)
    if guarded is None or line in guarded:
        return None
    return path, line


def main_thread_site() -> tuple[str, int] | None:
    """`unguarded_site` of the main thread's stack (what a spawned child re-runs)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    try:
        return unguarded_site(frame) if frame is not None else None
    finally:
        del frame


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


# `ast.parse` is not safe from several threads at once on CPython 3.11 (it can
# raise `SystemError: AST constructor recursion depth mismatch`), and Grain
# pickles the operations for its workers from several threads at once: each
# script is parsed once per process, one parse at a time, under this lock.
_parse_lock = threading.Lock()
_parsed: dict[str, frozenset[int] | None] = {}


def _guarded_lines(path: str) -> frozenset[int] | None:
    """Lines of a script inside top-level `__main__` guards; None: cannot tell."""
    with _parse_lock:
        if path not in _parsed:
            try:
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                _parsed[path] = frozenset(
                    line
                    for node in tree.body
                    if isinstance(node, ast.If) and _tests_main(node.test)
                    # to the body's end, not the `else:`
                    for line in range(node.lineno, node.body[-1].end_lineno + 1)
                )
            except Exception:  # a check that fails cannot tell
                _parsed[path] = None
        return _parsed[path]


_guarded_lines.cache_clear = _parsed.clear  # as functools.cache's, for tests


def _tests_main(test: ast.expr) -> bool:
    """Whether an `if` test compares `__name__` with `"__main__"`."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            names = any(isinstance(p, ast.Name) and p.id == "__name__" for p in parts)
            main = any(
                isinstance(p, ast.Constant) and p.value == "__main__" for p in parts
            )
            if names and main:
                return True
    return False
