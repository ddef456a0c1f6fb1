"""Gene alignment: one output gene space and a `ColumnMap` per file.

Design notes: docs/reference/design.md#io-genes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from grain_cells import errors
from grain_cells.io import _frames
from grain_cells.io._cells import ColumnMap
from grain_cells.io._nodes import file_name

JOINS = ("exact", "inner", "outer")


@dataclasses.dataclass(frozen=True)
class GeneAlignment:
    """The output genes of a source and each file's `ColumnMap` (None: as stored).

    `selected`: the output genes' positions among the `num_aligned` (None: all).
    """

    join: str
    var_names: np.ndarray
    num_aligned: int
    maps: tuple[ColumnMap | None, ...]
    selected: np.ndarray | None
    genes_from: str | None = None

    @property
    def reorders(self) -> bool:
        """Whether some file's stored gene order differs from the output order."""
        return any(m is not None and not m.increasing for m in self.maps)

    def describe(self) -> str:
        """A stable summary for `repr` (checkpoints compare it): join, genes, key."""
        keyed = "" if self.genes_from is None else f", genes_from={self.genes_from!r}"
        if self.join == "exact":
            if self.selected is None:
                return f"genes=all{keyed}"
            digest = hashlib.sha1(self.selected.astype(np.int64).tobytes())
            return f"genes={self.selected.size} sha1:{digest.hexdigest()[:12]}{keyed}"
        digest = hashlib.sha1("\0".join(self.var_names.tolist()).encode())
        return (
            f"join={self.join!r}, genes={self.var_names.size} "
            f"sha1:{digest.hexdigest()[:12]}{keyed}"
        )


def read_gene_keys(f, element: str, genes_from: str | None) -> np.ndarray:
    """One file's gene keys (str array): var names, or the var column `genes_from`.

    Raises MissingColumnError, UnsupportedLayoutError, GeneMismatchError or
    AnnDataFormatError.
    """
    if genes_from is None:  # read-only, shared by files of one gene list
        return _frames.var_names(f, element)
    import pandas as pd  # here only: Grain workers never align genes

    path = file_name(f)
    what = f"var column {genes_from!r}"
    values = pd.Series(_frames.read_var_column(f, element, genes_from))
    dtype, kinds = values.dtype, pd.api.types
    if isinstance(dtype, pd.CategoricalDtype):
        dtype = dtype.categories.dtype
    integers = kinds.is_integer_dtype(dtype) and not kinds.is_bool_dtype(dtype)
    if not (kinds.is_string_dtype(dtype) or integers):
        raise errors.UnsupportedLayoutError(
            f"{path}: {what} holds {dtype} values; gene keys must be strings "
            "(or integers, such as Entrez ids). Pick a column of gene ids, such "
            "as the Ensembl ids (CELLxGENE Census: genes_from='feature_id')."
        )
    missing = int(values.isna().sum())
    if missing:
        raise errors.GeneMismatchError(
            f"{path}: {what} has {missing} missing value(s) among "
            f"{values.size} genes; every gene needs a key. Pick a column that "
            "names every gene, such as the Ensembl ids."
        )
    return np.asarray(values.astype(str).to_numpy(), dtype=str)


def shared_keys(keys: np.ndarray, seen: dict) -> np.ndarray:
    """`keys`, or an equal array met before (`seen`, by digest: start with `{}`)."""
    if seen.get(id(keys)) is keys:  # the very array (cached metadata): no hash
        return keys
    keys = np.ascontiguousarray(keys)
    digest = hashlib.sha1(keys.view(np.uint8)).digest() + keys.dtype.str.encode()
    held = seen.setdefault(digest, keys)
    if held is keys or np.array_equal(held, keys):
        seen[id(held)] = held
        return held
    return keys


