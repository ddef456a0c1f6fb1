"""Minibatches on the accelerator: `device_iterator(loader_iterator, ...)`.

The last stage of the data path, in the trainer's process: it turns a
loader's NumPy minibatches into `jax.Array`s, one transfer ahead of the step
(double buffering), as one global array over every JAX process, with static
shapes, optionally with equal step counts on every process and densified
expression. Its state is the loader's, so orbax checkpoints resume exactly.

Example:
    >>> from grain_cells.feed import device_iterator
    >>> batches = device_iterator(iter(loader), keys=("values", "indices", "mask"))
    >>> for batch in batches:
    ...     state, metrics = train_step(state, batch)

JAX is imported only when `device_iterator` is first used: Grain's worker
processes import grain_cells and must not pay for JAX.
"""

__all__ = ["DeviceIterator", "device_iterator"]


def __getattr__(name: str):
    if name in __all__:
        from grain_cells.feed import _device

        return getattr(_device, name)
    raise AttributeError(f"module 'grain_cells.feed' has no attribute {name!r}")
