"""The per-process file records stay within their byte bound (issue 33).

A process keeps a record per file it opened (`grain_cells.io._file_lru.Checked`:
matrix summary, obs values, byte layouts), at most `max_bytes` of them.
With many small files the records' Python objects outweigh their arrays,
so the bound must count them: the memory the records hold (traced by
`tracemalloc`) stays under `max_bytes` however many files are put.
"""

from __future__ import annotations

import copy
import gc
import tracemalloc

import anndata
import numpy as np
import pandas as pd
import scipy.sparse as sp

from grain_cells.io import _file_lru, _open_file
from grain_cells.io._file_set import FileSet, OpenFiles

CELLS = 16
COLUMNS = ("plate", "donor", "cell_type", "n")


def _write(path: str) -> None:
    rows = np.arange(CELLS)
    x = sp.csr_matrix(
        ((rows + 1).astype(np.float32), (rows, rows % 8)), shape=(CELLS, 8)
    )
    obs = pd.DataFrame(
        {
            "plate": pd.Categorical(np.where(rows % 2, "p0", "p1")),
            "donor": pd.Categorical([f"d{r % 5}" for r in rows]),
            "cell_type": pd.Categorical([f"t{r % 3}" for r in rows]),
            "n": rows,
        },
        index=[f"c{r}" for r in rows],
    )
    var = pd.DataFrame(index=[f"g{j}" for j in range(8)])
    anndata.AnnData(x, obs=obs, var=var).write_h5ad(path)


def _record(tmp_path):
    """A small file's real record (as its first open keeps it), and its set."""
    path = str(tmp_path / "small.h5ad")
    _write(path)
    files = FileSet.inspect(
        [path],
        element="X",
        obs_names=COLUMNS,
        genes=None,
        join="exact",
        obs_missing="error",
    )
    handles = OpenFiles(files, read_threads=0)
    handles.file(0)
    record = handles._checked.get(0)
    assert record is not None and record.layouts is not None  # read positionally
    handles.close()
    return files, record


def test_records_of_many_small_files_stay_within_the_byte_bound(tmp_path):
    files, record = _record(tmp_path)
    checked = _file_lru.Checked(max_bytes=256 << 10)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for k in range(2_000):  # as many files, each with records of its own
            info, obs = copy.deepcopy(record.info), copy.deepcopy(record.obs)
            layouts = copy.deepcopy(record.layouts)
            checked.put(k, _open_file.OpenFile(info, obs, record.format, layouts))
            # A reopen adds the CSR byte spans to the record (`reopen`).
            _open_file.reopen(files, 0, checked.get(k)).close()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(checked) > 10  # records were kept, and old ones dropped
    assert len(checked) < 2_000
    assert held <= checked.max_bytes, (
        f"{len(checked)} records hold {held} bytes, over the bound of "
        f"{checked.max_bytes}"
    )


def test_a_record_counts_its_objects_beside_its_arrays(tmp_path):
    _, record = _record(tmp_path)
    checked = _file_lru.Checked()
    checked.put(0, record)
    arrays = sum(v.nbytes for v in record.obs.values())
    arrays += sum(v.nbytes for v in record.layouts.values())
    assert checked.get(0).nbytes == arrays + _file_lru.RECORD_OVERHEAD_BYTES


def test_records_near_the_bound_drop_the_least_recently_used(tmp_path):
    _, record = _record(tmp_path)
    checked = _file_lru.Checked(max_files=4)
    for k in range(4):
        checked.put(k, record)
    assert checked.get_many([0])[0] is record  # 0 used again: 1 is oldest now
    checked.put(4, record)
    assert checked.peek(1) is None
    assert checked.peek(0) is record and checked.peek(4) is record
