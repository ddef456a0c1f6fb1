"""Obs names of a preshuffle run: one numpy StringDType array, written in windows.

Design notes: docs/reference/design.md#preshuffle-preshuffle ("Memory").
"""

from __future__ import annotations

import anndata
import h5py
import numpy as np

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
    read_obs_names,
    write_elem,
)

STRINGS = np.dtypes.StringDType()
WINDOW = 1 << 18  # names per slice read or written (h5py makes objects of a slice)


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
            with open_file(path, storage_options) as f:
                try:
                    chars += _read_file(f, out[start:stop])
                except errors.AnnDataFormatError:
                    raise
                except Exception as e:
                    raise errors.AnnDataFormatError(
                        f"{path}: obs names cannot be read ({type(e).__name__}: "
                        f"{e}); the file may be corrupt"
                    ) from e
        return cls(out, chars / max(out.size, 1))

    def disk_bytes(self, n: int) -> int:
        """An upper bound of the bytes `n` names take in an h5ad part.

        16 bytes in the dataset, a 16-byte heap object, UTF-8 padded to 8.
        """
        return int(n * (40 + 4 * self.mean_chars))


def _read_file(f, out: np.ndarray) -> int:
    """Fills `out` with the obs names of the open file `f`; returns their chars."""
    index = _plain_index(f)
    # Another encoding than a plain string array: through anndata (objects).
    source = read_obs_names(f) if index is None else index
    n, got = out.size, len(source) if index is None else int(index.shape[0])
    if got != n:
        raise errors.AnnDataFormatError(
            f"{file_name(f)}: obs has {got} names but X has {n} rows"
        )
    if index is None:
        source = np.asarray(source, dtype=str)
    elif isinstance(index, h5py.Dataset):
        source = index.astype(STRINGS)
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
    group.attrs["encoding-type"] = "dataframe"
    group.attrs["encoding-version"] = "0.2.0"
    group.attrs["_index"] = "_index"
    group.attrs["column-order"] = list(order)
    n = int(rows.size)
    index = _string_array(group, "_index", n)
    for a in range(0, n, WINDOW):
        b = min(a + WINDOW, n)
        index[a:b] = names.values[rows[a:b]]
    # A nullable string column (`pd.arrays.StringArray`) came from an input
    # that holds one: it goes back as it was, which anndata 0.11-0.12 write
    # only with this setting on (0.13: on unless set off).
    with anndata.settings.override(allow_write_nullable_strings=True):
        for name, values in columns:
            write_elem(group, name, values)


def _string_array(group, name: str, n: int):
    """An empty `string-array` of `n` entries, as anndata writes it."""
    if isinstance(group, h5py.Group):
        array = group.create_dataset(name, (n,), dtype=h5py.string_dtype())
    else:  # zarr, as anndata's `write_vlen_string_array_zarr`
        from zarr.core.dtype import VariableLengthUTF8  # imports zarr

        v2 = group.metadata.zarr_format == 2
        if v2:
            from numcodecs import VLenUTF8

        array = group.create_array(
            name,
            shape=(n,),
            dtype=VariableLengthUTF8(),
            filters=[VLenUTF8()] if v2 else None,
            fill_value="" if v2 else None,
        )
    array.attrs["encoding-type"] = "string-array"
    array.attrs["encoding-version"] = "0.2.0"
    return array
