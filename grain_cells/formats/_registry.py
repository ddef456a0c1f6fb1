"""The formats known to this process, found by path or by node.

The newest registered format whose `can_open` accepts a path opens it;
`fallback` formats (`grain_cells.hdf5`) are asked after all others.
"""

from __future__ import annotations

import os
import threading

from grain_cells.formats._protocol import Format

_lock = threading.Lock()
_formats: list[Format] = []  # in registration order
_asked: tuple[Format, ...] = ()  # `registered()`, kept current by (un)register


def _set(formats: list[Format]) -> None:
    global _asked
    _formats[:] = formats
    newest = formats[::-1]
    _asked = (
        *(f for f in newest if not f.fallback),
        *(f for f in newest if f.fallback),
    )


def register(fmt: Format) -> Format:
    """Adds `fmt` (or moves it) to the formats asked first; returns it.

    Raises:
        TypeError: `fmt` is not a `Format`.
    """
    if not isinstance(fmt, Format):
        raise TypeError(
            f"register expects a grain_cells.formats.Format, got {type(fmt).__name__}"
        )
    with _lock:
        _set([f for f in _formats if f.name != fmt.name] + [fmt])
    return fmt


def unregister(fmt: Format) -> None:
    """Removes `fmt` (tests register a format for their own duration)."""
    with _lock:
        _set([f for f in _formats if f is not fmt])


def registered() -> tuple[Format, ...]:
    """The formats, in the order they are asked (newest first, fallbacks last)."""
    return _asked


def for_path(path: str | os.PathLike) -> Format:
    """The format that opens `path` (a local path or URL).

    Raises:
        ValueError: No registered format opens it.
    """
    path = os.fspath(path)
    for fmt in _asked:
        if fmt.can_open(path):
            return fmt
    raise ValueError(
        f"{path}: no registered format opens it (formats: "
        f"{[f.name for f in _asked]}); import grain_cells to register "
        "the built-in ones"
    )


def of(node) -> Format | None:
    """The format that owns `node` (a group, an array, an open file), or None."""
    for fmt in _asked:
        if fmt.owns(node):
            return fmt
    return None


__all__ = ["for_path", "of", "register", "registered", "unregister"]
