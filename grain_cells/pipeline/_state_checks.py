"""What a restored iterator state must match, checked field by field.

Design notes: docs/reference/design.md#pipeline-state-checks.
"""

from __future__ import annotations

import ast
import json
import re

from grain_cells.errors import CheckpointMismatchError
from grain_cells.io import files_entry, source_identity
from grain_cells.pipeline._stage import (
    Position,
    advances_epochs,
    count_minibatches,
    hand_over,
)
from grain_cells.sampling import BlockStream

STAMP = "grain_cells"
# Bumped when the mapping from a position to cells changes.
_PIPELINE_VERSION = 2
_MISSING = object()
_SHARD_IN_REPR = re.compile(r", shard_index=\d+, shard_count=\d+")
_OBJECT_IN_REPR = re.compile(r"<[^<>]*>")  # `<function f at 0x...>`: a string


def _plain(value):  # JSON of NumPy scalars, else the repr
    item = getattr(value, "item", None)
    return item() if callable(item) else repr(value)


def stamp(source, sampler, split) -> dict:
    """What a saved state must match to be restored by this pipeline (JSON)."""
    if isinstance(sampler, BlockStream):
        ordered, length = sampler.fingerprint(), sampler.epoch_length
    else:  # a user's sampler: its repr, less the shard
        ordered, length = _SHARD_IN_REPR.sub("", repr(sampler)), len(sampler)
    out = {
        "pipeline": _PIPELINE_VERSION,
        "sampler": ordered,
        "epoch_length": int(length),
        "data_source": source_identity(source),
        "operations": split.fingerprint(),
    }
    return json.loads(json.dumps(out, default=_plain))


def _dict_diffs(then: dict, now: dict, prefix: str = "", show=repr) -> list[str]:
    """`saved name=value, now name=value` per differing entry, nested by dots."""
    parts = []
    for k in [*now, *(k for k in then if k not in now)]:
        a, b = then.get(k, _MISSING), now.get(k, _MISSING)
        if a == b:
            continue
        if (
            isinstance(a, dict)
            and isinstance(b, dict)
            and a.get("class") == b.get("class")
        ):
            parts += _dict_diffs(a, b, f"{prefix}{k}.", show)
        else:
            a, b = ("(none)" if v is _MISSING else show(v) for v in (a, b))
            parts.append(f"saved {prefix}{k}={a}, now {prefix}{k}={b}")
    return parts


def _repr_items(text: str) -> dict[str, str]:
    """`"A(x=1, b=B(y=2))"` as `{"class": "A", "x": "1", "b": "B", "b.y": "2"}`."""
    code = _OBJECT_IN_REPR.sub(lambda m: repr(m[0]), text.strip())
    try:
        call = ast.parse(code, mode="eval").body
    except Exception:  # not Python (null bytes, too deep...): shown whole
        call = None
    return _call_items(call, code, "") if _is_call(call) else {"value": text}


def _is_call(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name)


def _call_items(call: ast.Call, text: str, prefix: str) -> dict[str, str]:
    """A call's class and arguments; positional ones named by class, else place."""
    out = {f"{prefix}class": call.func.id}
    named = [(f"#{i}", node) for i, node in enumerate(call.args)]
    named += [(k.arg or f"**{i}", k.value) for i, k in enumerate(call.keywords)]
    for name, node in named:
        if not _is_call(node):
            out[prefix + name] = ast.get_source_segment(text, node)
            continue
        name = node.func.id if name.startswith("#") else name
        out[prefix + name] = node.func.id
        inner = _call_items(node, text, f"{prefix}{name}.")
        del inner[f"{prefix}{name}.class"]
        out.update(inner)
    return out


def _diff(then, now) -> str:
    """How a saved stamp entry differs from the current one."""
    parts = []
    if isinstance(then, dict) and isinstance(now, dict):
        parts = _dict_diffs(then, now)
    elif isinstance(then, str) and isinstance(now, str):
        parts = _dict_diffs(_repr_items(then), _repr_items(now), show=str)
    return "; ".join(parts) if parts else f"saved {then!r}, now {now!r}"


