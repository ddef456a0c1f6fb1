"""The synthetic Tahoe-shaped cells as AnnData zarr stores, copied from the `.h5ad`.

Design notes: docs/reference/design.md#synthetic-zarr.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
import warnings

import h5py
import numpy as np

from grain_cells._util import arguments
from grain_cells.synthetic import _tahoe

ZARR_LAYOUTS = ("v3-sharded", "v3", "v2")
_PIECE_BYTES = 2**26  # unsharded stores are filled ~64 MiB at a time
_SHARD_TARGET_BYTES = 1_000_000_000  # anndata's target for `shards="auto"`
# Arguments of write_tahoe_like that make another h5ad than the copied one.
_NOT_FOR_ZARR = ("compression", "dense", "chunks", "progress")
_KIND = {True: "default", False: "raw"}


def write_tahoe_like_zarr(
    path: str | os.PathLike,
    n_cells: int,
    *,
    layout: str = "v3-sharded",
    compressed: bool = True,
    progress: bool = False,
    **kwargs,
) -> pathlib.Path:
    """Writes synthetic Tahoe-like cells as an AnnData zarr store at ``path``.

    The cells of ``write_tahoe_like(..., n_cells, **kwargs)`` (CSR X, uncompressed;
    ``kwargs`` among ``n_genes``, ``mean_nnz``, ``n_plates``, ``n_cell_lines``,
    ``n_drugs``, ``seed``, ``chunk_cells``), written beside ``path`` under a
    temporary name, copied into the store (replaced if it exists; its parent folder
    must exist) and removed. ``layout``: ``"v3-sharded"`` (anndata 0.13's default),
    ``"v3"`` or ``"v2"``; ``compressed`` keeps zarr's default codec (anndata's),
    else raw chunks; ``progress`` shows tqdm bars on stderr. Returns the store's path
    as a ``pathlib.Path``; raises ``ValueError`` for an argument out of range, or one
    that only shapes the ``.h5ad`` file (``compression``, ``dense``, ``chunks``).

    Example:
        >>> import anndata
        >>> p = write_tahoe_like_zarr("/tmp/tiny.zarr", 300, n_genes=500,
        ...                           mean_nnz=50, layout="v2")
        >>> anndata.read_zarr(p).shape
        (300, 500)
    """
    _check(n_cells, layout, compressed, kwargs)
    path = pathlib.Path(path)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as work:
        tmp = pathlib.Path(work, "cells.h5ad")
        _tahoe.write_tahoe_like(tmp, n_cells, progress=progress, **kwargs)
        return tahoe_like_to_zarr(tmp, path, layout, compressed, progress)


def cached_tahoe_like_zarr(
    n_cells: int,
    *,
    layout: str = "v3-sharded",
    compressed: bool = True,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
    **kwargs,
) -> pathlib.Path:
    """Returns a store made by ``write_tahoe_like_zarr`` with these arguments.

    Made once from ``cached_tahoe_like(n_cells, **kwargs)`` (made first if missing, and
    kept), named after it plus the layout and ``default`` or ``raw``
    (``tahoe_like-n400000-g62710-s0-none-v3-sharded-default.zarr``). ``n_cells``,
    ``layout``, ``compressed`` and ``**kwargs`` as for ``write_tahoe_like_zarr``,
    ``cache_dir`` as for ``cached_tahoe_like``; with ``progress`` a store that must
    be made is announced. Raises ``TypeError`` for an unknown argument and
    ``ValueError`` for an invalid one.
    """
    _check(n_cells, layout, compressed, kwargs)

    def make(h5ad: pathlib.Path, tmp: pathlib.Path) -> None:
        tahoe_like_to_zarr(h5ad, tmp, layout, compressed, progress)

    name = f"{layout}-{_KIND[compressed]}"
    return _made_from_cached(n_cells, cache_dir, progress, kwargs, name, make)


def cached_tahoe_like_annbatch(
    n_cells: int,
    *,
    shuffle_seed: int = 0,
    dataset_size: str = "20GB",
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
    **kwargs,
) -> pathlib.Path:
    """Returns annbatch's pre-shuffled collection of ``cached_tahoe_like``'s cells.

    Written once by annbatch at its defaults (``DatasetCollection(path).add_adatas(
    [h5ad], rng=...)``: lz4 blosc, 64-cell chunks, 1 GB shards) from
    ``cached_tahoe_like(n_cells, cache_dir=cache_dir, **kwargs)``, named
    ``...-annbatch-r0.zarr`` (``r`` the ``shuffle_seed``; ``-ds2GB`` for another
    ``dataset_size``: uncompressed bytes of cells shuffled in memory together and
    written as one ``dataset_N``, memory use about twice that). With ``progress`` a
    collection that must be made is announced. ``grain_cells.annbatch_stores`` lists
    its stores. Raises ``ImportError`` without annbatch (Python >= 3.12, the
    ``bench`` extra) and ``ValueError`` for an invalid argument.
    """
    _check(n_cells, "v3-sharded", True, kwargs)
    arguments.check_int("shuffle_seed", shuffle_seed, minimum=0)
    try:
        import annbatch
    except ImportError as e:
        raise ImportError(
            "cached_tahoe_like_annbatch needs annbatch (Python >= 3.12): "
            'pip install annbatch, or pip install -e ".[bench]"'
        ) from e

    def make(h5ad: pathlib.Path, tmp: pathlib.Path) -> None:
        shutil.rmtree(tmp)  # annbatch makes the group itself
        rng = np.random.default_rng(int(shuffle_seed))
        collection = annbatch.DatasetCollection(str(tmp))
        collection.add_adatas([str(h5ad)], rng=rng, dataset_size=dataset_size)

    tag = "" if dataset_size == "20GB" else f"-ds{dataset_size}"
    name = f"annbatch-r{int(shuffle_seed)}{tag}"
    return _made_from_cached(n_cells, cache_dir, progress, kwargs, name, make)


def _made_from_cached(n_cells, cache_dir, progress, kwargs, name, make):
    """`cached_tahoe_like`'s file's `-<name>.zarr` beside it, made once by `make`."""
    h5ad = _tahoe.cached_tahoe_like(
        n_cells, cache_dir=cache_dir, progress=progress, **kwargs
    )
    final = h5ad.with_name(f"{h5ad.stem}-{name}.zarr")
    announce = f"making {final} from {h5ad.name} (once)" if progress else None
    return _tahoe.made_once(final, lambda tmp: make(h5ad, tmp), announce, folder=True)


def tahoe_like_to_zarr(h5ad, path, layout, compressed, progress) -> pathlib.Path:
    """Copies a ``write_tahoe_like`` file (CSR X) into a zarr store at ``path``."""
    import anndata
    import zarr

    path = pathlib.Path(path)
    with h5py.File(h5ad, "r") as f:
        x = f["X"]
        if not isinstance(x, h5py.Group):
            raise ValueError(f"{h5ad}: X is dense; only CSR X is copied to zarr")
        shape = [int(n) for n in x.attrs["shape"]]
        obs = anndata.io.read_elem(f["obs"])
        var = anndata.io.read_elem(f["var"])
        if path.exists():
            shutil.rmtree(path)
        root = zarr.open_group(path, mode="w", zarr_format=2 if layout == "v2" else 3)
        with anndata.settings.override(auto_shard_zarr_v3=layout == "v3-sharded"):
            anndata.io.write_elem(root, "/", anndata.AnnData(obs=obs, var=var))
        del obs, var
        group = root.create_group("X")
        group.attrs.update(
            {"encoding-type": "csr_matrix", "encoding-version": "0.1.0", "shape": shape}
        )
        kwargs = {} if compressed else {"compressors": None}
        if layout == "v3-sharded":
            kwargs["shards"] = "auto"
        for name in ("indptr", "indices", "data"):  # as anndata would, piecewise
            source = x[name]
            with (
                warnings.catch_warnings(),
                zarr.config.set({"array.target_shard_size_bytes": _SHARD_TARGET_BYTES}),
            ):
                warnings.filterwarnings("ignore", "Automatic shard shape", UserWarning)
                array = group.create_array(
                    name, shape=source.shape, dtype=source.dtype, **kwargs
                )
            step = array.shards[0] if array.shards else array.chunks[0]
            if not array.shards:
                step *= max(1, _PIECE_BYTES // (step * source.dtype.itemsize))
            n = source.shape[0]
            with _tahoe.progress_bar(n, f"X/{name}", "values", progress) as bar:
                for lo in range(0, n, step):
                    hi = min(lo + step, n)
                    array[lo:hi] = source[lo:hi]
                    bar.update(hi - lo)
    with warnings.catch_warnings():  # zarr's note on the v3 spec, not this store
        warnings.filterwarnings("ignore", "Consolidated metadata is currently not part")
        zarr.consolidate_metadata(root.store)
    return path


def _check(n_cells, layout, compressed, kwargs) -> None:
    arguments.check_int("n_cells", n_cells, minimum=1)
    if layout not in ZARR_LAYOUTS:
        raise ValueError(f"layout must be one of {ZARR_LAYOUTS}, got layout={layout!r}")
    if not isinstance(compressed, bool):
        raise ValueError(f"compressed must be a bool, got compressed={compressed!r}")
    given = sorted(set(kwargs) & set(_NOT_FOR_ZARR))
    if given:
        raise ValueError(
            f"{given} shape only the .h5ad file, not the zarr store's cells: "
            "zarr stores are copied from the uncompressed CSR file; drop them "
            "(the store's codec is chosen by layout and compressed)"
        )
