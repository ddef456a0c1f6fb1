"""HDF5 datasets read by byte range, outside HDF5 where it is faster (private).

Knows nothing of AnnData: `_reads` reads sorted element ranges of a dataset
(uncompressed: positional reads; compressed: `_chunks` decodes chunks in
threads with `_codecs`); `_layout` checks that HDF5 can return a dataset's true
values; `_remote` lets h5py open a file whose bytes come from an object store.
"""
