"""`storage.advise_uncached`: a read-ahead hint asks before it advises.

Each piece's first `PROBE_BYTES` are asked for with `RWF_NOWAIT`; pieces
the page cache holds are not advised, the others are. After `PROBE_MISSES`
misses in a call the rest are advised unasked (a cold hint costs no more
than advising). Asks are counted in `read_counts.hinted`, never in the
reads' `pieces`.
"""

from __future__ import annotations

import errno
import os

import pytest

from grain_cells.storage import _readers

pytestmark = pytest.mark.skipif(
    not hasattr(os, "posix_fadvise") or not hasattr(os, "RWF_NOWAIT"),
    reason="Linux page-cache hints",
)

PIECES = 12


@pytest.fixture
def fd(tmp_path):
    """A descriptor of a small file just written (its pages in memory)."""
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 64)
    fd = os.open(path, os.O_RDONLY)
    os.pread(fd, 1 << 16, 0)
    yield fd
    os.close(fd)


@pytest.fixture
def calls(monkeypatch):
    """`(asked, advised)`: offsets asked with RWF_NOWAIT, and offsets advised."""
    asked: list[int] = []
    advised: list[int] = []
    real_preadv, real_fadvise = os.preadv, os.posix_fadvise

    def preadv(fd, buffers, offset, flags=0):
        if flags & os.RWF_NOWAIT:
            asked.append(offset)
        return real_preadv(fd, buffers, offset, flags)

    def fadvise(fd, offset, length, advice):
        advised.append(offset)
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr(_readers.read_counts, "supported", True)
    return asked, advised


def _pieces(fd):
    offsets = [k * 1000 for k in range(PIECES)]
    return [fd] * PIECES, offsets, [700] * PIECES


def _counts():
    return _readers.read_counts.snapshot(), _readers.read_counts.snapshot(True)


def test_cached_pieces_are_asked_not_advised(fd, calls):
    asked, advised = calls
    reads0, hinted0 = _counts()
    _readers.advise_uncached(*_pieces(fd))
    reads1, hinted1 = _counts()
    assert asked == _pieces(fd)[1] and advised == []
    assert (hinted1[0] - hinted0[0], hinted1[1] - hinted0[1]) == (PIECES, 0)
    assert reads1 == reads0  # asks are not reads


def test_missing_pieces_are_advised_and_asks_stop(fd, calls, monkeypatch):
    asked, advised = calls
    real = os.preadv

    def cold(fd_, buffers, offset, flags=0):
        real(fd_, buffers, offset, flags)  # (recorded by `calls`)
        raise BlockingIOError(errno.EAGAIN, "would block")

    monkeypatch.setattr(os, "preadv", cold)
    _, hinted0 = _counts()
    _readers.advise_uncached(*_pieces(fd))
    _, hinted1 = _counts()
    misses = _readers.PROBE_MISSES
    assert len(asked) == misses  # then the rest advised unasked
    assert advised == _pieces(fd)[1]
    assert (hinted1[0] - hinted0[0], hinted1[1] - hinted0[1]) == (misses, misses)


def test_without_nowait_every_piece_is_advised_uncounted(fd, calls, monkeypatch):
    asked, advised = calls
    monkeypatch.setattr(_readers.read_counts, "supported", False)
    _, hinted0 = _counts()
    _readers.advise_uncached(*_pieces(fd))
    assert asked == [] and advised == _pieces(fd)[1]
    assert _counts()[1] == hinted0
