"""The AnnData schema on disk (any format): opening it, where the matrix is, is it sane.

`open_file` opens a path with the format that claims it and refuses what is not
AnnData; `inspect_*` locate a matrix (`X`, `layers/<name>`, `raw/X`, `obsm/<name>`)
and check it from metadata, asking the format what only it knows.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings

import numpy as np

from grain_cells import errors, formats
from grain_cells.formats import value_dtype as value_dtype
from grain_cells.io import _nodes
from grain_cells.io._frames import encoding_of, n_rows, var_group_name
from grain_cells.io._nodes import file_name
from grain_cells.io._obs import read_obs_column as read_obs_column
from grain_cells.storage import FileStat
from grain_cells.storage.remote import content_due, is_url, local_path

CSR = "csr_matrix"
CSC = "csc_matrix"
DENSE = "array"
OBSM = "obsm/"


def matrix_element(layer: str | None) -> str:
    """The element of `layer`: `X` (None), `raw/X` (`"raw"`), or `layers/<name>`."""
    if layer is None or layer == "X":
        return "X"
    if layer in ("raw", "raw/X"):
        return "raw/X"
    return f"layers/{layer}"


@dataclasses.dataclass(frozen=True, slots=True)
class MatrixInfo:
    """Where a file's matrix lives and what it holds (`nnz`: None if dense).

    `chunk_bytes`: decoded bytes of a compressed chunk (CSR: data + indices).
    """

    path: str
    element: str
    encoding: str
    n_obs: int
    n_vars: int
    dtype: np.dtype
    nnz: int | None
    chunk_bytes: int | None = None

    def describe(self) -> str:
        """A one-line summary used to detect changed files."""
        nnz = "" if self.nnz is None else f", nnz={self.nnz}"
        return (
            f"{self.element}: {self.encoding} {self.n_obs}x{self.n_vars} "
            f"{self.dtype}{nnz}"
        )


def inspect_matrix(f, element: str) -> MatrixInfo:
    """Locates and checks the matrix at `element` from metadata and two `indptr` values.

    Raises MissingColumnError, UnsupportedLayoutError, CorruptDataError or
    AnnDataFormatError.
    """
    path = file_name(f)
    if element == "raw/X" and "raw" not in f and "raw.X" in f:
        element = "raw.X"  # anndata < 0.7
    obj = _nodes.get(f, element)
    if obj is None:
        problem = _nodes.format_of(f).element_problem(f, element)
        if problem is not None:
            raise errors.AnnDataFormatError(f"{path}: {problem}")
        have = ["X"] if "X" in f else []  # the file's matrices
        if "layers" in f and _nodes.is_group(f["layers"]):
            have += [f"layers/{k}" for k in sorted(f["layers"].keys())]
        if "raw" in f and _nodes.is_group(f["raw"]) and "X" in f["raw"]:
            have.append("raw/X")
        have += ["raw.X"] if "raw.X" in f else []
        hint = (
            " anndata writes files without X when the AnnData had none "
            "(e.g. AnnData(shape=...)); read a layer instead with layer=..."
        )
        hint = hint if element == "X" else ""
        raise errors.MissingColumnError(
            f"{path}: has no {element}.{hint} Matrices in this file: {have or 'none'}"
        )
    if _nodes.is_group(obj):
        info = _inspect_sparse(path, element, obj)
    else:  # an array (formats have only groups and arrays)
        if obj.ndim != 2:
            raise errors.UnsupportedLayoutError(
                f"{path}: {element} is a {obj.ndim}-D dataset; expected a 2-D "
                "dense matrix or a csr_matrix group"
            )
        if obj.dtype.kind not in "biuf":
            raise errors.UnsupportedLayoutError(
                f"{path}: {element} has dtype {obj.dtype}; expected numeric"
            )
        _nodes.format_of(obj).check_array(path, obj)
        n_obs, n_vars = (int(s) for s in obj.shape)
        chunk = _nodes.format_of(obj).chunk_bytes(obj)
        info = MatrixInfo(path, element, DENSE, n_obs, n_vars, obj.dtype, None, chunk)
    var_rows = n_rows(_nodes.at(f, var_group_name(element)))
    obs_rows = n_rows(_nodes.at(f, "obs"))
    if obs_rows is not None and obs_rows != info.n_obs:
        raise errors.AnnDataFormatError(
            f"{path}: {element} has {info.n_obs} rows but obs has {obs_rows}"
        )
    if var_rows is not None and var_rows != info.n_vars:
        raise errors.AnnDataFormatError(
            f"{path}: {element} has {info.n_vars} columns but its var has "
            f"{var_rows} rows"
        )
    return info


def _inspect_sparse(path: str, element: str, obj) -> MatrixInfo:
    enc, shape = encoding_of(obj), _nodes.attr(obj, "shape")
    if enc is None and "h5sparse_format" in obj.attrs:  # anndata < 0.7
        fmt = str(_nodes.attr_str(obj, "h5sparse_format"))
        enc = {"csr": CSR, "csc": CSC}.get(fmt, fmt)
        shape = obj.attrs.get("h5sparse_shape")
    if enc == CSC:
        raise errors.UnsupportedLayoutError(
            f"{path}: {element} is stored as csc_matrix; row reads would touch "
            "every column. Convert it once to CSR, e.g. with anndata: "
            "`a = anndata.read_h5ad(path); a.X = a.X.tocsr(); "
            "a.write_h5ad(new_path)` (use a layer name instead of X as needed)."
        )
    if enc != CSR:
        raise errors.UnsupportedLayoutError(
            f"{path}: {element} is a group with encoding-type {enc!r}; expected "
            "'csr_matrix' (sparse) or a dense 2-D dataset"
        )
    arrays = {name: _nodes.get(obj, name) for name in ("data", "indices", "indptr")}
    for name, node in arrays.items():
        if not _nodes.is_array(node):
            problem = _nodes.format_of(obj).element_problem(obj, f"{element}/{name}")
            if problem is not None:
                raise errors.AnnDataFormatError(f"{path}: {problem}")
            raise errors.AnnDataFormatError(
                f"{path}: {element} is a csr_matrix without the dataset "
                f"'{name}'; found {sorted(obj.keys())}"
            )
    if shape is None or len(shape) != 2:
        raise errors.AnnDataFormatError(
            f"{path}: {element} has no 2-element 'shape' attribute (found {shape!r})"
        )
    n_obs, n_vars = int(shape[0]), int(shape[1])
    data, indices, indptr = arrays["data"], arrays["indices"], arrays["indptr"]
    nnz = int(data.shape[0])
    if len(data.shape) != 1 or len(indices.shape) != 1 or len(indptr.shape) != 1:
        raise errors.AnnDataFormatError(
            f"{path}: {element}/data, indices and indptr must be 1-D; found "
            f"shapes {data.shape}, {indices.shape}, {indptr.shape}"
        )
    if indptr.shape[0] != n_obs + 1:
        raise errors.AnnDataFormatError(
            f"{path}: {element}/indptr has {indptr.shape[0]} entries; the "
            f"shape attribute {n_obs}x{n_vars} needs {n_obs + 1}"
        )
    if indices.shape[0] != nnz:
        raise errors.AnnDataFormatError(
            f"{path}: {element}/indices has {indices.shape[0]} entries but "
            f"data has {nnz}; they must match"
        )
    if indices.dtype.kind not in "iu" or indptr.dtype.kind not in "iu":
        raise errors.AnnDataFormatError(
            f"{path}: {element}/indices and indptr must be integers; found "
            f"{indices.dtype} and {indptr.dtype}"
        )
    if data.dtype.kind not in "biuf":
        raise errors.UnsupportedLayoutError(
            f"{path}: {element}/data has dtype {data.dtype}; expected a numeric dtype"
        )
    for dataset in (indptr, indices, data):
        _nodes.format_of(dataset).check_array(path, dataset)
    try:
        # Both ends in one read (the format's point selection).
        at = np.array([0, n_obs] if n_obs else [0], np.int64)
        ends = _nodes.format_of(indptr).read(indptr, at, path, (0, n_obs + 1)).tolist()
    except errors.CorruptChunkError:  # the format named the damaged chunk
        raise
    except (OSError, ValueError) as e:
        raise errors.AnnDataFormatError(
            f"{path}: reading {element}/indptr failed ({e}); the file is "
            "probably truncated"
        ) from e
    if int(ends[0]) != 0 or int(ends[-1]) != nnz:
        raise errors.CorruptDataError(
            f"{path}: {element}/indptr runs from {int(ends[0])} to "
            f"{int(ends[-1])}; expected 0 to {nnz} (the length of data)"
        )
    fmt = _nodes.format_of(data)
    sizes = (fmt.chunk_bytes(data), fmt.chunk_bytes(indices))
    chunk_bytes = None if None in sizes else sum(sizes)
    return MatrixInfo(path, element, CSR, n_obs, n_vars, data.dtype, nnz, chunk_bytes)


def open_file(
    path: str | os.PathLike,
    storage_options: dict | None = None,
    stat: FileStat | None = None,
):
    """Opens an AnnData file or store read-only (`stat`: the version expected).

    Raises `FileNotFoundError`, or `AnnDataFormatError` for what is not AnnData.
    """
    path = os.fspath(path)
    f = formats.for_path(path).open(path, storage_options, stat)
    mod = _nodes.get(f, "mod")
    if encoding_of(f) == "MuData" or _nodes.is_group(mod):
        modalities = sorted(mod.keys()) if _nodes.is_group(mod) else []
        f.close()
        first = modalities[0] if modalities else "rna"
        raise errors.UnsupportedLayoutError(
            f"{path}: a MuData (.h5mu) file with modalities {modalities}; "
            "grain_cells reads AnnData (.h5ad). Write the modality you want as "
            "its own .h5ad once, e.g. with anndata alone: `with h5py.File(path) "
            f"as f: anndata.io.read_elem(f['mod/{first}']).write_h5ad("
            f"'{first}.h5ad')` (or mudata.read_h5mu(path)['{first}'])."
        )
    missing = [k for k in ("obs", "var") if _nodes.get(f, k) is None]
    if missing:
        found = sorted(f.keys())
        f.close()
        kind = _nodes.format_of(f).description
        raise errors.AnnDataFormatError(
            f"{path}: {kind} but not AnnData: expected groups 'obs' and 'var' at "
            f"the root, found {found}"
        )
    return f


def resolve_paths(paths) -> list[str]:
    """One path or a sequence of paths as a list of str (ValueError if empty)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    # URLs of objects stay as they are; file:// URLs become local paths.
    out = [p if is_url(p) else os.fspath(pathlib.Path(local_path(p))) for p in paths]
    if not out:
        raise ValueError(
            "paths is empty: expected one or more .h5ad files or zarr stores"
        )
    _warn_repeats(out)
    return out


