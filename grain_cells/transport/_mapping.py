"""Memory mappings of shared segments, without a file descriptor each.

Design notes: docs/reference/design.md#transport-mapping.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10  # the same on every Linux architecture; not in `mmap`
_PAGE = mmap.PAGESIZE
_CHUNK = 1 << 20  # bytes copied at a time by `privatise` (bounded extra memory)

# A mapped segment: a `ctypes` array of bytes (`map_shared`).
Segment = ctypes.Array


def map_shared(fd: int, size: int) -> ctypes.Array:
    """`size` bytes of `fd` mapped shared and writable, unmapped when unreferenced.

    `fd` may close at once; `OSError` if `mmap` fails.
    """
    addr = _mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes: {os.strerror(err)}")
    buf = (ctypes.c_ubyte * size).from_address(addr)
    # Not at exit: a thread may still read it while the interpreter exits.
    weakref.finalize(buf, _munmap, addr, size).atexit = False
    return buf


def privatise(addr: int, size: int) -> None:
    """Makes the mapping at `addr` private memory with the same bytes, in place.

    `OSError` if `mmap` fails (the range is unchanged from there on).
    """
    if addr % _PAGE:
        raise ValueError(f"address {addr:#x} is not page-aligned")
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    for start in range(0, size, _CHUNK):
        n = min(_CHUNK, size - start)
        held = ctypes.string_at(addr + start, n)
        span = -(-n // _PAGE) * _PAGE  # whole pages (the mapping's last is too)
        if _mmap(addr + start, span, prot, flags, -1, 0) != addr + start:
            err = ctypes.get_errno()
            where = f"private remap at {addr + start:#x}"
            raise OSError(err, f"{where}: {os.strerror(err)}")
        ctypes.memmove(addr + start, held, n)


__all__ = ["Segment", "map_shared", "privatise"]
