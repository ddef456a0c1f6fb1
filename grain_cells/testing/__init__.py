"""Local object-store parts for tests and benchmarks (loopback only).

`S3FolderServer` serves a folder's files as S3 objects (range GETs straight
from the file); `FaultProxy` adds round-trip time and injects faults between a
client and such a server. `NginxFolder` serves files for range reads
through nginx (a compiled server, for benchmarks on few cores).
`SharedMemoryLimit` gives Grain's workers a full `/dev/shm` without root.
"""

from grain_cells.testing.fault_proxy import Fault, FaultProxy, Request, always, every
from grain_cells.testing.nginx_folder import NginxFolder
from grain_cells.testing.s3_folder_server import S3FolderServer, object_etag
from grain_cells.testing.served_folder import ServedFolder
from grain_cells.testing.shm_faults import SharedMemoryLimit

__all__ = [
    "Fault",
    "FaultProxy",
    "NginxFolder",
    "Request",
    "S3FolderServer",
    "ServedFolder",
    "SharedMemoryLimit",
    "always",
    "every",
    "object_etag",
]
