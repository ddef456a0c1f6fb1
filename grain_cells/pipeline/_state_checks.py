"""What a restored iterator state must match, and validation field by field.

A state of `grain_cells.cell_dataset` / `grain_cells.DataLoader` is
`{"grain_cells": stamp, "position": {...}}` (see `grain_cells.pipeline._resume`). The
stamp says which pipeline saved it: the sampler (without its shard, which may
change), its epoch length, the source by content
(`grain_cells.storage._identity.source_identity`: cell counts, file sizes, metadata
and value digests, genes, obs categories, configuration; not paths, so a
copy of the data elsewhere restores) and the fetch transform. The worker
count is not part of it: a state restores under any.

`check_state` refuses, with `CheckpointMismatchError` naming the field, its
value and what was expected: a state of another pipeline or of another
program, and any position field out of range (a fetch past the stream, a
minibatch past its fetch's end, a negative step...), which would otherwise
resume at the wrong place.
"""

from __future__ import annotations

import re

from grain_cells.errors import CheckpointMismatchError
from grain_cells.pipeline._resume import Position
from grain_cells.pipeline._stage import count_minibatches
from grain_cells.storage import _identity as identity

STAMP = "grain_cells"
# Bumped when the mapping from a position to cells changes.
_PIPELINE_VERSION = 2
_SHARD_IN_REPR = re.compile(r", shard_index=\d+, shard_count=\d+")


def stamp(source, sampler, split) -> dict:
    """What a saved state must match to be restored by this pipeline."""
    if hasattr(source, "file_identity"):
        data = identity.source_identity(source)
    else:
        data = repr(source)
    return {
        "pipeline": _PIPELINE_VERSION,
        "sampler": _SHARD_IN_REPR.sub("", repr(sampler)),
        "epoch_length": int(getattr(sampler, "epoch_length", len(sampler))),
        "data_source": data,
        "operations": [repr(split)],
    }


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


def _fail(field: str, value, valid: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"iterator state field {field} = {value!r} is invalid: expected "
        f"{valid}. The state was edited or corrupted; restore another "
        "checkpoint or start the data iterator afresh."
    )


def _int(value, field: str, low: int, high: int | None = None) -> int:
    """`value` checked to be an int in `[low, high]` (`high` None: no cap)."""
    valid = f"an int in [{low}, {'inf' if high is None else high}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(field, value, valid)
    if value < low or (high is not None and value > high):
        raise _fail(field, value, valid)
    return value


def _check_stamp(state, current: dict, legacy: dict) -> None:
    if not isinstance(state, dict) or STAMP not in state:
        if isinstance(state, dict) and "grain" in state:
            raise CheckpointMismatchError(
                "iterator state was saved by an older grain_cells (Grain's "
                "DataLoader state, per worker); this version's states are "
                "positions in its own fetch stream. Restore it with the version "
                "that saved it, or start the data iterator afresh."
            )
        raise CheckpointMismatchError(
            "iterator state was not saved by a grain_cells pipeline (no "
            f"{STAMP!r} stamp); restore it with the loader that saved it"
        )
    saved = state[STAMP]
    diffs = (
        _stamp_diffs(saved, current, legacy)
        if isinstance(saved, dict)
        else [f"stamp: saved {saved!r}"]
    )
    if diffs:
        raise CheckpointMismatchError(
            "cannot restore the data iterator: the pipeline differs from the "
            "one that saved it (" + "; ".join(diffs) + "). Restore with the "
            "same configuration, or start the data iterator afresh."
        )


def check_state(state, current: dict, sampler, source, split) -> Position:
    """Checks a state's stamp and every field of its position.

    Args:
        state: The state (parsed JSON).
        current: The restoring pipeline's `stamp(...)`.
        sampler: Its sampler.
        source: Its source.
        split: Its `fetch.SplitFetch`.

    Returns:
        The saved position.

    Raises:
        CheckpointMismatchError: The stamp differs (saying what), or a field
            is missing, of the wrong type or out of range (naming it).
    """
    # States saved before sources were stamped by content carry the source's
    # repr (with its paths): still accepted where it matches.
    _check_stamp(state, current, {"data_source": repr(source)})
    pos = state.get("position")
    if not isinstance(pos, dict):
        raise _fail("position", pos, "a dict")
    length = len(sampler)
    count = _int(pos.get("count"), "position.count", 1, length)
    index = _int(pos.get("index"), "position.index", 0, count - 1)
    origin = _int(pos.get("origin"), "position.origin", 0, length)
    pieces = pos.get("pieces")
    if not isinstance(pieces, list):
        raise _fail("position.pieces", pieces, "a list of [positions, skip]")
    for i, piece in enumerate(pieces):
        field = f"position.pieces[{i}]"
        if not (isinstance(piece, list) and len(piece) == 2):
            raise _fail(field, piece, "[positions, skip]")
        if not isinstance(piece[0], list) or not piece[0]:
            raise _fail(f"{field}[0]", piece[0], "a non-empty list of positions")
        for p in piece[0]:
            _int(p, f"{field}[0]", 0, length - 1)
        _int(piece[1], f"{field}[1]", 0)
    saved = Position(origin, count, index, [(p, k) for p, k in pieces])
    plan = saved.plan(sampler, split.config.blocks_per_fetch)
    saved.fetch = _int(pos.get("fetch"), "position.fetch", 0, plan.num_fetches())
    saved.step = _int(pos.get("step"), "position.step", 0)
    high = None
    if saved.fetch < plan.num_fetches():
        keys = plan.keys(plan.positions(saved.fetch))
        if split.config.condition is None:
            high = count_minibatches(split.config, source, keys)
        else:
            high = split.config.max_minibatches
    low = plan.skip(saved.fetch)
    saved.minibatch = _int(pos.get("minibatch"), "position.minibatch", low, high)
    return saved


def check_hand_over(saved: Position, split) -> None:
    """Refuses a shard change the state cannot follow (see `resume`)."""
    if split.config.condition is not None:
        raise CheckpointMismatchError(
            f"cannot restore a state saved as shard {saved.index} of "
            f"{saved.count} under another shard: with condition="
            f"{split.config.condition!r} the minibatches per fetch depend on "
            "the data, so the other shards' positions are unknown. Restore "
            "under the same shard count and index."
        )
