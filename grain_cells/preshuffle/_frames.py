"""obs, var and the other frames of a preshuffled part: read, merged, written.

The merge works on pandas objects, not `grain_cells.io`'s codes: a part keeps
anndata's strings and dtypes. obs names are one numpy StringDType array, read and
written in windows (docs/reference/design.md#preshuffle-preshuffle, "Memory").
"""

from __future__ import annotations

import contextlib
import posixpath

import anndata
import h5py
import numpy as np
import pandas as pd

from grain_cells import errors
from grain_cells.io import (
    attr_str,
    encoding_of,
    file_name,
    is_array,
    is_group,
    is_legacy_frame,
    is_string_array,
    open_file,
    read_elem,
    read_obs_names,
    read_obs_values,
    write_elem,
)
from grain_cells.preshuffle._plan import Plan

STRINGS = np.dtypes.StringDType()
WINDOW = 1 << 18  # names per slice read or written (h5py makes objects of a slice)
_CORRUPT = "the file may be corrupt"
_AS_FRAME = " cannot be read as an anndata dataframe"


class Names:
    """The obs names of all inputs, concatenated, as one StringDType array."""

    def __init__(self, values: np.ndarray, mean_chars: float):
        self.values = values
        self.mean_chars = mean_chars

    @classmethod
    def read(
        cls, paths: list[str], offsets: np.ndarray, storage_options: dict | None
    ) -> Names:
        """Reads the names of `paths`, whose cells start at `offsets` (n + 1)."""
        out = np.empty(int(offsets[-1]), dtype=STRINGS)
        chars = 0
        for i, path in enumerate(paths):
            start, stop = int(offsets[i]), int(offsets[i + 1])
            with (
                open_file(path, storage_options) as f,
                _named(path, "obs names cannot be read"),
            ):
                chars += _read_file(f, out[start:stop])
        return cls(out, chars / max(out.size, 1))

    def disk_bytes(self, n: int) -> int:
        """An upper bound of the bytes `n` names take in an h5ad part.

        16 bytes in the dataset, a 16-byte heap object, UTF-8 padded to 8.
        """
        return int(n * (40 + 4 * self.mean_chars))


def _read_file(f, out: np.ndarray) -> int:
    """Fills `out` with the obs names of the open file `f`; returns their chars."""
    source = _plain_index(f)
    if source is None:  # another encoding than a plain string array: anndata's
        source = np.asarray(read_obs_names(f), dtype=str)
    n, got = out.size, int(source.shape[0])
    if got != n:
        raise errors.AnnDataFormatError(
            f"{file_name(f)}: obs has {got} names but X has {n} rows"
        )
    if isinstance(source, h5py.Dataset):
        source = source.astype(STRINGS)
    chars = 0
    for a in range(0, n, WINDOW):
        b = min(a + WINDOW, n)
        out[a:b] = np.asarray(source[a:b]).astype(STRINGS, copy=False)
        chars += int(np.strings.str_len(out[a:b]).sum())
    return chars


def _plain_index(f):
    """The obs index when it is a plain 1-D string array (the usual case), or None."""
    frame = f["obs"]
    if is_legacy_frame(frame) or not is_group(frame):
        return None
    key = attr_str(frame, "_index", "_index")
    if key not in frame:
        return None
    index = frame[key]
    encoding = encoding_of(index)
    if encoding == "nullable-string-array" and is_group(index):
        mask = index.get("mask")
        if not is_array(mask) or mask.ndim != 1 or np.asarray(mask[...]).any():
            return None
        index = index.get("values")
    elif encoding not in ("string-array", None):
        return None
    if is_array(index) and index.ndim == 1 and is_string_array(index):
        return index
    return None


def write_obs(root, order: list, columns, rows: np.ndarray, names: Names) -> None:
    """Writes a part's obs as anndata does, its index in windows of `WINDOW` names.

    `columns` yields `(name, values)`; `rows` are the input rows of the part.
    """
    if "obs" in root:  # the skeleton's empty obs
        del root["obs"]
    group = root.create_group("obs")
    attrs = {"encoding-type": "dataframe", "encoding-version": "0.2.0"}
    group.attrs.update({**attrs, "_index": "_index", "column-order": list(order)})
    n = int(rows.size)
    if isinstance(group, h5py.Group):  # a `string-array`, as anndata writes it
        index = group.create_dataset("_index", (n,), dtype=h5py.string_dtype())
    else:  # zarr: vlen UTF-8 (v2: its filter and "" fill), as anndata's
        index = group.create_array("_index", shape=(n,), dtype=str)
    index.attrs.update({"encoding-type": "string-array", "encoding-version": "0.2.0"})
    for a in range(0, n, WINDOW):
        b = min(a + WINDOW, n)
        index[a:b] = names.values[rows[a:b]]
    # A nullable string column (`pd.arrays.StringArray`) came from an input
    # that holds one: it goes back as it was, which anndata 0.11-0.12 write
    # only with this setting on (0.13: on unless set off).
    with anndata.settings.override(allow_write_nullable_strings=True):
        for name, values in columns:
            write_elem(group, name, values)


