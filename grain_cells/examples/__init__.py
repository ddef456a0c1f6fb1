"""Examples built on grain_cells; `python -m grain_cells.examples.train` trains."""
