"""AnnData files and zarr stores: opening, elements, obs, genes, row reads (private).

`_open.open_file` is the one opener of paths and URLs (`.h5ad` files and
zarr stores); `_nodes` makes h5py and zarr groups and arrays look alike
(and picks each array's range reader); `_h5ad` locates the
matrix and checks it; `_frames` and `_obs` read obs/var; `_genes` and
`_column_maps` align genes over files; `_matrix` reads row ranges of one
file (`_obsm`: of an `obsm` array); `_file_set` holds the files of a source
and each process's handles; `_element_files` derives the file set of another
element of the same files (a layer, `raw/X`, `obsm`); `_range_reads` reads
global row ranges over a file set.
"""
