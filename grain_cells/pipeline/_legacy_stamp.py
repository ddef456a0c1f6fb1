"""Stamps of states saved before fingerprints: `repr` texts, frozen here.

Up to commit 5f1fd87 a state's stamp recorded the sampler as its `repr`
(less the shard) and the fetch transform as `[repr(split)]`. Those texts are
rendered here from today's fingerprints, in the old format, so that such a
state still restores when the configuration is the same, whatever the
classes' `repr`s have become since. Today's `repr` texts are accepted as
well: they cover what the renderers do not know (a user's own sampler or
output) and values a fingerprint normalises (`dtype=np.float32`, which the
old text printed as a class).

`text_items` splits such a text into `name=value` items, so that a refusal
names the parameter that differs rather than quoting two long texts.
"""

from __future__ import annotations

import re

_SHARD_IN_REPR = re.compile(r", shard_index=\d+, shard_count=\d+")
_CALL = re.compile(r"(\w+)\((.*)\)", re.S)
_ITEM = re.compile(r"(\w+)=(.*)", re.S)
# Names in an old `SplitFetch` text, as today's fingerprint calls them.
_RENAMED = (("FetchConfig.output", "output"), ("FetchConfig", "fetch"))


def sampler_repr(sampler) -> str:
    """The sampler's `repr` without its shard (the old stamp's text)."""
    return _SHARD_IN_REPR.sub("", repr(sampler))


def sampler_text(fp) -> str | None:
    """The old stamp's text of a built-in sampler's fingerprint, else None."""
    if not isinstance(fp, dict):
        return None
    kind = fp.get("class")
    if kind == "BlockSampler":
        return (
            f"BlockSampler(num_blocks={fp['num_blocks']}, shuffle={fp['shuffle']}, "
            f"seed={fp['seed']}, num_epochs={fp['num_epochs']})"
        )
    if kind == "WeightedBlockSampler":
        return (
            f"WeightedBlockSampler(num_blocks={fp['num_blocks']}, "
            f"weights={fp['weights']}, epoch_length={fp['epoch_length']}, "
            f"seed={fp['seed']}, num_epochs={fp['num_epochs']})"
        )
    if kind == "ConditionBlockSampler":
        weights = ""
        if fp["weights"] is not None:
            weights = f", weights={fp['weights']}, epoch_length={fp['epoch_length']}"
        return (
            f"ConditionBlockSampler(num_blocks={fp['num_blocks']}, "
            f"column={fp['column']!r}, blocks_per_fetch={fp['blocks_per_fetch']}, "
            f"worker_count={fp['worker_count']}, seed={fp['seed']}, "
            f"num_epochs={fp['num_epochs']}{weights})"
        )
    return None


def output_text(fp) -> str | None:
    """The old `repr` of a built-in output's fingerprint, else None."""
    if isinstance(fp, str):  # a user's output: its repr
        return fp
    kind = fp.get("class") if isinstance(fp, dict) else None
    if kind in ("CsrOutput", "DenseOutput"):
        return f"{kind}(dtype={fp['dtype']!r})"
    if kind == "PaddedSparseOutput":
        return (
            f"PaddedSparseOutput(width={fp['width']}, truncate={fp['truncate']!r}, "
            f"dtype={fp['dtype']!r})"
        )
    if kind == "RankValueTokens":
        return (
            f"RankValueTokens(length={fp['length']}, pad={fp['pad_id']}, "
            f"cls={fp['cls_id']}, eos={fp['eos_id']}, mask={fp['mask_id']}, "
            f"mlm={fp['mlm_probability']}, columns={fp['columns']})"
        )
    if kind == "ValueBinTokens":
        return (
            f"ValueBinTokens(length={fp['length']}, n_bins={fp['n_bins']}, "
            f"selection={fp['selection']!r}, pad_zeros={fp['pad_zeros']}, "
            f"pad={fp['pad_id']}, cls={fp['cls_id']}, pad_value={fp['pad_value']}, "
            f"mask_value={fp['mask_value']}, mlm={fp['mlm_probability']}, "
            f"columns={fp['columns']})"
        )
    return None


