"""`annbatch_stores`: the stores of an annbatch collection.

zarr is imported when it is called, so importing `grain_cells` does not load it.
Design notes: docs/reference/design.md#zarr-annbatch.
"""

from __future__ import annotations

import os
import re

import numpy as np

from grain_cells import errors

_ENCODING = "annbatch-preshuffled"
_DATASET = re.compile(r"dataset_([0-9]+)")


def annbatch_stores(
    folder: str | os.PathLike, *, storage_options: dict | None = None
) -> list[str]:
    """The AnnData stores of an annbatch collection, in annbatch's order.

    Use as ``AnnDataSource(grain_cells.annbatch_stores(folder))``: one
    source over every ``dataset_N`` of the collection (gene alignment is
    trivial, the var of every dataset is checked to be the same).

    Args:
        folder: The collection annbatch wrote
            (``DatasetCollection(folder).add_adatas(...)``), a local
            directory or, where `grain_cells.zarr` opens URLs, a URL.
        storage_options: Credentials and options for a URL, as for
            ``AnnDataSource``.

    Returns:
        ``folder + "/dataset_N"`` for each dataset, by increasing ``N``.

    Raises:
        errors.AnnDataFormatError: ``folder`` is not a zarr group marked as
            annbatch's collection, or holds no dataset.
        errors.GeneMismatchError: Two datasets have different var names.

    Example:
        >>> source = grain_cells.AnnDataSource(  # doctest: +SKIP
        ...     grain_cells.annbatch_stores("/data/tahoe_shuffled.zarr"))
    """
    from grain_cells.zarr._store import open_group  # zarr loads here

    base = os.fspath(folder).rstrip("/")
    group = open_group(base, storage_options)
    if (found := group.attrs.get("encoding-type")) != _ENCODING:
        raise errors.AnnDataFormatError(
            f"{base}: not an annbatch collection (root attribute encoding-type "
            f"is {found!r}, expected {_ENCODING!r}, which "
            "annbatch.DatasetCollection.add_adatas writes); pass an AnnData "
            "store to AnnDataSource directly"
        )
    numbers = sorted(
        int(m.group(1))
        for key in group.group_keys()
        if (m := _DATASET.fullmatch(key)) is not None
    )
    if not numbers:
        raise errors.AnnDataFormatError(
            f"{base}: an annbatch collection with no dataset_N group; was "
            "add_adatas interrupted? Write the collection again"
        )
    stores = [f"{base}/dataset_{n}" for n in numbers]
    first = _var_names(group, f"dataset_{numbers[0]}", base)
    for n, store in zip(numbers[1:], stores[1:], strict=True):
        names = _var_names(group, f"dataset_{n}", base)
        if names.shape != first.shape or not np.array_equal(names, first):
            raise errors.GeneMismatchError(
                f"{store}: var differs from {stores[0]}'s "
                f"({_difference(first, names)}); "
                "annbatch writes one var for a whole collection, so this folder "
                "was changed after annbatch wrote it. Open the datasets as "
                "separate files with AnnDataSource(..., join=...) instead"
            )
    return stores


def _var_names(group, key: str, base: str) -> np.ndarray:
    import anndata

    try:
        var = group[key]["var"]
        index_key = var.attrs.get("_index", "_index")
        names = anndata.io.read_elem(var[index_key])
    except KeyError as e:
        raise errors.AnnDataFormatError(
            f"{base}/{key}: no var index ({e}); expected an AnnData group as "
            "annbatch writes it"
        ) from e
    return np.array([str(v) for v in names], dtype=object)


def _difference(a: np.ndarray, b: np.ndarray) -> str:
    if a.shape != b.shape:
        return f"{b.size} genes where the first has {a.size}"
    i = int(np.flatnonzero(a != b)[0])
    return f"gene {i} is {b[i]!r} where the first has {a[i]!r}"
