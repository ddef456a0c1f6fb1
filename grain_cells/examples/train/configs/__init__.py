"""Configs of `python -m grain_cells.examples.train` (`default.py`: defaults)."""
