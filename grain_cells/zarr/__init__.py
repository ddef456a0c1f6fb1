"""Zarr arrays read by row range, with zarr-python (private).

The sibling of `grain_cells.hdf5` for AnnData's other on-disk format. Knows
nothing of AnnData: `_reads` reads sorted element ranges of a zarr array's
first axis (each chunk, or shard inner chunk, fetched and decoded once per
batch, concurrently).
"""