def align_genes(
    paths: Sequence[str], names: Sequence[np.ndarray], join: str, genes, genes_from=None
) -> GeneAlignment:
    """The output genes and each file's map, from each file's gene keys.

    Raises ValueError or IndexError (bad `join` or `genes`), GeneMismatchError
    or MissingColumnError.
    """
    if join not in JOINS:
        raise ValueError(f"join must be one of {list(JOINS)}, got join={join!r}")
    if isinstance(genes, str):
        genes = [genes]
    if join == "exact":
        if genes_from is not None:  # the others equal the first
            _check_unique(paths[0], names[0], join, genes_from)
        for path, file_names in zip(paths[1:], names[1:], strict=True):
            _check_same_genes(paths[0], names[0], path, file_names, genes_from)
        aligned = names[0]
    else:
        for path, file_names in zip(paths, names, strict=True):
            _check_unique(path, file_names, join, genes_from)
        if join == "inner":
            common = set(names[0].tolist()).intersection(*(n.tolist() for n in names))
            aligned = [g for g in names[0].tolist() if g in common]
            if not aligned:
                examples = "; ".join(
                    f"{p}: {n[:3].tolist()}" for p, n in zip(paths, names, strict=True)
                )
                raise errors.GeneMismatchError(
                    f"{_files(paths)}: no gene is in every file's var, so "
                    f"join='inner' leaves no gene (first var names: {examples}). "
                    "Check that the files name genes the same way (e.g. all "
                    "Ensembl ids), or use join='outer'."
                )
        else:
            aligned = list(dict.fromkeys(g for n in names for g in n.tolist()))
        aligned = np.asarray(aligned, dtype=str)
    selected, missing = _select(
        genes, aligned, paths[0] if join == "exact" else _files(paths)
    )
    if missing:
        error = _missing_genes_error(paths, names, join, missing)
        if genes_from is not None:  # "not in var" would point at var names
            error = errors.MissingColumnError(
                f"{error}. With genes_from={genes_from!r} genes are keyed by "
                f"that var column: name them by its values (e.g. "
                f"{aligned[:3].tolist()}), not by var names"
            )
        raise error
    out_names = aligned if selected is None else aligned[selected]
    if join == "exact":
        if selected is None:
            maps = (None,) * len(paths)
        else:  # same stored columns in every file: one shared map
            out = np.full(len(aligned), -1, np.int32)
            out[selected] = np.arange(selected.size, dtype=np.int32)
            maps = (ColumnMap.from_out(out),) * len(paths)
    else:
        import pandas as pd  # here only: Grain workers never align genes

        index = pd.Index(out_names)
        by_names: dict[bytes, ColumnMap | None] = {}
        built = []
        for file_names in names:
            key = file_names.dtype.str.encode() + file_names.tobytes()
            if key not in by_names:  # files with the same genes share a map
                out = index.get_indexer(file_names).astype(np.int32)
                same = out.size == len(index) and np.array_equal(out, range(out.size))
                by_names[key] = None if same else ColumnMap.from_out(out)
            built.append(by_names[key])
        maps = tuple(built)
    return GeneAlignment(join, out_names, len(aligned), maps, selected, genes_from)


def _select(genes, aligned: np.ndarray, where: str) -> tuple[np.ndarray | None, list]:
    """Positions of `genes` in `aligned`, and the names it does not hold."""
    if genes is None:
        return None, []
    arr = np.asarray(genes)
    if arr.dtype == bool:
        if arr.shape != aligned.shape:
            raise ValueError(
                f"genes mask has {arr.size} entries; var has {aligned.size}"
            )
        return np.flatnonzero(arr).astype(np.int64), []
    if arr.dtype.kind in "iu":
        if arr.size and (arr.min() < 0 or arr.max() >= aligned.size):
            raise IndexError(
                f"genes positions must lie in [0, {aligned.size}); got "
                f"{arr.min()}..{arr.max()}"
            )
        columns = arr.astype(np.int64).reshape(-1)
    else:
        positions: dict[str, list[int]] = {}
        for i, name in enumerate(aligned.tolist()):
            positions.setdefault(name, []).append(i)
        wanted = arr.reshape(-1).tolist()
        missing = [g for g in wanted if g not in positions]
        if missing:
            return None, missing
        ambiguous = {g: positions[g] for g in wanted if len(positions[g]) > 1}
        if ambiguous:
            listed = "; ".join(
                f"{g!r} at positions {p}" for g, p in list(ambiguous.items())[:5]
            )
            raise ValueError(
                f"{where}: genes names {len(ambiguous)} gene(s) that var lists "
                f"more than once, so a name does not say which column: {listed}. Pass "
                "integer positions (or a boolean mask) instead, or make var "
                "names unique first (AnnData.var_names_make_unique())."
            )
        columns = np.array([positions[g][0] for g in wanted], np.int64)
    if np.unique(columns).size != columns.size:
        raise ValueError("genes lists a gene more than once")
    return columns, []


