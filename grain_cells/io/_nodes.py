"""Format-neutral access to AnnData elements: asks each node's `Format`.

The io layer asks this module, never a format's library, what a node is and
for its children and attributes (`formats.of`); anything else it asks the
node's format, `format_of(node)`, directly.
"""

from __future__ import annotations

import contextlib
import threading

from grain_cells import formats


def format_of(node) -> formats.Format:
    """The format that owns `node` (a group, array or open file); else TypeError."""
    fmt = formats.of(node)
    if fmt is None:
        raise TypeError(
            f"{type(node).__name__} is not a node of any registered format "
            f"({[f.name for f in formats.registered()]})"
        )
    return fmt


def is_group(node) -> bool:
    """Whether `node` is a group (an open file's root too)."""
    fmt = formats.of(node)
    return fmt is not None and fmt.is_group(node)


def is_array(node) -> bool:
    """Whether `node` is an array."""
    fmt = formats.of(node)
    return fmt is not None and fmt.is_array(node)


def checked(node, path: str):
    """`node`, checked against its format's own metadata (`Format.checked`)."""
    fmt = formats.of(node)
    return node if fmt is None else fmt.checked(node, path)


_LOCAL = threading.local()
_ABSENT = object()


@contextlib.contextmanager
def remembered():
    """Within it, this thread's `get`, `at` and `attr` answer repeats from memory."""
    outer = getattr(_LOCAL, "memo", None)
    _LOCAL.memo = {}
    try:
        yield
    finally:
        _LOCAL.memo = outer


def get(group, name: str):
    """`group[name]`, or None when it is absent (or an HDF5 link dangles)."""
    memo = getattr(_LOCAL, "memo", None)
    if memo is not None:
        held = memo.get((id(group), name))
        if held is not None:
            return held[1]
    fmt = formats.of(group)
    try:
        node = group.get(name) if fmt is None else fmt.child(group, name)
    except (KeyError, OSError):  # a dangling external link "is in" the group
        node = None
    if memo is not None:
        memo[(id(group), name)] = (group, node)
    return node


def at(group, name: str):
    """`group[name]` (raising as the format does when absent), as `get` finds it."""
    node = get(group, name)
    return group[name] if node is None else node


def attr(node, name: str, default=None):
    """The attribute `name` of `node`, or `default` (`Format.attr`)."""
    memo = getattr(_LOCAL, "memo", None)
    if memo is not None:
        held = memo.get((id(node), "", name))
        if held is not None:
            return default if held[1] is _ABSENT else held[1]
    fmt = formats.of(node)
    value = (
        node.attrs.get(name, _ABSENT) if fmt is None else fmt.attr(node, name, _ABSENT)
    )
    if memo is not None:
        memo[(id(node), "", name)] = (node, value)
    return default if value is _ABSENT else value


def attr_str(node, name: str, default=None):
    """An attribute as `str` when it is text (some formats give bytes)."""
    value = attr(node, name, default)
    return value.decode() if isinstance(value, bytes) else value


def is_string_array(node) -> bool:
    """Whether `node` is an array of strings."""
    fmt = formats.of(node)
    return fmt is not None and fmt.is_array(node) and fmt.is_string_array(node)


def file_name(f) -> str:
    """The path or URL an open file was opened from."""
    return format_of(f).file_name(f)
