"""`DataLoader`: a `grain.DataLoader` with grain_cells' defaults and checks.

It is a `grain.DataLoader` in every respect (same arguments, same iterator,
same orbax checkpointing through `grain.checkpoint.CheckpointSave`) with these
differences:

* **Read options.** Records are block descriptors that cost nothing to read,
  so Grain's default of 16 reader threads only adds contention (about 160 µs
  per record against 25 µs inline). The default here is
  `ReadOptions(num_threads=0, prefetch_buffer_size=0)`: the batched fetch does
  the I/O. Memory per worker is then bounded by one fetch (its read buffer,
  about `batch_size * fetch_factor` cells, and its minibatches) plus
  `worker_buffer_size` minibatches in flight, whatever the block size.
* **Checked restores.** With a FlatMap in the pipeline Grain restores state
  without checking it, and a state from another configuration fails deep
  inside Grain (or silently yields other data). The iterator here stamps its
  state with the worker count, sampler, source and operations, and refuses a
  state whose stamp differs, saying what differs. The source is stamped by
  content (`grain_cells.identity.source_identity`: cell counts, file sizes,
  metadata and value digests, genes, obs categories, configuration), not by
  paths, so the data copied to another folder restores. A restore also
  checks that the files are unchanged since the source was built, and that
  every field of the state lies in range (`grain_cells.state_checks`).
* **Sampler length.** A sampler over more blocks than the source has is
  refused (Grain would wrap the extra record keys around).
* **Worker buffer.** `worker_buffer_size` defaults to 16 minibatches per
  worker (Grain: 1). Elements travel as small handles to shared-memory slots,
  so a deeper queue costs little, and with a queue of one the round-robin over
  workers stalls whenever one worker is mid-fetch (two workers: 118k -> 155k
  cells/s).
* **absl flags.** Grain reads an absl flag when it starts workers; in
  programs that never parse flags (scripts, notebooks, pytest) that fails.
  The loader (and `fetch_operations`, for the plain `grain.DataLoader`) marks
  flags as parsed when nothing parsed them.
* **Scripts without the `__main__` guard.** Iterating a loader with workers
  from a script's unguarded top level raises `MainGuardError` at once (spawned
  workers would re-run that code), and shared memory of dead grain_cells
  processes is removed when a loader with workers starts.
"""

from __future__ import annotations

import contextlib
import json

import grain

from grain_cells import identity, shm_names, state_checks, transport, worker_process
from grain_cells import sampler as sampler_lib
from grain_cells.errors import CheckpointMismatchError
from grain_cells.main_guard import check_main_guard

__all__ = ["READ_OPTIONS", "CheckedIterator", "CheckpointMismatchError", "DataLoader"]

READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
_STAMP = "grain_cells"


class DataLoader(grain.DataLoader):
    """A `grain.DataLoader` whose iterator checks restored state.

    Example:
        >>> source = grain_cells.AnnDataSource(paths, obs_columns=["plate"])
        >>> loader = grain_cells.DataLoader(
        ...     data_source=source,
        ...     sampler=grain_cells.BlockSampler(len(source), seed=0),
        ...     operations=grain_cells.fetch_operations(source, batch_size=64),
        ...     worker_count=2)
        >>> for batch in loader: ...
    """

    def __init__(
        self,
        *,
        data_source,
        sampler,
        operations=(),
        worker_count=0,
        worker_buffer_size=16,
        shard_options=None,
        read_options=None,
        enable_profiling=False,
    ):
        """Same arguments as `grain.DataLoader`; `read_options` defaults to
        `READ_OPTIONS` and `worker_buffer_size` to 16."""  # noqa: D205, D209
        if worker_count:
            worker_process.allow_unparsed_flags()
        operations = list(operations)
        sampler_lib.check_sampler_fits(sampler, data_source)
        # What a restore checks a state against (not Grain's attributes).
        self._checked_parts = (sampler, data_source, tuple(operations), shard_options)
        self._stamp = {
            "worker_count": int(worker_count or 0),
            "sampler": repr(sampler),
            "data_source": _source_stamp(data_source),
            "operations": [repr(op) for op in operations],
        }
        # States saved before sources were stamped by content carry the
        # source's repr (with its paths): still accepted where it matches.
        self._legacy_stamp = {"data_source": repr(data_source)}
        super().__init__(
            data_source=data_source,
            sampler=sampler,
            operations=operations,
            worker_count=worker_count,
            worker_buffer_size=worker_buffer_size,
            shard_options=shard_options,
            read_options=read_options or READ_OPTIONS,
            enable_profiling=enable_profiling,
        )

    @property
    def stamp(self) -> dict:
        """What a saved state must match to be restored by this loader."""
        return dict(self._stamp)

    def __iter__(self) -> CheckedIterator:
        workers = self.multiprocessing_options.num_workers
        if workers:
            check_main_guard(f"grain_cells.DataLoader(worker_count={workers})")
            shm_names.remove_stale()  # of trainers and workers that were killed
        return CheckedIterator(self, state=None, validate_state=False)