def _missing_genes_error(paths, names, join, missing) -> errors.MissingColumnError:
    if join == "exact":
        return errors.MissingColumnError(
            f"{paths[0]}: {len(missing)} of the requested genes are not in var, "
            f"e.g. {missing[:5]}"
        )
    nowhere = set(missing).difference(*(file_names.tolist() for file_names in names))
    if nowhere or join == "outer":
        absent = [g for g in missing if g in nowhere]
        return errors.MissingColumnError(
            f"{_files(paths)}: {len(absent)} of the requested genes are in no "
            f"file's var, e.g. {absent[:5]}"
        )
    for path, file_names in zip(paths, names, strict=True):
        have = set(file_names.tolist())
        lacking = [g for g in missing if g not in have]
        if lacking:
            return errors.MissingColumnError(
                f"{path}: {len(lacking)} of the requested genes are not in var, "
                f"e.g. {lacking[:5]}; join='inner' keeps only genes every file "
                "has. Use join='outer' to read them as 0 in files that lack them."
            )
    return errors.MissingColumnError(f"genes not found: {missing[:5]}")


def _check_same_genes(first_path, first, path, names, genes_from=None) -> None:
    if len(first) == len(names) and np.array_equal(first, names):
        return
    n = min(len(first), len(names))
    diff = np.flatnonzero(first[:n] != names[:n])
    if diff.size:
        i = int(diff[0])
        where = (
            f"first difference at position {i}: {str(first[i])!r} in "
            f"{first_path}, {str(names[i])!r} in {path}"
        )
    else:
        where = f"{len(first)} genes in {first_path}, {len(names)} in {path}"
    what = "var names" if genes_from is None else f"var column {genes_from!r}"
    raise errors.GeneMismatchError(
        f"{path}: {what} differ from {first_path} ({where}). With "
        "join='exact' (the default) files of one source must list the same "
        "genes in the same order; pass join='inner' or join='outer' to align "
        "them by name."
    )


def _check_unique(path, names: np.ndarray, join: str, genes_from=None) -> None:
    uniq, counts = np.unique(names, return_counts=True)
    if uniq.size == names.size:
        return
    dup = uniq[counts > 1]
    if genes_from is not None:
        raise errors.GeneMismatchError(
            f"{path}: var column {genes_from!r} is not unique: {dup.size} "
            f"value(s) name more than one gene, e.g. {dup[:5].tolist()}; "
            "genes_from needs one key per gene. Pick a unique column, such as "
            "the Ensembl ids (CELLxGENE Census: genes_from='feature_id')."
        )
    raise errors.GeneMismatchError(
        f"{path}: var names are not unique ({dup.size} repeated, e.g. "
        f"{dup[:5].tolist()}); join={join!r} aligns genes by name. Key genes "
        "by a unique var column instead, such as the Ensembl ids (CELLxGENE "
        "Census: genes_from='feature_id'), or use join='exact' (renaming "
        "with var_names_make_unique() would pair different genes across files)."
    )


def _files(paths: Sequence[str]) -> str:
    if len(paths) <= 3:
        return ", ".join(paths)
    return f"{', '.join(paths[:3])} and {len(paths) - 3} more files"
