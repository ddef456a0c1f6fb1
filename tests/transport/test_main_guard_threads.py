"""The `__main__` guard's check from several threads at once (issue 34).

Grain pickles the fetch operations for its workers from several threads at
once, and each pickle asks whether the main thread runs a script's unguarded
top level, which parses the script. On CPython 3.11, `ast.parse` run from
several threads at once can raise `SystemError: AST constructor recursion
depth mismatch`; the check must parse once (under a lock), and any failure of
the check itself means "cannot tell", never a crash or a refusal.
"""

from __future__ import annotations

import threading

import pytest

from grain_cells._util import main_guard

THREADS = 8
ROUNDS = 12


def _long_script(lines: int = 2_500) -> str:
    """A script of `lines` lines of nested code, its guard at the end."""
    body = ["import os", ""]
    i = 0
    while len(body) < lines - 3:
        body += [
            f"def f{i}(x):",
            f"    return [[(x + {i}) * k for k in range(3) if k] for _ in (1, 2)]",
            "",
        ]
        i += 1
    body += ['if __name__ == "__main__":', "    f0(1)", ""]
    return "\n".join(body)


@pytest.mark.slow
def test_guarded_lines_from_many_threads_at_once(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(_long_script())
    n_lines = len(path.read_text().splitlines())
    expected = frozenset({n_lines - 1, n_lines})
    failures: list[BaseException] = []
    results: list = []

    def check(barrier: threading.Barrier) -> None:
        barrier.wait()
        try:
            results.append(main_guard._guarded_lines(str(path)))
        except BaseException as e:  # reported below
            failures.append(e)

    for _ in range(ROUNDS):
        main_guard._guarded_lines.cache_clear()  # a cold cache each round
        barrier = threading.Barrier(THREADS)
        threads = [
            threading.Thread(target=check, args=(barrier,)) for _ in range(THREADS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            break
    assert not failures, f"{type(failures[0]).__name__}: {failures[0]}"
    assert set(results) == {expected}


def test_a_failing_check_means_cannot_tell(tmp_path):
    """A script the parser fails on (here RecursionError, not SyntaxError)
    refuses nothing and raises nothing."""
    path = tmp_path / "script.py"
    path.write_text("x = " + "-" * 5_000 + "1\n")
    assert main_guard._guarded_lines(str(path)) is None
    assert main_guard.unguarded_site() is None  # pytest's own __main__ too


@pytest.fixture(autouse=True)
def _cold_cache():
    main_guard._guarded_lines.cache_clear()
    yield
    main_guard._guarded_lines.cache_clear()
