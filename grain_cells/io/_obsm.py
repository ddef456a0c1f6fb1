"""`obsm` arrays (`obsm/<name>`, `[n_obs, k]`) read as dense matrices of k columns.

Design notes: docs/reference/design.md#io-obsm.
"""

from __future__ import annotations

import numpy as np

from grain_cells import errors
from grain_cells.formats import value_dtype
from grain_cells.io import _h5ad, _nodes
from grain_cells.io._frames import encoding_of, n_rows
from grain_cells.io._matrix import CsrReader, DenseReader, RowBuffer
from grain_cells.io._nodes import file_name

OBSM = "obsm/"


def obsm_element(name: str) -> str:
    return OBSM + name


def inspect_obsm(f, element: str) -> _h5ad.MatrixInfo:
    """The `MatrixInfo` of `obsm/<name>` from its metadata alone.

    Raises MissingColumnError (no such key), AnnDataFormatError (not a dense
    2-D numeric array of one row per cell) or UnsupportedLayoutError.
    """
    path = file_name(f)
    name = element[len(OBSM) :]
    obsm = f.get("obsm")
    legacy = _nodes.is_array(obsm)  # a compound dataset (anndata < 0.7)
    have = [] if obsm is None else list(obsm.dtype.names or ()) if legacy else obsm
    if name not in have:
        have = have if legacy or obsm is None else sorted(obsm.keys())
        raise errors.MissingColumnError(
            f"{path}: obsm has no array {name!r}; it has {have}"
        )
    obs_rows = n_rows(f["obs"])
    if legacy:
        sub, _ = obsm.dtype.fields[name]
        shape, dtype, n_obs = sub.shape, sub.base, int(obsm.shape[0])
        if obsm.ndim != 1 or len(shape) > 1 or dtype.kind not in "biuf":
            raise errors.AnnDataFormatError(
                f"{path}: obsm is a compound dataset (anndata < 0.7) whose field "
                f"{name!r} holds {dtype} values of shape {shape} per cell "
                f"(dataset shape {obsm.shape}); expected one row per cell of "
                "numbers (shape () or (k,)). Rewrite the file with a current "
                "anndata (`anndata.read_h5ad(path).write_h5ad(new_path)`) and "
                "read that."
            )
        width = int(shape[0]) if shape else 1
        _nodes.format_of(obsm).check_array(path, obsm)
    else:
        ds = obsm[name]
        if not _nodes.is_array(ds) or ds.ndim != 2 or ds.dtype.kind not in "biuf":
            found = (
                f"a {ds.ndim}-D {ds.dtype} dataset of shape {ds.shape}"
                if _nodes.is_array(ds)
                else f"a group (encoding {encoding_of(ds)!r}: a dataframe "
                "or sparse matrix)"
            )
            raise errors.AnnDataFormatError(
                f"{path}: obsm/{name} is {found}; expected a dense 2-D numeric "
                "array of one row per cell and k columns"
            )
        _nodes.format_of(ds).check_array(path, ds)
        n_obs, width, dtype = int(ds.shape[0]), int(ds.shape[1]), ds.dtype
    if obs_rows is not None and n_obs != obs_rows:
        raise errors.AnnDataFormatError(
            f"{path}: obsm/{name} has {n_obs} rows but obs has {obs_rows}; "
            "expected one row per cell"
        )
    return _h5ad.MatrixInfo(path, element, _h5ad.DENSE, n_obs, width, dtype, None)


def inspect_element(f, element: str) -> _h5ad.MatrixInfo:
    """`inspect_obsm` for `obsm/<name>`, else `h5ad.inspect_matrix`."""
    if element.startswith(OBSM):
        return inspect_obsm(f, element)
    return _h5ad.inspect_matrix(f, element)


class FieldReader(DenseReader):
    """Reads row ranges of one field of a compound (anndata < 0.7) `obsm`."""

    KEY = "records"
    FILL = False

    def read(
        self, starts: np.ndarray, stops: np.ndarray, buf: RowBuffer, pool=None
    ) -> np.ndarray:
        """Reads whole records, then copies the field out in its value dtype."""
        starts = np.asarray(starts, np.int64)
        stops = np.asarray(stops, np.int64)
        n = int((stops - starts).sum())
        records = buf.get("records", (n,), self._x.dtype)
        self._x.read(starts, stops, records, pool)
        out = buf.get("dense", (n, self.info.n_vars), value_dtype(self.info.dtype))
        out[...] = records[self.info.element[len(OBSM) :]].reshape(n, self.info.n_vars)
        return out


def element_reader(
    f, info: _h5ad.MatrixInfo, fd
) -> CsrReader | DenseReader | FieldReader:
    """The reader of row ranges of the element `info` describes, in `f`."""
    if info.element.startswith(OBSM) and _nodes.is_array(f["obsm"]):
        return FieldReader(f["obsm"], info, fd)
    element = f[info.element]
    if info.encoding == _h5ad.CSR:
        return CsrReader(element, info, fd)
    return DenseReader(element, info, fd)
