"""obs and var of a preshuffled part: read from the inputs, merged, written.

Categorical columns keep their categories, merged over the inputs in order of
first appearance (`pandas.api.types.union_categoricals`); other columns are
concatenated as stored. (`grain_cells.io._obs` harmonises columns into integer
codes for reading; a part must keep strings and dtypes as anndata wrote them,
so the merge here works on pandas objects.)
"""

from __future__ import annotations

import anndata
import h5py
import numpy as np
import pandas as pd

from grain_cells import errors
from grain_cells.io import _frames as io_frames
from grain_cells.io import _h5ad as h5ad
from grain_cells.preshuffle._plan import Plan


def read_obs(
    paths: list[str], columns: list[str], storage_options: dict | None = None
) -> pd.DataFrame:
    """The chosen obs columns of all inputs, concatenated, with obs names."""
    names, per_column = [], {c: [] for c in columns}
    for path in paths:
        with h5ad.open_file(path, storage_options) as f:
            try:
                names.append(io_frames.read_obs_names(f))
                for c in columns:
                    values = io_frames.read_obs_values(f, c)
                    if isinstance(values, pd.Series):
                        values = values.array
                    per_column[c].append(pd.Series(values))
            except (errors.AnnDataFormatError, errors.MissingColumnError):
                raise
            except Exception as e:
                raise errors.AnnDataFormatError(
                    f"{path}: obs cannot be read as an anndata dataframe "
                    f"({type(e).__name__}: {e}); the file may be corrupt"
                ) from e
    index = pd.Index(np.concatenate(names) if names else [], dtype=object)
    frame = {c: _concat_column(c, per_column[c], paths) for c in columns}
    return pd.DataFrame(frame, index=index)


def _concat_column(name: str, parts: list[pd.Series], paths: list[str]):
    categorical = [isinstance(p.dtype, pd.CategoricalDtype) for p in parts]
    if all(categorical):
        if len(parts) == 1:
            return parts[0].array
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
    if len(parts) == 1:
        return parts[0].array
    return pd.concat(parts, ignore_index=True).array


def _read_var(path: str, element: str, storage_options: dict) -> pd.DataFrame:
    with h5ad.open_file(path, storage_options) as f:
        group = f["raw/var"] if element == "raw/X" else f["var"]
        try:
            var = io_frames.read_elem(group)
        except Exception as e:
            raise errors.AnnDataFormatError(
                f"{path}: {group.name} cannot be read as an anndata dataframe "
                f"({type(e).__name__}: {e}); the file may be corrupt"
            ) from e
    return var


def read_var(plan: Plan) -> pd.DataFrame:
    """The output's var: the first input's, for the output genes.

    With gene alignment (`join`, `genes`), the first input's rows for the
    output genes, in output order; when some output gene is not in the
    first input (`join="outer"`), only the gene names.
    """
    var = _read_var(plan.paths[0], plan.element, plan.storage_options)
    column_map = plan.column_map_first
    if column_map is None:
        return var
    stored = np.full(plan.n_vars, -1, np.int64)
    kept = np.flatnonzero(column_map >= 0)
    stored[column_map[kept]] = kept
    names = pd.Index(np.asarray(plan.source.var_names).astype(str), dtype=object)
    if (stored < 0).any():
        return pd.DataFrame(index=names)
    out = var.iloc[stored].copy()
    out.index = names
    return out


def write_frames(f: h5py.File, obs: pd.DataFrame, var: pd.DataFrame) -> None:
    """Writes an AnnData skeleton (obs, var, no X) into an open file."""
    io_frames.write_elem(f, "/", anndata.AnnData(obs=obs, var=var))
