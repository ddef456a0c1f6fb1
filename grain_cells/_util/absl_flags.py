"""absl flags marked parsed where nothing parses them (Grain's workers read one)."""

from __future__ import annotations


def allow_unparsed() -> None:
    """Marks absl flags parsed in a program that never parsed them (else no-op)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
