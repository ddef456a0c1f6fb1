"""Worker processes and the shared-memory slot ring minibatches travel in (private).

`_ring` (the slot ring, worker side, and the handles), `_views` (the
trainer's views of the rings and the hand-back), `_lease` (minibatches lent
as arrays inside a slot), `_segments` (shared-memory segments and the arrays
laid out in them), `_slot_writer` (minibatches formatted straight into a
slot), `_shm_names` (names, stale-segment removal), `_worker` (what a worker
knows of itself and its parent), `_main_guard` (scripts without the
`__main__` guard).
"""
