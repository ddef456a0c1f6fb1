"""What `preshuffle` carries besides X, obs and var (`keep`), and what it leaves.

Design notes: docs/reference/design.md#preshuffle-carry.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import h5py

from grain_cells import errors
from grain_cells.io import (
    CSR,
    encoding_of,
    is_array,
    is_group,
    matrix_element,
    open_file,
)

KINDS = ("layers", "raw", "obsm", "varm", "varp", "uns")
"""The names `keep` takes (and `layers/<name>`, `obsm/<name>`)."""

_MATRIX = "matrix"
_FRAME = "frame"
CARRY_ERRORS = (
    errors.GeneMismatchError,
    errors.AnnDataFormatError,
    errors.UnsupportedLayoutError,
)
"""What makes a default (`keep=None`) run leave a matrix out rather than fail."""


def _kind(obj) -> str:
    """`_MATRIX`, `_FRAME`, or why it cannot be carried (h5py or zarr node)."""
    if is_array(obj):
        if obj.ndim == 2 and obj.dtype.kind in "biuf":
            return _MATRIX
        return f"a {obj.ndim}-D {obj.dtype} dataset"
    enc = encoding_of(obj)
    if enc is None and "h5sparse_format" in obj.attrs:  # anndata < 0.7
        fmt = obj.attrs["h5sparse_format"]
        enc = {"csr": CSR, "csc": "csc_matrix"}.get(
            fmt.decode() if isinstance(fmt, bytes) else str(fmt)
        )
    if enc == CSR:
        return _MATRIX
    if enc == "dataframe":
        return _FRAME
    return f"stored as {enc or 'an unknown encoding'}"


def _inventory(f) -> dict:
    """Per kind, an input's elements: `{key: _MATRIX | _FRAME | why not}`."""
    out = {}
    for kind in ("layers", "obsm", "obsp"):
        group = f.get(kind)
        if is_group(group):
            out[kind] = {k: _kind(group[k]) for k in group}
        elif isinstance(group, h5py.Dataset) and group.dtype.names:  # anndata < 0.7
            out[kind] = dict.fromkeys(group.dtype.names, _MATRIX)
        else:
            out[kind] = {}
    raw = f.get("raw")
    out["X"] = "X" in f
    out["raw"] = (is_group(raw) and "X" in raw) or "raw.X" in f
    for kind, parent in (("uns", f), ("varm", f), ("varp", f), ("raw/varm", raw)):
        group = parent.get(kind.split("/")[-1]) if is_group(parent) else None
        out[kind] = is_group(group) and any(True for _ in group)
    return out


def _parse(keep) -> set[str]:
    if isinstance(keep, str) or not isinstance(keep, Sequence | set | frozenset):
        raise TypeError(
            "keep must be None or a list of element names (e.g. ['layers', "
            f"'obsm/X_pca']), got {type(keep).__name__} {keep!r}"
        )
    out = set()
    for item in keep:
        if not isinstance(item, str):
            raise TypeError(f"keep: expected element names (str), got {item!r}")
        head, _, rest = item.partition("/")
        if head not in KINDS or (rest and head not in ("layers", "obsm")):
            raise ValueError(
                f"keep: {item!r} is not an element preshuffle carries; expected "
                f"one of {list(KINDS)}, 'layers/<name>' or 'obsm/<name>'"
            )
        out.add(item)
    return out


def choose(paths: list[str], storage_options: dict, keep, layer, genes_changed):
    """What a run carries for `keep` and `layer` (see the design notes).

    Lists of names: `matrices` (gathered), `obsm_frames`, `copies`, and `left`
    (with why). `genes_changed`: alignment changes the genes from the first var.
    """
    explicit = None if keep is None else _parse(keep)
    found = []
    for path in paths:
        with open_file(path, storage_options) as f:
            found.append(_inventory(f))
    x_element = matrix_element(layer)
    x_is_raw = x_element == "raw/X"
    carry = SimpleNamespace(matrices=[], obsm_frames=[], copies=[], left=[])

    def wanted(name: str) -> bool:  # `layers/a` is wanted by `layers` too
        return explicit is None or name in explicit or name.split("/")[0] in explicit

    def refuse_or_leave(name: str, why: str, explicit_too: bool = True) -> None:
        if explicit is None:
            carry.left.append(f"{name} ({why})")
        elif explicit_too:
            raise ValueError(f"keep: {name} cannot be carried: {why}")

    for kind in ("layers", "obsm"):
        named = [e.split("/", 1)[1] for e in explicit or () if e.startswith(kind + "/")]
        for key in named:
            for path, inv in zip(paths, found, strict=True):
                if key not in inv[kind]:
                    raise errors.MissingColumnError(
                        f"keep: {path} has no {kind}/{key}; it has {sorted(inv[kind])}"
                    )
        for key in dict.fromkeys(k for inv in found for k in inv[kind]):
            name = f"{kind}/{key}"
            if not wanted(name) or name == x_element:
                continue
            named = explicit is not None and name in explicit
            kinds = {inv[kind].get(key) for inv in found}
            if None in kinds:
                refuse_or_leave(name, "some inputs lack it", explicit_too=named)
            elif kind == "layers" and x_is_raw:
                refuse_or_leave(name, "its genes are var's, and X is raw/X")
            elif kinds == {_MATRIX}:
                carry.matrices.append(name)
            elif kind == "obsm" and kinds == {_FRAME}:
                carry.obsm_frames.append(name.split("/", 1)[1])
            else:
                why = sorted(k for k in kinds if k not in (_MATRIX, _FRAME))
                refuse_or_leave(name, (why or ["mixed encodings"])[0])
    if layer is not None and explicit is None and found[0]["X"]:
        carry.left.append(f"X (the output's X is {x_element})")
    if wanted("raw"):
        if x_is_raw:
            if explicit is not None:
                raise ValueError("keep: raw cannot be carried: raw/X is the output's X")
        elif all(inv["raw"] for inv in found):
            carry.matrices.append("raw/X")
            if found[0]["raw/varm"]:
                carry.copies.append("raw/varm")
        elif any(inv["raw"] for inv in found) or explicit is not None:
            refuse_or_leave("raw", "some inputs lack it")
    for kind in ("varm", "varp"):
        if not wanted(kind) or not (found[0][kind] or explicit is not None):
            continue
        if x_is_raw:
            refuse_or_leave(kind, "its genes are var's, and X is raw/X")
        elif genes_changed:
            refuse_or_leave(kind, "join/genes change the output's genes")
        elif found[0][kind]:
            carry.copies.append(kind)
        else:
            raise errors.MissingColumnError(
                f"keep: {paths[0]} has no {kind} (or an empty one) to carry"
            )
    if wanted("uns") and found[0]["uns"]:
        carry.copies.append("uns")
    if explicit is None:
        for key in found[0]["obsp"]:
            carry.left.append(
                f"obsp/{key} (pairs of cells: a shuffled part cannot keep them)"
            )
    return carry
