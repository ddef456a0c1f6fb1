"""AnnData's schema: opening, elements, obs, genes, identity, row reads (private).

Knows AnnData and no storage library: each format (`grain_cells.hdf5`,
`grain_cells.zarr`, any registered `grain_cells.formats.Format`) opens its
files and answers for its nodes. `_open.open_file` is the one opener of
paths and URLs (it asks `formats.for_path`); `_nodes` asks each node's
format what it is (and for a reader of its row ranges); `_h5ad` locates the
matrix and checks it; `_frames` and `_obs` read obs/var; `_genes` and
`_column_maps` align genes over files; `_matrix` reads row ranges of one
file (`_obsm`: of an `obsm` array); `_file_set` holds the files of a source
and each process's handles; `_identity` says whether a file is still the
one a source was built from (and what a checkpoint records);
`_element_files` derives the file set of another element of the same files
(a layer, `raw/X`, `obsm`); `_range_reads` reads global row ranges over a
file set.
"""