def spec_text(fp) -> str | None:
    """The old `repr` of a `Layer` or `Obsm` from its fingerprint, else None."""
    kind = fp.get("class")
    if kind == "Layer":
        output = output_text(fp["output"])
        return (
            None if output is None else f"Layer(name={fp['name']!r}, output={output})"
        )
    if kind == "Obsm":
        return f"Obsm(name={fp['name']!r}, dtype={fp['dtype']!r})"
    return None


def split_text(fp: dict) -> str | None:
    """The old `repr` of a `SplitFetch` from its fingerprint, else None."""
    fetch, output = fp["fetch"], output_text(fp["output"])
    specs = {k: spec_text(v) for k, v in fp["extra"].items()}
    if output is None or None in specs.values():
        return None
    more = ""
    if specs:
        more = ", extra={" + ", ".join(f"{k!r}: {v}" for k, v in specs.items()) + "}"
    if fetch["numeric_obs"] != "native":
        more += f", numeric_obs={fetch['numeric_obs']!r}"
    if fetch["condition"] is not None:
        more += f", condition={fetch['condition']!r}"
    return (
        f"SplitFetch(FetchConfig(batch_size={fetch['batch_size']}, "
        f"fetch_factor={fetch['fetch_factor']}, block_size={fetch['block_size']}, "
        f"shuffle={fetch['shuffle']}, seed={fetch['seed']}, "
        f"remainder={fetch['remainder']!r}, output={output}){more})"
    )


def legacy_stamps(current: dict, source, sampler, split) -> dict[str, list]:
    """What an old state may hold per stamp key and still match `current`.

    Args:
        current: The restoring pipeline's stamp (with fingerprints).
        source: Its source (states saved before sources were stamped by
            content carry the source's `repr`, with its paths).
        sampler: Its sampler.
        split: Its `SplitFetch`.

    Returns:
        Per key, the texts an older grain_cells would have saved for this
        configuration (best first: the frozen rendering, then today's repr).
    """
    samplers = [sampler_text(current["sampler"]), sampler_repr(sampler)]
    operations = [split_text(current["operations"]), repr(split)]
    return {
        "data_source": [repr(source)],
        "sampler": [s for s in samplers if s is not None],
        "operations": [[s] for s in operations if s is not None],
    }


def _split_top(text: str) -> list[str]:
    """`text` split at its commas outside brackets and quotes."""
    parts, depth, quote, start = [], 0, None, 0
    for i, c in enumerate(text):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def text_items(text: str) -> dict[str, str]:
    """`repr_items` of an old stamp's text, named as in today's fingerprints."""
    out = {}
    for name, value in repr_items(text).items():
        for old, new in _RENAMED:
            if name == old or name.startswith(old + "."):
                name = new + name[len(old) :]
                break
        out[name] = value
    return out


def repr_items(text: str, prefix: str = "") -> dict[str, str]:
    """`"A(x=1, b=B(y=2))"` as `{"class": "A", "x": "1", "b": "B", "b.y": "2"}`."""
    call = _CALL.fullmatch(text.strip())
    if call is None:
        return {prefix.rstrip(".") or "value": text}
    out = {f"{prefix}class": call.group(1)}
    for i, part in enumerate(_split_top(call.group(2))):
        item = _ITEM.fullmatch(part)
        inner = _CALL.fullmatch(item.group(2) if item else part)
        if item:
            name, value = item.group(1), item.group(2)
        else:  # a positional argument: named by its class, else its place
            name, value = (inner.group(1) if inner else f"#{i}"), part
        if inner is not None:
            out[prefix + name] = inner.group(1)
            out.update(repr_items(value, f"{prefix}{name}."))
            out.pop(f"{prefix}{name}.class")
        else:
            out[prefix + name] = value
    return out
