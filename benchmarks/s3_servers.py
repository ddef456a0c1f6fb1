r"""Range GETs from moto's S3 server and from `S3FolderServer`, by object size.

Why the object-store benchmark does not use moto: moto keeps each object in
a spooled buffer and copies all of it on every GET, ranges included, so the
time of one small range GET grows with the object. For each `--sizes_mb`,
puts a random object of that size in both servers (loopback, no added
latency) and times `--gets` range GETs of `--range_kib` through obstore.

Usage:
  python benchmarks/s3_servers.py                       # 10 and 200 MB objects
  python benchmarks/s3_servers.py --sizes_mb=10,200,1000 --gets=10
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from grain_cells.testing import S3FolderServer

_SIZES = flags.DEFINE_list("sizes_mb", ["10", "200"], "Object sizes (MB).")
_GETS = flags.DEFINE_integer("gets", 5, "Range GETs timed per object.")
_RANGE_KIB = flags.DEFINE_integer("range_kib", 64, "Bytes per GET (KiB).")
_JSON = flags.DEFINE_string("json", None, "Also write the figures here.")
KEYS = {"access_key_id": "x", "secret_access_key": "x", "region": "us-east-1"}


def time_gets(endpoint: str, bucket: str, key: str, size: int) -> float:
    """Mean seconds of one range GET of `--range_kib` at spread offsets."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        bucket, endpoint=endpoint, client_options={"allow_http": True}, **KEYS
    )
    length = _RANGE_KIB.value << 10
    obstore.get(store, key, options={"range": (0, 1)}).bytes()  # connect
    start = time.perf_counter()
    for i in range(_GETS.value):
        offset = (size - length) * i // max(_GETS.value - 1, 1)
        got = obstore.get(store, key, options={"range": (offset, offset + length)})
        assert len(got.bytes()) == length
    return (time.perf_counter() - start) / _GETS.value


def main(argv):
    del argv
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    moto_url = f"http://{host}:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=moto_url,
        aws_access_key_id="x",
        aws_secret_access_key="x",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket="bench")
    results = []
    print(f"{'object MB':>9s} {'moto ms/GET':>12s} {'folder ms/GET':>14s}")
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "bench"))
        with S3FolderServer(root) as folder:
            for mb in [int(m) for m in _SIZES.value]:
                size = mb * 1_000_000
                data = os.urandom(size)
                key = f"object-{mb}mb"
                client.put_object(Bucket="bench", Key=key, Body=data)
                with open(os.path.join(root, "bench", key), "wb") as f:
                    f.write(data)
                del data
                row = {
                    "object_mb": mb,
                    "moto_ms_per_get": 1e3 * time_gets(moto_url, "bench", key, size),
                    "folder_ms_per_get": 1e3
                    * time_gets(folder.endpoint_url, "bench", key, size),
                }
                client.delete_object(Bucket="bench", Key=key)
                results.append(row)
                print(
                    f"{mb:9d} {row['moto_ms_per_get']:12.1f} "
                    f"{row['folder_ms_per_get']:14.1f}",
                    flush=True,
                )
    moto.stop()
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump({"range_kib": _RANGE_KIB.value, "results": results}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
