"""Batched fetching (scDataset): read a fetch of blocks (X and the extra matrices
beside it), split it into minibatches.

Design notes: docs/reference/design.md#pipeline-fetch and #pipeline-extra.
"""  # noqa: D205

from __future__ import annotations

import collections.abc
import dataclasses
import math
import weakref

import numpy as np

from grain_cells._util import arguments, counter_rng
from grain_cells._util.ranges import expand_ranges
from grain_cells.io import (
    OpenFiles,
    RowBuffer,
    element_files,
    fetch_ranges,
    matrix_element,
    obsm_element,
)
from grain_cells.outputs import (
    CsrOutput,
    Fetch,
    Output,
    TruncationReport,
    declared,
    dtype_name,
    padded,
)
from grain_cells.source import AnnDataSource


@dataclasses.dataclass(frozen=True)
class FetchConfig:
    """The fetch keywords of `PipelineOptions`, resolved for one source.

    `cover`: blocks vary in size (a chunk grid), so a fetch takes enough blocks
    for `batch_size * fetch_factor` cells.
    """

    batch_size: int
    fetch_factor: int
    block_size: int
    shuffle: bool
    seed: int
    remainder: str
    output: Output
    numeric_obs: str = "native"
    condition: str | None = None
    cover: bool = False

    @property
    def blocks_per_fetch(self) -> int:
        cells = self.batch_size * self.fetch_factor
        if self.cover:
            return max(1, -(-cells // self.block_size))
        return max(1, cells // self.block_size)

    @property
    def max_minibatches(self) -> int:
        """Most minibatches one fetch yields (a condition may start per block)."""
        n = math.ceil(self.blocks_per_fetch * self.block_size / self.batch_size)
        return n + self.blocks_per_fetch if self.condition else n

    def fingerprint(self) -> dict:
        """What a checkpoint records (not the output nor `cover`)."""
        names = [f.name for f in dataclasses.fields(self)]
        return {k: getattr(self, k) for k in names if k not in ("output", "cover")}


@dataclasses.dataclass(frozen=True)
class Layer:
    """A matrix of the cells read beside X: `layers/<name>`, or `raw`.

    Attributes:
        name: The layer's name; `"raw"` for `raw/X`, `"X"` for X itself (e.g.
            X in a second output format).
        output: Its output format (any `grain_cells.Output`).
    """

    name: str
    output: Output = dataclasses.field(default_factory=CsrOutput)

    def __post_init__(self):
        arguments.check_name("name", self.name)
        object.__setattr__(self, "output", declared(self.output))

    def fingerprint(self) -> dict:
        """What a checkpoint records of this matrix: its name and output."""
        return _named(self, output=self.output.fingerprint())


@dataclasses.dataclass(frozen=True)
class Obsm:
    """An `obsm` array read beside X, as a dense `[batch, k]` array.

    Attributes:
        name: The key in `obsm` (e.g. `"X_pca"`).
        dtype: dtype of the output.
    """

    name: str
    dtype: str = "float32"

    def __post_init__(self):
        arguments.check_name("name", self.name)
        arguments.check_dtype("dtype", self.dtype)

    def fingerprint(self) -> dict:
        """What a checkpoint records of this array: its key and dtype."""
        return _named(self, dtype=dtype_name(self.dtype))


def _named(spec, **fields) -> dict:
    return {"class": type(spec).__name__, "name": spec.name, **fields}


class ElementReader:
    """Reads a `Layer` or an `Obsm` array of a source's cells (picklable); raises
    `MissingColumnError`, `AnnDataFormatError` or `SourceChangedError`.
    """  # noqa: D205

    def __init__(self, source: AnnDataSource, spec: Layer | Obsm):
        layer = isinstance(spec, Layer)
        element = (matrix_element if layer else obsm_element)(spec.name)
        self.spec = spec
        self.files = element_files(source.files, element)
        self.cell_offsets = source.cell_offsets
        self.check_indices = source.check_indices
        self._handles = OpenFiles(self.files, source.read_threads)
        if layer:  # e.g. PaddedSparseOutput(width=None), fitted on this layer
            fit = spec.output.fit_to_source(source, self.fetch)
            self.spec = dataclasses.replace(spec, output=fit)

    def fetch(self, starts, stops, buffer: RowBuffer | None = None, key: int = 0):
        """Rows of sorted global ranges: a layer's `Fetch`, or an obsm array."""
        at, check = (self._handles, self.cell_offsets), self.check_indices
        rows = fetch_ranges(*at, starts, stops, buffer, check_indices=check)
        if isinstance(self.spec, Obsm):
            return rows.dense.astype(self.spec.dtype)
        return Fetch(rows.dense, rows.row_ids, self.files.num_genes, key, _csr=rows.csr)

    def close(self) -> None:
        self._handles.close()

    def __repr__(self) -> str:
        return f"{self.spec!r}"


def readers(source: AnnDataSource, extra: dict | None) -> dict:
    """Readers of the extra matrices by key (`TypeError`: not `Layer`/`Obsm`)."""
    for key, spec in (extra or {}).items():
        if not isinstance(spec, Layer | Obsm):
            raise TypeError(
                f"extra[{key!r}] must be grain_cells.Layer or grain_cells.Obsm, "
                f"got {spec!r}"
            )
    return {key: ElementReader(source, spec) for key, spec in (extra or {}).items()}


class SplitFetch:
    """Reads one fetch of blocks into its shuffled `Minibatches` (no transport).

    Data-fitted outputs are fitted once, here.
    """

    def __init__(self, source: AnnDataSource, config: FetchConfig, extra=None):
        self.source = source
        output = config.output.fit_to_source(source)  # declared by PipelineOptions
        self.config = dataclasses.replace(config, output=output)
        self.extra = readers(source, extra)
        # [buffer, weakref to its fetch]: reused once the fetch is gone.
        self._buffers: list = []

    def __repr__(self) -> str:
        return f"SplitFetch({self.config!r}, extra={self.extra!r})"

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_buffers"] = []  # read buffers stay in the process that made them
        return state

    def fingerprint(self) -> dict:
        """What a checkpoint records: config, output and extra matrices."""
        return {
            "fetch": self.config.fingerprint(),
            "output": self.config.output.fingerprint(),
            "extra": {k: r.spec.fingerprint() for k, r in self.extra.items()},
        }

    def truncation_report(self) -> TruncationReport:
        """A report on the padded outputs of X and its extra layers."""
        outputs = {"": self.config.output}
        for name, reader in self.extra.items():
            if isinstance(reader.spec, Layer):
                outputs[f"{name}/"] = reader.spec.output
        return TruncationReport(outputs)

    def cell_order(
        self, blocks: np.ndarray, row_ids: np.ndarray, key: int | None = None
    ) -> np.ndarray:
        """Positions into `row_ids` (sorted) of the fetch's cells, shuffled
        (a block twice in a fetch gives its cells twice; `key`: `fetch_key`'s).
        """  # noqa: D205
        starts, stops = blocks[:, 2], blocks[:, 3]
        positions = np.searchsorted(row_ids, expand_ranges(starts, stops - starts))
        if self.config.shuffle:
            # Our own generator: no NumPy upgrade changes a resumed order.
            if key is None:
                key = fetch_key(self.config.seed, blocks[:, 0])
            positions = positions[counter_rng.permutation(positions.size, key=key)]
        return positions

    def read(self, blocks: np.ndarray) -> Minibatches:
        """The minibatches (built lazily) of a fetch's blocks: rows of
        (block id, file, start, stop), in sampler order.
        """  # noqa: D205
        cfg = self.config
        read = blocks[np.sort(np.unique(blocks[:, 0], return_index=True)[1])]
        entry = next((e for e in self._buffers if e[1]() is None), None)
        if entry is None:
            entry = [RowBuffer(), lambda: None]
            self._buffers.append(entry)
        rows = self.source.fetch_ranges(read[:, 2], read[:, 3], entry[0])
        key = fetch_key(cfg.seed, blocks[:, 0])
        fetch = Fetch(
            rows.dense, rows.row_ids, self.source.num_genes, key, _csr=rows.csr
        )
        extra = self._read_extra(read, key, rows.row_ids)
        order = self.cell_order(blocks, rows.row_ids, key)
        bounds = None
        if cfg.condition is not None:
            order, bounds = self._by_condition(order, rows.obs[cfg.condition])
        else:
            if cfg.remainder == "drop":
                order = order[: order.size - order.size % cfg.batch_size]
            fetch.order = order  # minibatch i: order[i*m:(i+1)*m]
            for part in extra.values():
                if isinstance(part, Fetch):  # a layer's rows: in X's order
                    part.order = order
        batches = Minibatches(self, fetch, rows.obs, extra, order, bounds)
        entry[1] = weakref.ref(batches)
        return batches

    def _by_condition(self, order: np.ndarray, values: np.ndarray):
        """`(order, bounds)`: cells grouped by condition, minibatch `i` being
        `order[bounds[i]:bounds[i + 1]]` (at most `batch_size` of one condition).
        """  # noqa: D205
        m = self.config.batch_size
        order = order[np.argsort(values[order], kind="stable")]
        codes = values[order]
        heads = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
        ends = np.r_[heads[1:], codes.size]
        chunks = -(-(ends - heads) // m)
        starts = np.repeat(heads, chunks) + m * (
            np.arange(int(chunks.sum())) - np.repeat(np.cumsum(chunks) - chunks, chunks)
        )
        stops = np.minimum(starts + m, np.repeat(ends, chunks))
        if self.config.remainder == "drop":  # whole minibatches only
            starts = starts[stops - starts == m]
            order = order[(starts[:, None] + np.arange(m)[None, :]).reshape(-1)]
            return order, np.arange(0, order.size + 1, m, dtype=np.int64)
        return order, np.r_[starts, order.size].astype(np.int64)

    def _read_extra(self, read: np.ndarray, key: int, row_ids: np.ndarray) -> dict:
        """The extra matrices' rows, in the order of X's fetch buffer."""
        read = read[np.argsort(read[:, 2], kind="stable")]
        out = {}
        for name, reader in self.extra.items():
            out[name] = part = reader.fetch(read[:, 2], read[:, 3], RowBuffer(), key)
            if isinstance(part, Fetch) and not np.array_equal(part.row_ids, row_ids):
                raise RuntimeError(f"extra matrix {name!r} read other rows")
        return out


class Minibatches(collections.abc.Sequence):
    """The minibatches of one fetch, each formatted when asked for.

    `report` sees each formatted minibatch; with `send`, item `i` is
    `send(format, i)` (a worker's handle of its slot).
    """

    report: TruncationReport | None = None
    send = None

    def __init__(self, split, fetch: Fetch, obs: dict, extra: dict, order, bounds):
        self._split = split
        self._fetch = fetch  # X's rows, as the output formats see them
        self._obs = obs
        self._extra = extra
        self._order = order
        m = split.config.batch_size
        if bounds is None:
            bounds = np.r_[np.arange(0, order.size, m), order.size]
        self._bounds = bounds.astype(np.int64)

    def __len__(self) -> int:
        return self._bounds.size - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"minibatch {i} of a fetch of {len(self)}")
        i %= len(self)
        return self.format(i) if self.send is None else self.send(self.format, i)

    def format(self, i: int, empty=np.empty) -> dict:
        """Minibatch `i`, its arrays made by `empty` (`np.empty`'s signature)."""
        split = self._split
        cfg = split.config
        rows = self._order[self._bounds[i] : self._bounds[i + 1]]
        m, n_real = cfg.batch_size, rows.size
        batch = cfg.output.format(self._fetch, rows, m, empty=empty)
        batch["row_ids"] = padded(empty, self._fetch.row_ids[rows], m, fill=-1)
        batch["mask"] = mask = empty((m,), bool)
        mask[:n_real], mask[n_real:] = True, False
        categories = split.source.categories
        for name, values in self._obs.items():
            if categories[name] is not None:
                dtype = np.int32  # codes, whatever the number of categories
            elif cfg.numeric_obs == "float32" and values.dtype.kind != "f":
                dtype = np.float32
            else:
                dtype = values.dtype  # numeric columns keep theirs (int64 stays)
            batch[f"obs/{name}"] = padded(empty, values[rows], m, dtype)
        for name, part in self._extra.items():
            if isinstance(part, np.ndarray):  # an obsm array
                batch[name] = padded(empty, part[rows], m)
                continue
            formatted = split.extra[name].spec.output.format(part, rows, m, empty=empty)
            for k, v in formatted.items():
                batch[f"{name}/{k}"] = v
        if self.report:
            self.report.observe(batch)
        return batch


def fetch_key(seed: int, block_ids: np.ndarray) -> int:
    """The 64-bit key of a fetch: a hash of the seed and its blocks in order."""
    return counter_rng.hash64_int(int(seed), *(int(b) for b in block_ids))
