"""absl flags marked parsed in programs that never parse them.

Grain (0.2.18) reads one of its absl flags
(`--grain_enable_multiprocess_worker_profiling`) when a loader with worker
processes starts them, which raises `UnparsedFlagAccessError` in programs
that never call `absl.app.run` or `FLAGS(argv)`: scripts, notebooks, pytest.
"""

from __future__ import annotations


def allow_unparsed() -> None:
    """Marks absl flags parsed in a program that never parsed them.

    Flags that were parsed are left alone, so absl programs see no change;
    one that parses its flags later (`absl.app.run`) still parses them then.
    """
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
