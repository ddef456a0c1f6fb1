"""Whether a spawned process would run the main script's code again.

A process started with spawn (Grain's workers, a build's inspection
processes) imports the main script again as `__mp_main__`: code at its top
level outside an `if __name__ == "__main__":` block runs again there.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import threading

_MAIN_NAMES = ("__main__", "__mp_main__")


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
    return None if guarded is None or line in guarded else (path, line)


def main_thread_site() -> tuple[str, int] | None:
    """`unguarded_site` of the main thread's stack (what a spawned child re-runs)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    try:
        return unguarded_site(frame) if frame is not None else None
    finally:
        del frame


# `ast.parse` is not thread-safe on CPython 3.11 and Grain pickles operations
# from several threads: scripts are parsed under a lock, each once per process.
_parse_lock = threading.Lock()


@functools.cache
def _guarded_lines(path: str) -> frozenset[int] | None:
    """Lines of a script inside top-level `__main__` guards; None: cannot tell."""
    try:
        with open(path, encoding="utf-8") as f, _parse_lock:
            tree = ast.parse(f.read(), path)
    except Exception:  # a check that fails cannot tell
        return None
    return frozenset(
        line
        for node in tree.body
        if isinstance(node, ast.If) and _tests_main(node.test)
        # to the body's end, not the `else:`
        for line in range(node.lineno, node.body[-1].end_lineno + 1)
    )


def _tests_main(test: ast.expr) -> bool:
    """Whether an `if` test compares `__name__` with `"__main__"`."""
    for node in ast.walk(test):
        parts = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
        ids = {p.id for p in parts if isinstance(p, ast.Name)}
        if "__name__" in ids and any(
            getattr(p, "value", 0) == "__main__" for p in parts
        ):
            return True
    return False
