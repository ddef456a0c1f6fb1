"""Minibatches on the accelerator: `device_iterator(loader_iterator, ...)`.

A loader's NumPy minibatches become global `jax.Array`s over every JAX process,
one copy ahead of the step, with static shapes; resumable as the loader is. JAX is
imported on first use (Grain's workers never need it).

Example:
    >>> batches = device_iterator(iter(loader), keys=("values", "indices", "mask"))
"""

__all__ = ["DeviceIterator", "device_iterator"]


def __getattr__(name: str):
    if name in __all__:
        from grain_cells.feed import _device

        return getattr(_device, name)
    raise AttributeError(f"module 'grain_cells.feed' has no attribute {name!r}")
