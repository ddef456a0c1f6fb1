"""The one pipeline: fetches read in workers, minibatches in order, resumable."""

from grain_cells.pipeline._config import PipelineOptions
from grain_cells.pipeline._dataset import READ_OPTIONS, CellDataset
from grain_cells.pipeline._fetch import FetchConfig, Layer, Obsm, SplitFetch
from grain_cells.pipeline._grain_ops import fetch_operations
from grain_cells.pipeline._loader import (
    CheckedIterator,
    DataLoader,
    cell_dataset,
    loader,
)
from grain_cells.pipeline._state_checks import STAMP

__all__ = [
    "READ_OPTIONS",
    "STAMP",
    "CellDataset",
    "CheckedIterator",
    "DataLoader",
    "FetchConfig",
    "Layer",
    "Obsm",
    "PipelineOptions",
    "SplitFetch",
    "cell_dataset",
    "fetch_operations",
    "loader",
]
