r"""Worker -> trainer transport alone: the slot ring against a plain queue.

A spawned producer process sends `--minibatches` CSR minibatches shaped like
Tahoe cells (`--batch_size` cells x `--values_per_cell` stored values, plus
row ids, mask and one obs column) to this process, which copies each out, as
the trainer does. Two ways, measured back to back in one run:

* `ring`: grain_cells' slot ring (`transport.SlotRing`), what Grain workers
  use through `fetch_operations`;
* `pickle`: the same dicts pickled whole through a `multiprocessing.Queue`
  (the reference: no shared memory at all);
* `baseline`: the slot ring of another checkout, for before/after figures in
  one run: `git show REV:grain_cells/transport/_ring.py > /tmp/ring_rev.py`
  and `--baseline=/tmp/ring_rev.py` (`grain_cells/transport.py` before the
  sub-packages).

No file is read, so the figure is the transport's ceiling, independent of
disk and decoding.

Usage:
  python benchmarks/transport_throughput.py
  python benchmarks/transport_throughput.py --minibatches=5000 --repeats=5
  python benchmarks/transport_throughput.py --baseline=/tmp/ring_rev.py \
      --ways=baseline,ring,pickle
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from grain_cells.transport import _ring as transport

_MINIBATCHES = flags.DEFINE_integer("minibatches", 3000, "Minibatches per run.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Cells per minibatch.")
_NNZ = flags.DEFINE_integer("values_per_cell", 1600, "Stored values per cell.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs of each way, interleaved.")
_WAYS = flags.DEFINE_list("ways", ["ring", "pickle"], "ring, pickle, baseline.")
_BASELINE = flags.DEFINE_string(
    "baseline", None, "A transport ring module of another checkout (way `baseline`)."
)


def load_baseline(path: str):
    """Another checkout's transport module, importable as `baseline_transport`."""
    if "baseline_transport" not in sys.modules:
        spec = importlib.util.spec_from_file_location("baseline_transport", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["baseline_transport"] = module  # handles unpickle through it
        spec.loader.exec_module(module)
    return sys.modules["baseline_transport"]


def minibatch(i: int, batch: int, nnz: int) -> dict[str, np.ndarray]:
    """A CSR minibatch whose values name `i`."""
    return {
        "data": np.full(batch * nnz, i, np.float32),
        "indices": np.arange(batch * nnz, dtype=np.int32) % 62_710,
        "indptr": np.arange(batch + 1, dtype=np.int64) * nnz,
        "row_ids": np.arange(batch, dtype=np.int64) + i * batch,
        "mask": np.ones(batch, bool),
        "obs/plate": np.zeros(batch, np.int32),
    }


def produce(queue, back, way, baseline, n: int, batch: int, nnz: int) -> None:
    """Producer process: `n` minibatches (distinct contents) through `way`."""
    ring = None
    if way == "ring":
        ring = transport.worker_ring(2 * 16 + 24)
    elif way == "baseline":
        ring = load_baseline(baseline).worker_ring(2 * 16 + 24)
    templates = [minibatch(i, batch, nnz) for i in range(4)]
    for i in range(n):
        out = templates[i % 4]
        queue.put(ring.put(out) if ring is not None else out)
    queue.put(None)
    back.get()  # wait until the consumer is through before unlinking


def run(way: str, n: int, batch: int, nnz: int) -> float:
    """Minibatches per second through `way`."""
    ctx = multiprocessing.get_context("spawn")
    queue, back = ctx.Queue(maxsize=16), ctx.Queue()
    producer = ctx.Process(
        target=produce, args=(queue, back, way, _BASELINE.value, n, batch, nnz)
    )
    producer.start()
    first = queue.get()  # process start is not part of the figure
    assert float(first["data"][0]) == 0
    start = time.perf_counter()
    for i in range(1, n):
        got = queue.get()
        if float(got["data"][-1]) != i % 4:
            raise AssertionError(f"minibatch {i} came back with other values")
    elapsed = time.perf_counter() - start
    assert queue.get() is None
    back.put("done")  # the producer may unlink now
    producer.join()
    transport.release_dead_rings()
    if "baseline_transport" in sys.modules:
        sys.modules["baseline_transport"].release_dead_rings()
    return (n - 1) / elapsed


def main(argv):
    del argv
    if "baseline" in _WAYS.value:
        if not _BASELINE.value:
            raise app.UsageError("--ways=baseline needs --baseline=PATH")
        load_baseline(_BASELINE.value)
    n, batch, nnz = _MINIBATCHES.value, _BATCH.value, _NNZ.value
    mb = minibatch(0, batch, nnz)
    size = sum(a.nbytes for a in mb.values()) / 1e6
    print(f"{n} minibatches of {batch} cells x {nnz} values ({size:.2f} MB each)")
    rates: dict[str, list[float]] = {w: [] for w in _WAYS.value}
    for _ in range(_REPEATS.value):
        for way in _WAYS.value:
            rates[way].append(run(way, n, batch, nnz))
    for way, r in rates.items():
        best = max(r)
        print(
            f"{way:7s} best {best:9,.0f} minibatches/s = {best * batch:12,.0f} "
            f"cells/s ({best * size / 1e3:.2f} GB/s); all: "
            + ", ".join(f"{x:,.0f}" for x in r)
        )


if __name__ == "__main__":
    app.run(main)
