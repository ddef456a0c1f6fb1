"""Another element of a file set's files: a layer, `raw/X` or an `obsm` array.

`element_files(files, element)` returns the `FileSet` of the same files
whose matrix is `element`: the same paths, identities (taken when the source
was built) and storage options, with that element located, checked and its
columns aligned. Read it as the source's own matrix is read, with
`OpenFiles(..., read_threads)` and `fetch_ranges`: batched reads, on the read
threads, each file opened as the version its identity names, checked at
open and at every read, so a file changed under the source raises
`errors.SourceChangedError` whichever matrix reads it.

Design notes: docs/reference/design.md#io-element-files.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from grain_cells import errors
from grain_cells.io import _h5ad, _nodes
from grain_cells.io._file_set import FileSet
from grain_cells.io._frames import var_group_name
from grain_cells.io._genes import (
    GeneAlignment,
    align_genes,
    read_gene_keys,
    shared_keys,
)
from grain_cells.io._obsm import OBSM, inspect_element
from grain_cells.io._open import open_file


def element_files(files: FileSet, element: str) -> FileSet:
    """The file set of the same files that reads `element` (no obs columns).

    Opens every file once, as the version its identity names.

    Args:
        files: The source's file set.
        element: `X`, `raw/X`, `layers/<name>` (see `h5ad.matrix_element`)
            or `obsm/<name>` (`grain_cells.io._obsm.obsm_element`).

    Raises:
        errors.SourceChangedError: A file changed since `files` was built.
        errors.MissingColumnError: A file has no such element.
        errors.AnnDataFormatError: The element has other rows than the file's
            cells, or an obsm array has other widths in other files.
        errors.UnsupportedLayoutError: The element is CSC, or sparse in some
            files and dense in others.
    """
    infos: list[_h5ad.MatrixInfo] = []
    var_names: list[np.ndarray] = []
    seen_keys: dict = {}
    own_var = not element.startswith(OBSM) and (
        var_group_name(element) != var_group_name(files.element)
    )
    for identity, expected in zip(files.identities, files.infos, strict=True):
        path = identity.path
        with open_file(path, files.storage_options, identity.stat) as f:
            identity.check_stat(
                _nodes.stat_of(f, path), f"when {element} was opened beside it"
            )
            info = inspect_element(f, element)
            if own_var:
                keys = read_gene_keys(f, element, files.genes.genes_from)
                var_names.append(shared_keys(keys, seen_keys))
        if info.n_obs != expected.n_obs:
            raise errors.AnnDataFormatError(
                f"{path}: {info.element} has {info.n_obs} rows but "
                f"{expected.element} has {expected.n_obs}; expected one row per "
                "cell"
            )
        infos.append(info)
    encodings = {i.encoding for i in infos}
    if len(encodings) > 1:
        raise errors.UnsupportedLayoutError(
            f"{element} is sparse in some files and dense in others "
            f"({', '.join(f'{i.path}: {i.encoding}' for i in infos)}); "
            "all files must share an encoding to read it"
        )
    if element.startswith(OBSM):
        genes = _columns(infos)
    elif own_var:
        genes = align_genes(
            files.paths, var_names, files.genes.join, None, files.genes.genes_from
        )
    else:
        genes = files.genes
    return dataclasses.replace(
        files,
        element=element,
        infos=tuple(infos),
        genes=genes,
        obs_names=(),
        obs={},
        sparse=infos[0].encoding == _h5ad.CSR,
        dtype=np.result_type(*(_h5ad.value_dtype(i.dtype) for i in infos)),
    )


def _columns(infos: list[_h5ad.MatrixInfo]) -> GeneAlignment:
    """An obsm array's columns (named by position), the same in every file.

    Raises:
        errors.AnnDataFormatError: Files have different widths.
    """
    widths = [i.n_vars for i in infos]
    if len(set(widths)) > 1:
        name = infos[0].element
        raise errors.AnnDataFormatError(
            f"{name} has {widths} columns in files {[i.path for i in infos]}; "
            "every file must have the same width"
        )
    names = np.arange(widths[0]).astype(str)
    return GeneAlignment("exact", names, widths[0], (None,) * len(infos), None)


__all__ = ["element_files"]
