"""AnnData's schema: opening, elements, obs, genes, identity, row reads (private).

Knows AnnData and no storage library: each registered `formats.Format`
opens its files and answers for its nodes (`_nodes`).
"""

from grain_cells.io._cells import Cells, take_csr
from grain_cells.io._collection import joined_column
from grain_cells.io._file_lru import check_max_open
from grain_cells.io._file_set import FileSet, OpenFile, OpenFiles, element_files
from grain_cells.io._frames import (
    encoding_of,
    is_legacy_frame,
    obs_columns,
    read_elem,
    read_obs_names,
    read_var_names,
    write_elem,
)
from grain_cells.io._genes import JOINS
from grain_cells.io._h5ad import (
    CSR,
    DENSE,
    MatrixInfo,
    inspect_matrix,
    matrix_element,
    obsm_element,
    open_file,
    resolve_paths,
)
from grain_cells.io._identity import (
    FileIdentity,
    file_entries,
    files_entry,
    source_identity,
)
from grain_cells.io._matrix import CsrRows, RowBuffer
from grain_cells.io._nodes import (
    attr_str,
    file_name,
    is_array,
    is_group,
    is_string_array,
)
from grain_cells.io._obs import OBS_MISSING, read_obs_values
from grain_cells.io._obs_cache import own_map
from grain_cells.io._range_reads import (
    FetchedRows,
    advise,
    fetch_ranges,
    read_ranges,
    read_rows,
)

__all__ = [
    "CSR",
    "DENSE",
    "JOINS",
    "OBS_MISSING",
    "Cells",
    "CsrRows",
    "FetchedRows",
    "FileIdentity",
    "FileSet",
    "MatrixInfo",
    "OpenFile",
    "OpenFiles",
    "RowBuffer",
    "advise",
    "attr_str",
    "check_max_open",
    "element_files",
    "encoding_of",
    "fetch_ranges",
    "file_entries",
    "file_name",
    "files_entry",
    "inspect_matrix",
    "is_array",
    "is_group",
    "is_legacy_frame",
    "is_string_array",
    "joined_column",
    "matrix_element",
    "obs_columns",
    "obsm_element",
    "open_file",
    "own_map",
    "read_elem",
    "read_obs_names",
    "read_obs_values",
    "read_ranges",
    "read_rows",
    "read_var_names",
    "resolve_paths",
    "source_identity",
    "take_csr",
    "write_elem",
]