def _source_stamp(data_source):
    """An `AnnDataSource` by content; any other source by its `repr`."""
    if hasattr(data_source, "file_identity"):
        return identity.source_identity(data_source)
    return repr(data_source)


def _stamp_diffs(saved: dict, current: dict, legacy: dict) -> list[str]:
    """What differs between two stamps, one entry per top-level key."""
    diffs = []
    for key, now in current.items():
        then = saved.get(key)
        if then == now or (key in legacy and then == legacy[key]):
            continue
        if isinstance(then, dict) and isinstance(now, dict):
            parts = [
                f"{k}={then.get(k)!r}, now {k}={now.get(k)!r}"
                for k in now
                if then.get(k) != now.get(k)
            ]
            diffs.append(f"{key}: saved " + "; saved ".join(parts))
        else:
            diffs.append(f"{key}: saved {then!r}, now {now!r}")
    return diffs


class CheckedIterator(grain.DataLoaderIterator):
    """A `grain.DataLoaderIterator` whose state carries its loader's stamp.

    Also closable: `close()` (or leaving a `with` block) stops the worker
    processes and frees their shared memory at once, instead of at garbage
    collection.

    Once `next` has raised (a worker died, a file went bad), every later call
    raises again: Grain would otherwise go on with the surviving workers'
    minibatches only, silently skipping the dead worker's share.
    """

    _failure: BaseException | None = None

    def __next__(self):
        if self._failure is not None:
            raise RuntimeError(
                "the data iterator failed earlier and cannot continue; restore "
                "it from a checkpoint or start a new one"
            ) from self._failure
        try:
            return super().__next__()
        except StopIteration:
            raise
        except Exception as e:
            self._failure = e
            raise

    def close(self) -> None:
        """Stops the workers; the iterator cannot be used afterwards."""
        # The DataLoaderIterator's pipeline iterator is a Grain DatasetIterator.
        self._iterator.close()
        transport.release_dead_rings()

    def __del__(self):
        # Dropping the iterator must release what close() releases.
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> CheckedIterator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_state(self) -> bytes:
        """Returns the JSON state: Grain's, plus the loader's stamp."""
        inner = json.loads(super().get_state())
        return json.dumps(
            {_STAMP: self._data_loader.stamp, "grain": inner}, indent=1
        ).encode()

    def set_state(self, state: bytes):
        """Restores a state saved by a loader with the same configuration.

        Raises:
            CheckpointMismatchError: The state was saved by a loader with a
                different worker count, sampler, source (data or
                configuration) or operations, or not by a
                `grain_cells.DataLoader`, or a field of it is out of range.
            errors.SourceChangedError: A file changed since the source was
                built.
        """
        try:
            obj = json.loads(state)
        except (ValueError, TypeError) as e:
            raise CheckpointMismatchError(f"iterator state is not JSON: {e}") from e
        if not isinstance(obj, dict) or _STAMP not in obj:
            raise CheckpointMismatchError(
                "iterator state was not saved by a grain_cells.DataLoader (no "
                f"{_STAMP!r} stamp); restore it with the loader that saved it"
            )
        saved, current = obj[_STAMP], self._data_loader.stamp
        diffs = (
            _stamp_diffs(saved, current, self._data_loader._legacy_stamp)
            if isinstance(saved, dict)
            else [f"stamp: saved {saved!r}"]
        )
        if diffs:
            raise CheckpointMismatchError(
                "cannot restore the data iterator: the pipeline differs from the "
                "one that saved it (" + "; ".join(diffs) + "). Restore with the "
                "same configuration, or start the data iterator afresh."
            )
        sampler, data_source, operations, shards = self._data_loader._checked_parts
        verify = getattr(data_source, "verify_files", None)
        if verify is not None:
            verify("when an iterator state was restored")
        state_checks.check_state(
            obj.get("grain"),
            sampler=sampler,
            data_source=data_source,
            operations=operations,
            worker_count=current["worker_count"],
            shard_options=shards,
        )
        super().set_state(json.dumps(obj["grain"]).encode())
        self._failure = None