class Frames:
    """A part's obs (names apart), var, obsm frames, raw's var and copied elements."""

    def __init__(self, plan: Plan):
        self.plan = plan
        paths, options = plan.paths, plan.storage_options
        # obs names apart from the columns, as one StringDType array: as a
        # pandas object index they cost ~80 bytes per cell (12 GB at 100M).
        self.names = Names.read(paths, plan.source.cell_offsets, options)
        self.obs = read_obs(paths, plan.obs_columns, options)
        var = "raw/var" if plan.element == "raw/X" else "var"
        var = _read_frame(paths[0], var, options)
        self.var = _aligned(var, plan.x.column_map(0), plan.source.var_names)
        self.obsm = {}
        for key in plan.carry.obsm_frames:
            name, fix = f"obsm/{key}", "leave it out with keep=[...]"
            parts = [_read_frame(p, name, options, name, fix) for p in paths]
            self.obsm[key] = parts[0] if len(parts) == 1 else pd.concat(parts)
        self.raw_var = None
        for m in plan.matrices[1:]:  # raw/X carried: `raw/var` too
            if m.name == "raw/X":
                var = _read_frame(paths[0], "raw/var", options)
                self.raw_var = _aligned(var, m.column_map(0), m.files.genes.var_names)

    def nbytes(self, n: int) -> int:
        """About the bytes these take in a part of `n` cells, names apart."""
        # obs: its columns' share of n cells (no gather: deep memory_usage of
        # categoricals is cheap).
        total = 0
        for frame in (self.obs, *self.obsm.values()):
            per_cell = frame.memory_usage(index=frame is not self.obs, deep=True).sum()
            total += int(per_cell / max(len(frame), 1) * n)
        for frame in (self.var, self.raw_var):
            if frame is not None:
                total += int(frame.memory_usage(index=True, deep=True).sum())
        for path in self.plan.carry.copies:
            total += _group_bytes(self.plan.paths[0], path, self.plan.storage_options)
        return total

    def write(self, f, rows: np.ndarray) -> None:
        """Writes the frames at `rows` into a part's root (raw's group before raw/X)."""
        empty = pd.DataFrame(index=pd.Index([], dtype=object))
        write_elem(f, "/", anndata.AnnData(obs=empty, var=self.var))
        write_obs(f, list(self.obs.columns), obs_part(self.obs, rows), rows, self.names)
        if self.raw_var is not None:
            if "raw" in f:  # the skeleton's `null` element
                del f["raw"]
            raw = f.create_group("raw")
            raw.attrs.update({"encoding-type": "raw", "encoding-version": "0.1.0"})
            write_elem(raw, "var", self.raw_var)
            write_elem(raw, "varm", {})
        for key, frame in self.obsm.items():
            write_elem(f["obsm"], key, frame.iloc[rows])
        if not self.plan.carry.copies:
            return
        with open_file(self.plan.paths[0], self.plan.storage_options) as src:
            for path in self.plan.carry.copies:
                if path in f:
                    del f[path]
                head, name = posixpath.split(path)
                if isinstance(f, h5py.Group) and isinstance(src, h5py.File):
                    src.copy(src[path], f[head or "/"], name=name)
                else:  # zarr: through anndata's readers and writers
                    write_elem(f[head] if head else f, name, read_elem(src[path]))


def read_obs(
    paths: list[str], columns: list[str], storage_options: dict | None = None
) -> pd.DataFrame:
    """The chosen obs columns of all inputs, concatenated (a `RangeIndex`, no names)."""
    per_column = {c: [] for c in columns}
    for path in paths:
        with open_file(path, storage_options) as f, _named(path, "obs" + _AS_FRAME):
            for c in columns:
                values = read_obs_values(f, c)
                if isinstance(values, pd.Series):
                    values = values.array
                per_column[c].append(pd.Series(values))
    return pd.DataFrame({c: _concat_column(c, per_column[c], paths) for c in columns})


