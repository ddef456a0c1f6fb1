r"""Which object-store client to read `.h5ad` ranges with: obstore or s3fs.

Starts moto's S3 server (`python -m moto.server`) on localhost in a child
process, puts one object of `--object_mb` random bytes and times, for each
client, in one run:

  * latency of one range GET, median of `--reps`, for the read sizes a fetch
    makes (`--sizes`: an `indptr` piece, one block's values, a merged run);
  * throughput (MB/s) of a fetch-shaped batch: `--ranges` random ranges of
    `--range_kb` KiB read concurrently (obstore: `get_ranges`, and
    grain_cells' own path, `RemoteByteReader.read_into`, which sends one
    `If-Match` GET per merged request from a thread pool, merging ranges
    less than 64 KiB apart; s3fs: `cat_ranges`). obstore's `get_ranges`
    merges ranges less than 1 MiB apart by default, which on a 4 MiB object
    means one or two GETs: it is also timed with `coalesce=0`.

moto reads the whole object for every range GET, so absolute figures are
moto's, not S3's; compare the clients by ratio. No added latency here (the
faults benchmark adds 20 ms RTT).

Usage:
  python benchmarks/object_store_choice.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
import portpicker
from absl import app, flags

_OBJECT_MB = flags.DEFINE_integer("object_mb", 4, "Size of the object read.")
_SIZES = flags.DEFINE_list(
    "sizes", ["256", "102400", "1048576"], "Range sizes (bytes) for latency."
)
_REPS = flags.DEFINE_integer("reps", 30, "GETs per latency figure.")
_RANGES = flags.DEFINE_integer("ranges", 32, "Ranges per concurrent batch.")
_RANGE_KB = flags.DEFINE_integer("range_kb", 100, "KiB per range of a batch.")
_BATCHES = flags.DEFINE_integer("batches", 10, "Batches per throughput figure.")
_JSON = flags.DEFINE_string("json", None, "Also write the figures here.")

KEYS = {"access_key_id": "testing", "secret_access_key": "testing"}


def start_moto(port: int, log) -> subprocess.Popen:
    """Starts moto's server on 127.0.0.1:`port`; returns once it answers."""
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).close()
            return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("moto.server did not answer")


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv):
    del argv
    import boto3
    import obstore

    try:
        import s3fs
    except ImportError:  # the bench extra brings it
        s3fs = None
        print("s3fs is not installed (pip install s3fs): timing obstore only")

    from grain_cells.storage.remote import _store as object_store
    from grain_cells.storage.remote._reader import RemoteByteReader
    from grain_cells.storage.remote._versions import version_of

    port = portpicker.pick_unused_port()
    endpoint = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        server = start_moto(port, log)
        try:
            size = _OBJECT_MB.value << 20
            boto3.client(
                "s3",
                endpoint_url=endpoint,
                region_name="us-east-1",
                aws_access_key_id=KEYS["access_key_id"],
                aws_secret_access_key=KEYS["secret_access_key"],
            ).create_bucket(Bucket="bench")
            url = "s3://bench/object.bin"
            options = {"endpoint_url": endpoint, "region": "us-east-1", **KEYS}
            store = object_store.store_for(url, options)
            obstore.put(store, "object.bin", os.urandom(size))
            fs = s3fs and s3fs.S3FileSystem(
                key=KEYS["access_key_id"],
                secret=KEYS["secret_access_key"],
                endpoint_url=endpoint,
                client_kwargs={"region_name": "us-east-1"},
            )
            stat = version_of(url, options)
            reader = RemoteByteReader(url, options, stat)
            results = {"object_bytes": size, "latency_ms": {}, "batch_mb_s": {}}
            for n in (min(int(s), size - 1) for s in _SIZES.value):
                lat = {
                    "obstore": median_ms(
                        lambda n=n: obstore.get_range(
                            store, "object.bin", start=0, end=n
                        ),
                        _REPS.value,
                    )
                }
                line = f"GET {n:>9,} B  obstore {lat['obstore']:7.2f} ms"
                if fs:
                    lat["s3fs"] = median_ms(
                        lambda n=n: fs.cat_file("bench/object.bin", 0, n), _REPS.value
                    )
                    ratio = lat["s3fs"] / lat["obstore"]
                    line += f"  s3fs {lat['s3fs']:7.2f} ms  s3fs/obstore {ratio:.2f}"
                results["latency_ms"][n] = lat
                print(line)
            rng = np.random.default_rng(0)
            length = _RANGE_KB.value << 10
            starts = [
                np.sort(rng.integers(0, size - length, _RANGES.value))
                for _ in range(_BATCHES.value)
            ]
            batch_bytes = _BATCHES.value * _RANGES.value * length

            def timed(fn) -> float:
                t = time.perf_counter()
                for s in starts:
                    fn(s)
                return batch_bytes / (time.perf_counter() - t) / 1e6

            dest = np.empty(_RANGES.value * length, np.uint8)
            rates = {
                "obstore get_ranges": timed(
                    lambda s: obstore.get_ranges(
                        store,
                        "object.bin",
                        starts=s.tolist(),
                        lengths=[length] * s.size,
                    )
                ),
                "obstore get_ranges, coalesce=0": timed(
                    lambda s: obstore.get_ranges(
                        store,
                        "object.bin",
                        starts=s.tolist(),
                        lengths=[length] * s.size,
                        coalesce=0,
                    )
                ),
                "grain_cells RemoteByteReader": timed(
                    lambda s: reader.read_into(
                        dest,
                        s.tolist(),
                        [length] * s.size,
                        (np.arange(s.size) * length).tolist(),
                    )
                ),
            }
            if fs:
                rates["s3fs cat_ranges"] = timed(
                    lambda s: fs.cat_ranges(
                        ["bench/object.bin"] * s.size,
                        s.tolist(),
                        (s + length).tolist(),
                    )
                )
            results["batch_mb_s"] = rates
            for name, rate in rates.items():
                print(
                    f"batch of {_RANGES.value} x {_RANGE_KB.value} KiB  {name:30s} "
                    f"{rate:8.1f} MB/s"
                )
        finally:
            server.terminate()
            server.wait()
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