def _warn_repeats(paths: list[str]) -> None:
    """Warns when a path is listed more than once: its cells would repeat."""
    if len(set(paths)) == len(paths):
        return
    seen: dict[str, list[int]] = {}
    for i, p in enumerate(paths):
        seen.setdefault(p, []).append(i)
    repeats = {p: at for p, at in seen.items() if len(at) > 1}
    path, at = next(iter(repeats.items()))
    warnings.warn(
        f"{path} is listed {len(at)} times in paths (at {at}"
        f"{f'; {len(repeats) - 1} more paths repeat too' if len(repeats) > 1 else ''})"
        f": each listing is a file of the source, so its cells are read {len(at)} "
        "times per epoch. Pass each file once (e.g. sorted(set(paths))); to "
        "sample a file more often, weight its blocks (grain_cells.block_weights).",
        UserWarning,
        stacklevel=4,
    )


def obsm_element(name: str) -> str:
    return OBSM + name


def inspect_element(f, element: str) -> MatrixInfo:
    """`inspect_matrix`, or for `obsm/<name>` its `MatrixInfo` from metadata alone.

    Raises MissingColumnError, AnnDataFormatError or UnsupportedLayoutError.
    """
    if not element.startswith(OBSM):
        return inspect_matrix(f, element)
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
    return MatrixInfo(path, element, DENSE, n_obs, width, dtype, None)


def check_content(identity, storage_options: dict | None, when: str) -> None:
    """Reads an object's sampled bytes again where due: `SourceChangedError`.

    Due for an object whose ETag does not follow its content, unless this
    process read them less than `content_check_s` ago (`content_due`).
    """
    path, content = identity.path, identity.stat.content
    if content and content_due(path, content, storage_options):
        now = formats.for_path(path).stat_path(path, storage_options)
        identity.check_stat(now, when)


def open_unchanged(identity, storage_options: dict | None, when: str):
    """`identity`'s file opened as `open_file` does, checked: `SourceChangedError`."""
    path = identity.path
    check_content(identity, storage_options, when)
    f = open_file(path, storage_options, identity.stat)
    try:
        identity.check_stat(_nodes.format_of(f).stat_of(f, path), when)
    except BaseException:
        f.close()
        raise
    return f