def obs_part(obs: pd.DataFrame, rows: np.ndarray):
    """Yields `(name, values)`: each column of `obs` at `rows`, one at a time."""
    for name in obs.columns:
        values = obs[name].array
        if isinstance(values, pd.Categorical):  # `take` would copy rows to int64
            yield (
                name,
                pd.Categorical.from_codes(values.codes[rows], dtype=values.dtype),
            )
            continue
        values = values.take(rows)
        if type(values) is pd.arrays.NumpyExtensionArray:  # not its subclasses
            values = values.to_numpy()
        yield name, values


def _concat_column(name: str, parts: list[pd.Series], paths: list[str]):
    categorical = [isinstance(p.dtype, pd.CategoricalDtype) for p in parts]
    if len(parts) == 1:
        return parts[0].array
    if all(categorical):
        try:
            return pd.api.types.union_categoricals(
                [p.array for p in parts], sort_categories=False
            )
        except TypeError as e:
            raise errors.AnnDataFormatError(
                f"obs column {name!r}: its categories cannot be merged over "
                f"{paths} ({e}); expected unordered categoricals, or ordered ones "
                "with the same categories"
            ) from e
    if any(categorical):
        which = [p for p, c in zip(paths, categorical, strict=True) if c]
        other = [p for p, c in zip(paths, categorical, strict=True) if not c]
        raise errors.AnnDataFormatError(
            f"obs column {name!r} is categorical in {which} but "
            f"{parts[categorical.index(False)].dtype} in {other}; expected the "
            "same kind in every input (leave it out with obs_columns=[...])"
        )
    return pd.concat(parts, ignore_index=True).array


def _read_frame(path, element, options, name=None, fix=_CORRUPT):
    """An input's dataframe `element`; `AnnDataFormatError` naming it (`name`)."""
    with open_file(path, options) as f:
        group = f[element]
        with _named(path, (name or group.name) + _AS_FRAME, fix):
            return read_elem(group)


@contextlib.contextmanager
def _named(path: str, what: str, fix: str = _CORRUPT):
    """Raises the block's unexpected errors as `AnnDataFormatError`s naming `what`."""
    try:
        yield
    except (errors.AnnDataFormatError, errors.MissingColumnError):
        raise
    except Exception as e:
        raise errors.AnnDataFormatError(
            f"{path}: {what} ({type(e).__name__}: {e}); {fix}"
        ) from e


def _aligned(var: pd.DataFrame, column_map, var_names) -> pd.DataFrame:
    """The rows of `var` for the output genes; only the names if some are missing."""
    if column_map is None:
        return var
    stored = np.full(len(var_names), -1, np.int64)
    kept = np.flatnonzero(column_map >= 0)
    stored[column_map[kept]] = kept
    names = pd.Index(np.asarray(var_names).astype(str), dtype=object)
    if (stored < 0).any():  # `join="outer"`: a gene the first input lacks
        return pd.DataFrame(index=names)
    out = var.iloc[stored].copy()
    out.index = names
    return out


def grouped(perm: np.ndarray, plan: Plan) -> np.ndarray:
    """`perm` stably sorted by the `group_by` columns (the first outermost).

    Groups in category order (first appearance otherwise, a missing label last).
    """
    values = read_obs(plan.paths, plan.group_by, plan.storage_options)
    keys = []
    for name in reversed(plan.group_by):  # np.lexsort: the last key is primary
        column = values[name]
        if isinstance(column.dtype, pd.CategoricalDtype):
            codes = column.cat.codes.to_numpy()
        else:
            codes, _ = pd.factorize(column.to_numpy(), use_na_sentinel=True)
        codes = codes.astype(np.int64)
        codes[codes < 0] = codes.max(initial=0) + 1  # missing labels last
        keys.append(codes[perm])
    return perm[np.lexsort(keys)]


def _group_bytes(path: str, element: str, storage_options: dict) -> int:
    """Bytes of the datasets under an element of an input."""

    def sizes(node) -> list[int]:
        if is_array(node):
            return [int(node.size * node.dtype.itemsize)]
        return [n for key in node for n in sizes(node[key])]

    with open_file(path, storage_options) as f:
        node = f[element]
        got = sizes(node)
        return got[0] if is_array(node) else sum(got) + 4096 * (len(got) + 1)