def _older_kind(saved: dict, current: dict) -> str | None:
    """What an older grain_cells's stamp recorded that this one does not."""
    if isinstance(saved.get("operations"), list | str):
        return "the sampler and fetch transform as repr texts"
    then, now = saved.get("data_source"), current["data_source"]
    if isinstance(then, str) and isinstance(now, dict):
        return "the data source as its repr, with its paths"
    if isinstance(then, dict) and isinstance(now, dict):
        files = then.get("files")
        if isinstance(files, list) and files_entry(files) != files:
            return f"every one of its {len(files)} files, not their summary"
    return None


def _fail(field: str, value, valid: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"iterator state field {field} = {value!r} is invalid: expected "
        f"{valid}. The state was edited or corrupted; restore another "
        "checkpoint or start the data iterator afresh."
    )


def _int(value, field: str, low: int, high: int | None = None) -> int:
    """`value`, checked to be an int in `[low, high]` (None: no cap)."""
    top = float("inf") if high is None else high
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
        raise _fail(field, value, f"an int in [{low}, {top}]")
    return value


def _check_stamp(state, current: dict) -> None:
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
    older = _older_kind(saved, current) if isinstance(saved, dict) else None
    if older is not None:
        raise CheckpointMismatchError(
            f"iterator state was saved by an older grain_cells (its stamp "
            f"records {older}; this version records configuration by "
            "fingerprint and data by content), and grain_cells 0.x restores "
            "only states of its own version. Start the data iterator afresh "
            "(from the beginning of the epoch), or restore the state with the "
            "grain_cells version that saved it."
        )
    diffs = [f"stamp: saved {saved!r}"]
    if isinstance(saved, dict):
        diffs = [
            f"{key}: {_diff(saved.get(key), now)}"
            for key, now in current.items()
            if saved.get(key) != now
        ]
    if diffs:
        raise CheckpointMismatchError(
            "cannot restore the data iterator: the pipeline differs from the "
            "one that saved it (" + "; ".join(diffs) + "). Restore with the "
            "same configuration, or start the data iterator afresh."
            + _weights_note(saved, current)
        )


def _weights_note(saved, current: dict) -> str:
    """What to do when only a weighted sampler's weights differ."""
    then, now = saved.get("sampler"), current.get("sampler")
    if not (isinstance(then, dict) and isinstance(now, dict)):
        return ""
    if then.get("weights") == now.get("weights"):
        return ""
    return (
        " The sampler's weights differ from the saved ones: weights computed "
        "again (balanced_block_weights, block_weights) restore the stream only "
        "when they are bit-identical, and grain_cells 0.x may change their last "
        "bits between versions (balanced_block_weights did, where blocks mix "
        "classes: see the CHANGELOG). Save the weights with the checkpoint "
        "(np.save) and pass the saved ones to WeightedBlockSampler to restore."
    )


def restored(state, ds) -> Position:
    """The position a state restores on this shard of `ds` (handed over).

    Raises `CheckpointMismatchError` naming what differs or which field is bad,
    or `errors.SourceChangedError`.
    """
    sampler, source, config = ds.sampler, ds.source, ds.split.config
    _check_stamp(state, ds.stamp)
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
    most = None if advances_epochs(sampler) else 0
    epoch = _int(pos.get("epoch", 0), "position.epoch", 0, most)
    where = dict(origin=origin, count=count, index=index, pieces=pieces)
    saved = Position(sampler, config.blocks_per_fetch, **where, epoch=epoch)
    saved.fetch = _int(pos.get("fetch"), "position.fetch", 0, saved.num_fetches())
    saved.step = _int(pos.get("step"), "position.step", 0)
    high = None
    if saved.fetch < saved.num_fetches():
        high = config.max_minibatches  # a condition's count depends on the data
        if config.condition is None:
            keys = saved.keys(saved.positions(saved.fetch))
            high = count_minibatches(config, source, keys)
    low = saved.skip(saved.fetch)
    saved.minibatch = _int(pos.get("minibatch"), "position.minibatch", low, high)
    source.verify_files("when an iterator state was restored")
    shard = ds.shard
    if (count, index) == (shard.shard_count, shard.shard_index):
        return saved
    if config.condition is not None:
        raise CheckpointMismatchError(
            f"cannot restore a state saved as shard {index} of {count} under "
            f"another shard: with condition={config.condition!r} the "
            "minibatches per fetch depend on the data, so the other shards' "
            "positions are unknown. Restore under the same shard count and "
            "index."
        )
    return hand_over(saved, source, config, shard.shard_count, shard.shard_index)
