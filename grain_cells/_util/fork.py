"""Per-process state a forked child must not inherit: resets run in the child.

Design notes: docs/reference/design.md#util-fork.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

_log = logging.getLogger(__name__)

_functions: list[Callable[[], None]] = []
# token -> (weak reference to the instance, reset); leaves when it is collected.
_instances: dict[int, tuple[weakref.ref, Callable[[Any], None]]] = {}
_tokens = itertools.count()


def in_child(function: Callable[[], None]) -> Callable[[], None]:
    """Calls `function()` in every child forked from now on (a decorator)."""
    _functions.append(function)
    return function


def in_child_of(instance: object, reset: Callable[[Any], None]) -> None:
    """Calls `reset(instance)` (an unbound method) in children forked while it lives."""
    token = next(_tokens)
    ref = weakref.ref(instance, lambda _, token=token: _instances.pop(token, None))
    _instances[token] = (ref, reset)


class ProcessCache(dict):
    """A dict of this process's objects (pools, clients), emptied (new lock) on fork."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()
        in_child_of(self, ProcessCache._forget)

    def get_or_make(self, key, make: Callable[[], Any]):
        """The value at `key`, made by `make()` if this process has none."""
        with self._lock:
            value = self.get(key)
            if value is None:
                value = self[key] = make()
            return value

    def put_newest(self, key, value, keep: int) -> None:
        """Sets `key` as the newest entry; forgets the oldest past `keep` entries."""
        with self._lock:
            self.pop(key, None)
            self[key] = value
            if len(self) > keep:
                del self[next(iter(self))]

    def _forget(self) -> None:
        self.clear()
        self._lock = threading.Lock()


class WeakProcessCache(weakref.WeakValueDictionary):
    """A `ProcessCache` whose values leave once nothing else holds them."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()
        in_child_of(self, WeakProcessCache._forget)

    get_or_make = ProcessCache.get_or_make
    _forget = ProcessCache._forget


def _after_fork_in_child() -> None:
    """Runs the registered resets in the new child (its only thread)."""
    calls = [(f, ()) for f in _functions]
    calls += [(reset, (ref(),)) for ref, reset in list(_instances.values())]
    for function, args in calls:
        if args == (None,):
            continue  # collected
        try:
            function(*args)
        except Exception:  # one failing reset must not skip the others
            _log.exception("grain_cells: resetting %r after fork failed", function)


os.register_at_fork(after_in_child=_after_fork_in_child)

# A forked child starts its own threads: the pools' belong to the parent.
_pools = ProcessCache()


def thread_pool(name: str, threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """This process's pool `name` of `threads` threads (made on first use)."""
    make = concurrent.futures.ThreadPoolExecutor
    return _pools.get_or_make(name, lambda: make(threads, thread_name_prefix=name))
