"""Checks of the arguments users pass, shared by every public entry point.

Each returns the normalised value or raises an error naming the argument and
the value given. Design notes: docs/reference/design.md#util-arguments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

SEED_LIMIT = 2**63  # seeds of the loader (samplers, shuffles, splits): [0, SEED_LIMIT)


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a `TypeError`, and a `ValueError` as before)."""


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _got(name: str, value) -> str:
    return f"got {name}={_short(value)} ({type(value).__name__})"


def _not_one_string(name: str, value, kind: str, one: str) -> None:
    """Raises for a bare string where a sequence of `kind` is expected."""
    if isinstance(value, (str, bytes)):
        raise ArgumentTypeError(
            f"{name} must be {kind}, got the string {name}={value!r}; for {one} "
            f"pass {name}=[{value!r}]"
        )


def check_int(
    name: str, value, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """`value` as an int in `[minimum, maximum]`: `int`/`np.integer`, not bool/float."""
    kind = {None: "an int", 0: "a non-negative int", 1: "a positive int"}.get(
        minimum, f"an int >= {minimum}"
    )
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(
            f"{name} must be {kind}, got {name}={value!r} ({type(value).__name__})"
        )
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {kind}, got {name}={value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {name}={value!r}")
    return int(value)


def check_seed(value, name: str = "seed") -> int:
    """A seed of the loader: an int in `[0, 2**63)`."""
    seed = check_int(name, value)
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{name} must lie in [0, 2**63), got {name}={value!r}")
    return seed


def check_genes(genes):
    """A gene selection: None (all) or a non-empty sequence or mask; not one string."""
    if genes is None:
        return None
    kind = "a sequence of gene names, a boolean mask or integer positions"
    _not_one_string("genes", genes, kind, "one gene")
    array = np.asarray(genes)
    if array.size == 0 or (array.dtype == bool and not array.any()):
        raise ValueError(
            f"genes={_short(genes)} selects no gene; pass genes=None for all "
            "genes, or the names (or positions) of the genes to read"
        )
    return genes


def paths_of(paths) -> str | os.PathLike | list:
    """`paths` with (backed) AnnData objects replaced by the file they are backed by."""
    if isinstance(paths, Sequence) and not isinstance(paths, (str, bytes)):
        return [_backing_file(p) for p in paths]
    return _backing_file(paths)


def _backing_file(adata):
    """The file of a backed AnnData; anything else as it is."""
    cls = type(adata)
    if not (cls.__name__ == "AnnData" and cls.__module__.startswith("anndata")):
        return adata
    if adata.isbacked and adata.is_view:
        raise TypeError(
            f"got a view ({adata.n_obs} x {adata.n_vars}) of the backed AnnData "
            f"of {adata.filename}; AnnDataSource would read the whole file. Pass "
            "the path and choose cells with source.select(...) or genes=..."
        )
    filename = getattr(adata, "filename", None) if adata.isbacked else None
    if filename is None:
        raise TypeError(
            "AnnDataSource reads .h5ad files in place, and got an AnnData object "
            f"held in memory ({adata.n_obs} x {adata.n_vars}). Pass the path of "
            "its file, or write it first: adata.write_h5ad('cells.h5ad') and "
            "AnnDataSource('cells.h5ad'). (A backed AnnData, "
            "anndata.read_h5ad(path, backed='r'), is read from its file.)"
        )
    return os.fspath(filename)


def check_choice(name: str, value, choices) -> str:
    """One of a few named values (`remainder="pad"`), compared as given."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"{name} must be one of {list(choices)}, got {name}={_short(value)}"
        )
    return value


def check_bool(name: str, value) -> bool:
    """A flag: `bool` or `np.bool_`, never a string (`"no"` is truthy)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be True or False, {_got(name, value)}")
    return bool(value)


def check_name(name: str, value, *, optional: bool = False) -> str | None:
    """A non-empty string naming something (an element, a column, a key)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        kind = "a string or None" if optional else "a string"
        raise ArgumentTypeError(f"{name} must be {kind}, {_got(name, value)}")
    if not value:
        raise ValueError(f"{name} must not be empty, got {name}=''")
    return value


def check_names(name: str, value) -> tuple[str, ...]:
    """A sequence of names (obs columns): never one bare string."""
    _not_one_string(name, value, "a list of names", "one name")
    try:
        value = list(value)
    except TypeError:
        raise ArgumentTypeError(
            f"{name} must be a list of names, {_got(name, value)}"
        ) from None
    bad = [v for v in value if not isinstance(v, str)]
    if bad:
        raise ArgumentTypeError(
            f"{name} must hold strings, got {name}={_short(value)} "
            f"(e.g. {bad[0]!r}, {type(bad[0]).__name__})"
        )
    return tuple(value)


def check_dtype(name: str, value, *, optional: bool = False):
    """A NumPy dtype, returned as given (reprs record it); None only if `optional`."""
    if value is None and optional:
        return None
    try:
        if value is None:
            raise TypeError
        np.dtype(value)
    except TypeError:
        raise ArgumentTypeError(
            f"{name} must be a NumPy dtype such as 'float32', got "
            f"{name}={_short(value)}"
        ) from None
    return value


def check_mapping(name: str, value, *, optional: bool = True):
    """A mapping (a dict of options); None when `optional`."""
    if value is None and optional:
        return None
    if not isinstance(value, Mapping):
        raise ArgumentTypeError(
            f"{name} must be a dict{' or None' if optional else ''}, "
            + _got(name, value)
        )
    return value


def check_source(value, source_type, name: str = "source"):
    """An `AnnDataSource` or view (`source_type`, passed in): not a path or a list."""
    if not isinstance(value, source_type):
        raise ArgumentTypeError(
            f"{name} must be a grain_cells.AnnDataSource (or a view of one), "
            f"{_got(name, value)}; build one with grain_cells.AnnDataSource(paths, ...)"
        )
    return value
