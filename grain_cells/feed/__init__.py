"""Minibatches on the accelerator: `device_iterator(loader_iterator, ...)`.

The last stage of the data path, in the trainer's process: a loader's NumPy
minibatches become `jax.Array`s, one transfer ahead of the step, as one global array
over every JAX process, with static shapes, optionally equal step counts on every
process and densified expression. Its state is the loader's, so orbax checkpoints
resume exactly. JAX is imported only when `device_iterator` is first used (Grain's
workers import grain_cells and must not pay for JAX).

Example:
    >>> batches = device_iterator(iter(loader), keys=("values", "indices", "mask"))
"""

__all__ = ["DeviceIterator", "device_iterator"]


def __getattr__(name: str):
    if name in __all__:
        from grain_cells.feed import _device

        return getattr(_device, name)
    raise AttributeError(f"module 'grain_cells.feed' has no attribute {name!r}")
