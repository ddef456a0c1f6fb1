"""Zarr arrays read by row range, with zarr-python and obstore (private).

The sibling of `grain_cells.hdf5` for AnnData's other on-disk format. Knows
nothing of AnnData:

* `_format`: the `grain_cells.formats.Format` of zarr stores (registered
  when this package is imported; zarr itself is imported only when a store
  is opened), and `_store_file`: an open store's root (`StoreFile`);
* `_store`: opening a store read-only (local directory, `.zarr.zip`, bucket
  or HTTP URL through obstore), its identity (`store_digest`), and the
  check of consolidated metadata against an array's own document;
* `_reads`: `RangeReader`, sorted element ranges of an array's first axis,
  each chunk (or shard inner chunk) fetched and decoded once per batch,
  concurrently, with missing or damaged chunks refused by name;
* `_codecs`: decoding one stored chunk (numcodecs, crc32c, shard indices);
* `_keys`: the bytes of a store's keys (files, zip members, range GETs).
"""

from grain_cells.zarr import _format as _format  # registers the format
from grain_cells.zarr._annbatch import annbatch_stores

__all__ = ["annbatch_stores"]
