"""`obsm` arrays as matrices of a file set: located, checked, read by row ranges.

An `obsm` array (`obsm/X_pca`, `[n_obs, k]`) is read like a dense matrix of
`k` columns: `inspect_element` describes it as a `MatrixInfo` (element
`obsm/<name>`, encoding `array`) and `element_reader` returns the reader of
its row ranges, so `grain_cells.io._file_set.OpenFiles` and
`grain_cells.io._range_reads.fetch_ranges` read it with their batched,
identity-checked reads (one call per file and fetch). Any other element goes
to `h5ad.inspect_matrix`.

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
    """The element path of `obsm` key `name` (`obsm/<name>`)."""
    return OBSM + name


def _keys(obsm) -> list[str]:
    """Keys of an `obsm` group or compound dataset (for messages)."""
    if _nodes.is_array(obsm):
        return list(obsm.dtype.names or ())
    return sorted(obsm.keys())


def _field_shape(path: str, name: str, ds) -> tuple[int, np.dtype]:
    """Width and stored dtype of field `name` of a compound `obsm` dataset."""
    sub, _ = ds.dtype.fields[name]
    shape = sub.shape
    if ds.ndim != 1 or len(shape) > 1 or sub.base.kind not in "biuf":
        raise errors.AnnDataFormatError(
            f"{path}: obsm is a compound dataset (anndata < 0.7) whose field "
            f"{name!r} holds {sub.base} values of shape {shape} per cell "
            f"(dataset shape {ds.shape}); expected one row per cell of numbers "
            "(shape () or (k,)). Rewrite the file with a current anndata "
            "(`anndata.read_h5ad(path).write_h5ad(new_path)`) and read that."
        )
    return (int(shape[0]) if shape else 1), sub.base


def inspect_obsm(f, element: str) -> _h5ad.MatrixInfo:
    """Locates and checks the `obsm` array at `element` (`obsm/<name>`).

    Reads only attributes, shapes and dtypes.

    Raises:
        errors.MissingColumnError: `obsm` has no such key; the message lists
            the keys it has.
        errors.AnnDataFormatError: The array is not a dense 2-D numeric array
            with one row per cell (a dataframe, a sparse matrix, 1-D).
        errors.UnsupportedLayoutError: Its HDF5 filter is not available.
    """
    path = file_name(f)
    name = element[len(OBSM) :]
    obsm = f.get("obsm")
    legacy = _nodes.is_array(obsm)
    present = obsm is not None and (
        name in (obsm.dtype.names or ()) if legacy else name in obsm
    )
    if not present:
        have = [] if obsm is None else _keys(obsm)
        raise errors.MissingColumnError(
            f"{path}: obsm has no array {name!r}; it has {have}"
        )
    obs_rows = n_rows(f["obs"])
    if legacy:
        width, dtype = _field_shape(path, name, obsm)
        n_obs = int(obsm.shape[0])
        _nodes.check_storage(path, obsm)
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
        _nodes.check_storage(path, ds)
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


class FieldReader:
    """Reads row ranges of one field of a compound (anndata < 0.7) `obsm`.

    Every range is read as whole records (one batched read per call, see
    `RangeReader`), then the field is copied out in its value dtype.
    """

    def __init__(self, dataset, info: _h5ad.MatrixInfo, fd):
        self.info = info
        self._field = info.element[len(OBSM) :]
        self._records = _nodes.range_reader(dataset, info.path, fd)
        self.dtype = value_dtype(info.dtype)

    @classmethod
    def of_arrays(cls, info: _h5ad.MatrixInfo, arrays: dict, fd) -> FieldReader:
        """A reader over a range reader made elsewhere (`arrays["records"]`)."""
        del fd  # read through the range reader's own
        self = cls.__new__(cls)
        self.info, self._field = info, info.element[len(OBSM) :]
        self._records, self.dtype = arrays["records"], value_dtype(info.dtype)
        return self

    @property
    def arrays(self) -> dict:
        """The range reader, as `{"records": reader}`."""
        return {"records": self._records}

    @property
    def direct(self) -> bool:
        """Whether records are read without the format's library."""
        return self._records.direct

    def chunk_starts(self) -> np.ndarray:
        """Local rows where a chunk of records begins (`[0]` when contiguous)."""
        length = self._records.chunk_length
        if length is None:
            return np.zeros(1, np.int64)
        return np.arange(0, max(self.info.n_obs, 1), length, dtype=np.int64)

    def advise(self, starts: np.ndarray, stops: np.ndarray, buf: RowBuffer) -> None:
        """Hints the OS to start reading these rows."""
        self._records.advise(starts, stops)

    def read(
        self, starts: np.ndarray, stops: np.ndarray, buf: RowBuffer, pool=None
    ) -> np.ndarray:
        """Reads rows `[starts[i], stops[i])` into a `(rows, k)` view of `buf`."""
        starts = np.asarray(starts, np.int64)
        stops = np.asarray(stops, np.int64)
        n = int((stops - starts).sum())
        records = buf.get("records", (n,), self._records.dtype)
        self._records.read(starts, stops, records, pool)
        out = buf.get("dense", (n, self.info.n_vars), self.dtype)
        out[...] = records[self._field].reshape(n, self.info.n_vars)
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


__all__ = [
    "OBSM",
    "FieldReader",
    "element_reader",
    "inspect_element",
    "inspect_obsm",
    "obsm_element",
]
