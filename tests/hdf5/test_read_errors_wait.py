"""A failed threaded read returns only once every thread stopped writing.

`hdf5._reads.range_reader` (a `formats.PositionalReader`) splits a
large direct read over the read pool's threads, each writing into the
caller's destination (a per-thread buffer the caller reuses). When one
part fails, the others must have finished before the error reaches the
caller: else they go on writing into a buffer the next read fills, and
(with the open-file bound) may read through a descriptor that was closed
and reused for another file.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import h5py
import numpy as np
import pytest

from grain_cells.formats import PositionalReader
from grain_cells.hdf5 import _reads as hdf5_reads


class _Pool(concurrent.futures.ThreadPoolExecutor):
    threads = 4


def test_a_failed_part_waits_for_the_others(tmp_path, monkeypatch):
    path = tmp_path / "values.h5"
    n = 4 << 20  # 16 MiB of float32: four parts of >= 1 MiB
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=np.arange(n, dtype=np.float32))
    real = PositionalReader._pread_all
    finished: list[float] = []
    lock = threading.Lock()

    def pread_all(self, dest, offsets, nbytes, dest_starts):
        if dest_starts[0] == 0:
            raise OSError("the first part fails at once")
        time.sleep(0.3)
        real(self, dest, offsets, nbytes, dest_starts)
        with lock:
            finished.append(time.monotonic())

    monkeypatch.setattr(PositionalReader, "_pread_all", pread_all)
    fd = os.open(path, os.O_RDONLY)
    try:
        with h5py.File(path, "r") as f, _Pool(4) as pool:
            reader = hdf5_reads.range_reader(f["v"], str(path), fd)
            assert reader.direct
            starts = np.arange(0, n, n // 64, dtype=np.int64)
            stops = starts + n // 128
            out = np.empty(int((stops - starts).sum()), np.float32)
            with pytest.raises(OSError, match="fails at once"):
                reader.read(starts, stops, out, pool)
            raised = time.monotonic()
            parts = len(finished)
            time.sleep(0.5)
            # Every other part had finished when the error was raised.
            assert parts == len(finished) >= 1
            assert max(finished) <= raised
    finally:
        os.close(fd)
