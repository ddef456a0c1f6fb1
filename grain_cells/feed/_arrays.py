"""One minibatch to device arrays: the entries sent, static shapes, padding.

`Placement` shards a minibatch's leading axis over the devices of every JAX process and
checks every minibatch repeats the first one's shapes and dtypes, so a jitted step never
compiles again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grain_cells.outputs import densify

# CSR minibatches (`CsrOutput`) change shape from one minibatch to the next.
_CSR_KEYS = ("data", "indptr")


def default_sharding() -> NamedSharding:
    """The leading (batch) axis split over every device of every process."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
    return NamedSharding(mesh, P("data"))


class Placement:
    """Sends minibatches to the devices, checking they keep one shape.

    The arguments are `device_iterator`'s (`densify_genes`: its `densify`).
    """

    def __init__(
        self,
        sharding: jax.sharding.Sharding,
        keys: Sequence[str] | None,
        densify_genes: int | None,
        pinned_staging: bool,
    ):
        self.sharding = sharding
        self.keys = None if keys is None else tuple(keys)
        self.spec: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
        self._multi = jax.process_count() > 1
        self._pinned = (
            sharding.with_memory_kind("pinned_host") if pinned_staging else None
        )
        self._densify = None
        if densify_genes is not None:
            self._densify = jax.jit(
                lambda v, i: densify(v, i, densify_genes), out_shardings=sharding
            )
        self._flags = None

    def check(self, batch: Mapping[str, np.ndarray]) -> None:
        """Learns the spec from the first minibatch; checks the later ones.

        Raises:
            ValueError: An entry is missing, is CSR (ragged), or changed shape
                or dtype since the first minibatch.
        """
        if self.spec is None:
            self.spec = self._first_spec(batch)
            return
        for key, (shape, dtype) in self.spec.items():
            value = batch.get(key)
            if value is None:
                raise ValueError(_missing(key, batch))
            if value.shape != shape or value.dtype != dtype:
                raise ValueError(
                    f"minibatch entry {key!r} is {value.dtype}{list(value.shape)}, "
                    f"but the first minibatch's was {dtype}{list(shape)}; a device "
                    "feed needs static shapes (a new shape compiles the step "
                    "again). Use fixed-size outputs (PaddedSparseOutput, "
                    "DenseOutput, token outputs), whose minibatches all have "
                    "batch_size rows"
                )

    def _first_spec(self, batch: Mapping[str, np.ndarray]) -> dict:
        keys = self.keys if self.keys is not None else tuple(batch)
        ragged = [k for k in keys if k in _CSR_KEYS]
        if ragged:
            raise ValueError(
                f"minibatch entries {ragged} are CSR (CsrOutput), whose shapes "
                "change with every minibatch; a device feed needs static shapes. "
                "Use PaddedSparseOutput(width) (and densify=num_genes to get "
                "dense rows on the device), DenseOutput, or leave them out of keys"
            )
        spec = {}
        for key in keys:
            if key not in batch:
                raise ValueError(_missing(key, batch))
            value = np.asarray(batch[key])
            if value.ndim == 0:
                raise ValueError(
                    f"minibatch entry {key!r} is a scalar; the feed splits every "
                    "entry along its first (batch) axis: leave it out of keys"
                )
            spec[key] = (value.shape, value.dtype)
        if self._densify is not None:
            for key in ("values", "indices"):
                if key not in spec:
                    raise ValueError(
                        f"densify needs the padded-sparse entries 'values' and "
                        f"'indices' (PaddedSparseOutput), but {key!r} is not among "
                        f"the entries sent: {sorted(spec)}"
                    )
        return spec

    def padding(self) -> dict[str, np.ndarray]:
        """A minibatch of padding rows only (see `DeviceIterator`)."""
        out = {}
        for key, (shape, dtype) in self.spec.items():
            out[key] = np.full(shape, -1 if key == "row_ids" else 0, dtype)
        return out

    def put(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Starts the (asynchronous) copies of the spec's entries: device arrays."""
        host = {k: batch[k] for k in self.spec}
        if self._pinned is not None:
            out = jax.device_put(self._global(host, self._pinned), self.sharding)
        else:
            out = self._global(host, self.sharding)
        if self._densify is not None:
            out["X"] = self._densify(out.pop("values"), out.pop("indices"))
        return out

    def _global(self, host: dict, sharding) -> dict[str, jax.Array]:
        if not self._multi:  # one call for every entry: the cheapest path
            return jax.device_put(host, sharding)
        return {
            k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in host.items()
        }

    def any_process(self, has_data: bool) -> jax.Array:
        """A replicated scalar: does any process hold data at this step?

        A collective on the devices, so it runs in step order; read it later with
        `bool(...)`.
        """
        if self._flags is None:
            mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("all",))
            sharded, replicated = (
                NamedSharding(mesh, P("all")),
                NamedSharding(mesh, P()),
            )
            reduce = jax.jit(lambda f: f.any(), out_shardings=replicated)
            self._flags = (sharded, reduce)
        sharded, reduce = self._flags
        local = np.full(jax.local_device_count(), has_data)
        return reduce(jax.make_array_from_process_local_data(sharded, local))


def _missing(key: str, batch: Mapping) -> str:
    return (
        f"minibatch has no entry {key!r} (it has {sorted(batch)}); name only "
        "entries the loader's output format makes in keys"
    )
