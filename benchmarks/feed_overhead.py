r"""What `grain_cells.feed.device_iterator` costs per step, against `jax.device_put`.

Same run, same in-memory padded-sparse minibatches (`values` float32 and
`indices` int32 `[batch, width]`, `mask`, `row_ids`, one obs column), same
tiny jitted step (a masked sum); the variants alternate over `--rounds`
rounds and the medians are printed:

* `device_put`: `jax.device_put(batch, sharding)` then the step, per step;
* `feed`: `device_iterator(batches, sharding)` (one copy ahead);
* `feed+state`: the feed over an iterator with a `get_state()` as cheap as
  a `grain_cells.DataLoader` iterator's (the real one is timed alone and
  shown as `loader get_state`);
* `feed pinned`: the feed with `pinned_staging=True` (page-locked host
  memory first, then the device; only meaningful on a GPU).

Figures are CPU microseconds of this process per step (`time.process_time`,
every thread of the process, so the copies JAX makes in its own threads
count) and wall microseconds. On a CPU-only host the "device" is host
memory and the copy is a memcpy.

Usage:
  python benchmarks/feed_overhead.py
  python benchmarks/feed_overhead.py --batch_sizes=64,1024 --width=256 --steps=2000
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["64", "1024"], "Cells per minibatch.")
_WIDTH = flags.DEFINE_integer(
    "width",
    256,
    "Stored values per cell in the synthetic minibatches (PaddedSparseOutput "
    "width): sets the bytes each step copies to the device.",
)
_STEPS = flags.DEFINE_integer("steps", 1000, "Steps per variant and round.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Rounds (variants alternate).")
_PINNED = flags.DEFINE_bool("pinned", True, "Also time pinned_staging=True.")
_JSON = flags.DEFINE_string("json", None, "Also write the figures here.")


def host_batches(batch_size: int, width: int, n: int = 16) -> list[dict]:
    """`n` distinct padded-sparse minibatches."""
    rng = np.random.default_rng(0)
    return [
        {
            "values": rng.random((batch_size, width), dtype=np.float32),
            "indices": rng.integers(0, 2000, (batch_size, width), dtype=np.int32),
            "mask": np.ones(batch_size, bool),
            "row_ids": np.arange(batch_size, dtype=np.int64) + i * batch_size,
            "obs/label": rng.integers(0, 4, batch_size).astype(np.int32),
        }
        for i in range(n)
    ]


class _Stateful:
    """Cycles over minibatches; `get_state()` as a DataLoader iterator's."""

    def __init__(self, batches, state_of):
        self._it = itertools.cycle(batches)
        self._state_of = state_of

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)

    def get_state(self) -> bytes:
        return self._state_of()


def loader_state_fn():
    """A real `grain_cells.DataLoader` iterator's `get_state` (small file)."""
    import grain_cells
    from grain_cells.synthetic import _tahoe as synthetic

    path = os.path.join(tempfile.mkdtemp(), "tiny.h5ad")
    synthetic.write_tahoe_like(path, 2_000, n_genes=100, mean_nnz=20)
    source = grain_cells.AnnDataSource(path, block_size=16)
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=0, num_epochs=None),
        operations=grain_cells.fetch_operations(source, batch_size=64),
    )
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    return iterator.get_state


def _per_call_us(fn, n: int = 2000) -> float:
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return 1e6 * (time.process_time() - t0) / n


def measure(batch_size: int, width: int, steps: int, rounds: int, pinned: bool):
    """Median CPU and wall microseconds per step of each variant."""
    import jax

    from grain_cells.feed import device_iterator

    sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.asarray(jax.devices()), ("data",)),
        jax.sharding.PartitionSpec("data"),
    )
    step = jax.jit(lambda b: (b["values"] * b["mask"][:, None]).sum())
    batches = host_batches(batch_size, width)
    get_state = loader_state_fn()

    def plain():
        for b in itertools.islice(itertools.cycle(batches), steps):
            out = step(jax.device_put(b, sharding))
        return out

    def fed(**kw):
        source = kw.pop("source", None) or itertools.cycle(batches)

        def run():
            for b in itertools.islice(device_iterator(source, sharding, **kw), steps):
                out = step(b)
            return out

        return run

    variants = {
        "device_put": plain,
        "feed": fed(),
        "feed+state": fed(source=_Stateful(batches, get_state)),
    }
    if pinned:
        variants["feed pinned"] = fed(pinned_staging=True)
    for run in variants.values():  # compile, warm the allocator
        jax.block_until_ready(run())
    cpu = {k: [] for k in variants}
    wall = {k: [] for k in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            t0, w0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(run())
            cpu[name].append(1e6 * (time.process_time() - t0) / steps)
            wall[name].append(1e6 * (time.perf_counter() - w0) / steps)
    out = {
        name: {
            "cpu_us": statistics.median(cpu[name]),
            "wall_us": statistics.median(wall[name]),
        }
        for name in variants
    }
    out["loader get_state"] = {"cpu_us": _per_call_us(get_state), "wall_us": None}
    return {
        "batch_size": batch_size,
        "width": width,
        "device": f"{jax.devices()[0].platform} x {jax.device_count()}",
        "variants": out,
    }


def print_table(results: list[dict]) -> None:
    """One line per batch size and variant."""
    print("| batch | variant | CPU us/step | wall us/step | CPU vs device_put |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        base = r["variants"]["device_put"]["cpu_us"]
        for name, v in r["variants"].items():
            wall = "" if v["wall_us"] is None else f"{v['wall_us']:.0f}"
            extra = f"{v['cpu_us'] - base:+.0f}" if name != "device_put" else ""
            print(
                f"| {r['batch_size']} | {name} | {v['cpu_us']:.0f} | {wall} | {extra} |"
            )
    print(f"device: {results[0]['device']}")


def main(argv):
    del argv
    results = [
        measure(int(b), _WIDTH.value, _STEPS.value, _ROUNDS.value, _PINNED.value)
        for b in _BATCH_SIZES.value
    ]
    print_table(results)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
