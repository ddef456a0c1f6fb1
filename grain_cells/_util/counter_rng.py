"""Counter-based random numbers: pure functions of `(seed, counters...)` (design.md)."""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_U64 = np.uint64


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> _U64(30))) * _U64(_M1)
    z = (z ^ (z >> _U64(27))) * _U64(_M2)
    return z ^ (z >> _U64(31))


def hash64(*words) -> np.ndarray:
    """uint64 hash of non-negative integer words (arrays broadcast, at least 1-D)."""
    arrays = [np.atleast_1d(np.asarray(w)) for w in words]
    for w in arrays:
        if w.dtype.kind not in "iu":
            raise TypeError(f"hash64 words must be integers, got dtype {w.dtype}")
        if w.dtype.kind == "i" and w.size and w.min() < 0:
            raise ValueError(f"hash64 words must be non-negative, got {w.min()}")
    h = _U64(0)  # (broadcast by the words, arrays all)
    for w in arrays:
        h = _mix((h ^ w.astype(_U64)) + _U64(_GOLDEN))
    return h


def _mix_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def hash64_int(*words: int) -> int:
    """`hash64` of scalar words, on Python ints (about 1 µs)."""
    h = 0
    for w in words:
        h = _mix_int(((h ^ w) + _GOLDEN) & _MASK)
    return h


def permutation(n: int, *words: int, key: int | None = None) -> np.ndarray:
    """Permutation of `range(n)`: argsort of `hash64(key, arange(n))`.

    `key`: `hash64_int(*words)`, when the caller has it.
    """
    key = hash64_int(*words) if key is None else key
    return np.argsort(hash64(key, np.arange(n, dtype=_U64)), kind="stable")


def uniform(*words) -> np.ndarray:
    """Floats in `[0, 1)` with 53 random bits, from `hash64(*words)`."""
    return (hash64(*words) >> _U64(11)).astype(np.float64) * 2.0**-53


def uniform_int(*words: int) -> float:
    """`uniform` of scalar words, on Python ints."""
    return (hash64_int(*words) >> 11) * 2.0**-53
