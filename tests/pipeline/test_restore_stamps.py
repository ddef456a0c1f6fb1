"""Checkpoint stamps: fingerprints of the configuration, not reprs.

A state's stamp records each component's `fingerprint()` (see
`grain_cells.pipeline._state_checks`): it restores once every repr has
changed, and a changed configuration is refused naming the field. The
golden states of `tests/data` were saved by grain_cells 5f1fd87, whose
stamps were repr texts (`tests/data/make_states.py` made them and builds the
same pipelines here): grain_cells is 0.x, so they are refused by name, with
the fix, even on copies of the very files they were saved on.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import grain
import numpy as np
import pytest
from grain import sharding

import grain_cells
import grain_cells.tokens
from grain_cells.errors import CheckpointMismatchError
from grain_cells.pipeline import CheckedIterator
from grain_cells.pipeline import _state_checks as state_checks
from grain_cells.pipeline._fetch import FetchConfig, SplitFetch

# The saved pipelines pad 8-value cells to width 6 on purpose (`truncate="first"`).
pytestmark = pytest.mark.filterwarnings("ignore::grain_cells.errors.TruncationWarning")

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
CONFIG = {"block_size": 5, "batch_size": 4, "fetch_factor": 5, "seed": 3}

OLD = json.loads((DATA / "states_5f1fd87.json").read_text())


def _load_make_states():
    spec = importlib.util.spec_from_file_location(
        "make_states", DATA / "make_states.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PIPELINES = _load_make_states().PIPELINES


@pytest.fixture(scope="module")
def old_paths(tmp_path_factory) -> list[str]:
    """Copies of the files the golden states were saved against.

    `tests/conftest.write_files` under anndata 0.12 (`make_states.py`); kept
    in `tests/data/5f1fd87/`, because a file's identity (bytes, HDF5 layout)
    depends on the anndata version that writes it, and a state restores only
    on the same data. Copied elsewhere: identity is by content, not path.
    """
    folder = tmp_path_factory.mktemp("old")
    paths = []
    for src in sorted((DATA / "5f1fd87").glob("part*.h5ad")):
        dst = folder / src.name
        dst.write_bytes(src.read_bytes())
        paths.append(str(dst))
    return paths


# Every class whose repr a stamp of grain_cells 5f1fd87 held (today's hold none).
REPRS = [
    grain_cells.BlockSampler,
    grain_cells.WeightedBlockSampler,
    grain_cells.ConditionBlockSampler,
    SplitFetch,
    FetchConfig,
    grain_cells.CsrOutput,
    grain_cells.PaddedSparseOutput,
    grain_cells.DenseOutput,
    grain_cells.Layer,
    grain_cells.Obsm,
    grain_cells.tokens.RankValueTokens,
    grain_cells.tokens.ValueBinTokens,
]


def change_reprs(monkeypatch) -> None:
    """Gives every class of `REPRS` another repr."""
    for cls in REPRS:
        monkeypatch.setattr(cls, "__repr__", lambda self: "changed!", raising=True)


def set_state(iterator, state: dict) -> None:
    """`set_state` of a DataLoader's iterator (JSON bytes) or a dataset's (dict)."""
    if isinstance(iterator, CheckedIterator):
        iterator.set_state(json.dumps(state).encode())
    else:
        iterator.set_state(state)


def state_of(iterator) -> dict:
    """An iterator's state as it reads back from JSON."""
    state = iterator.get_state()
    return json.loads(state if isinstance(state, bytes) else json.dumps(state))


def same_batches(got, expected) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


OLDER = [
    "saved by an older grain_cells",
    "records the sampler and fetch transform as repr texts",
    "Start the data iterator afresh (from the beginning of the epoch), or "
    "restore the state with the grain_cells version that saved it.",
]


@pytest.mark.parametrize("name", list(PIPELINES))
def test_state_of_5f1fd87_is_refused_by_name(old_paths, helpers, name):
    """A state saved by grain_cells 5f1fd87 (stamped by repr texts), restored
    on copies of its files, is refused as an older grain_cells's, saying what
    to do; the iterator then goes on from the start, as an uninterrupted run."""
    old = OLD["states"][name]
    assert isinstance(old["state"]["grain_cells"]["sampler"], str)  # a repr stamp
    everything = helpers.run(PIPELINES[name](old_paths), 3)
    restored = iter(PIPELINES[name](old_paths))
    with pytest.raises(CheckpointMismatchError) as e:
        set_state(restored, old["state"])
    for text in OLDER:
        assert text in str(e.value), str(e.value)
    same_batches(helpers.take(restored, 3), everything)


@pytest.mark.parametrize("name", list(PIPELINES))
def test_restore_survives_changed_reprs(csr_paths, helpers, monkeypatch, name):
    """The stamp records configuration, not repr: a repr may change."""
    everything = helpers.run(PIPELINES[name](csr_paths))
    iterator = iter(PIPELINES[name](csr_paths))
    helpers.take(iterator, 5)
    state = state_of(iterator)
    change_reprs(monkeypatch)
    restored = iter(PIPELINES[name](csr_paths))
    set_state(restored, state)
    same_batches(helpers.take(restored), everything[5:])


@pytest.mark.parametrize(
    "name, change, expected",
    [
        pytest.param(
            "block_csr",
            {"seed": 4},
            [
                "sampler: saved seed=3, now seed=4",
                "saved fetch.seed=3, now fetch.seed=4",
            ],
            id="seed",
        ),
        pytest.param(
            "block_csr",
            {"num_epochs": 2},
            ["sampler: saved num_epochs=1, now num_epochs=2"],
            id="num_epochs",
        ),
        pytest.param(
            "block_csr",
            {"fetch_factor": 10},
            ["operations: saved fetch.fetch_factor=5, now fetch.fetch_factor=10"],
            id="fetch_factor",
        ),
        pytest.param(
            "padded_dataset",
            {"width": 7},
            ["operations: saved output.width=6, now output.width=7"],
            id="output-width",
        ),
        pytest.param(
            "padded_dataset",
            {"numeric_obs": "native"},
            ["operations: saved ", "numeric_obs='float32'"],
            id="numeric_obs",
        ),
        pytest.param(
            "padded_dataset",
            {"extra_dtype": "float16"},
            ["operations: saved ", "extra", "'float16'"],
            id="extra-matrix",
        ),
        pytest.param(
            "weighted",
            {"first_weight": 5.0},
            ["sampler: saved weights=", "sha256:919c924dc874ed32"],
            id="weights",
        ),
        pytest.param(
            "weighted",
            {"epoch_blocks": 48},
            ["epoch_length: saved 40, now 48", "epoch_length=40, now epoch_length=48"],
            id="epoch_length",
        ),
        pytest.param(
            "condition",
            {"plate0": 3.0},
            ["sampler: saved weights=", "sha256:b40154df1076d8c1"],
            id="condition-weights",
        ),
        pytest.param(
            "condition",
            {"remainder": "drop"},
            ["operations: saved fetch.remainder='pad', now fetch.remainder='drop'"],
            id="remainder",
        ),
        pytest.param(
            "value_bins",
            {"n_bins": 7},
            ["operations: saved output.n_bins=5, now output.n_bins=7"],
            id="n_bins",
        ),
        pytest.param(
            "value_bins",
            {"mlm_probability": 0.5},
            ["operations: saved output.mlm", "=0.25, now output.mlm"],
            id="mlm",
        ),
        pytest.param(
            "rank_value",
            {"length": 9},
            ["operations: saved output.length=7, now output.length=9"],
            id="tokens-length",
        ),
    ],
)
@pytest.mark.parametrize("saved_by", ["5f1fd87", "this-version"])
def test_other_configuration_is_refused_by_name(
    csr_paths, old_paths, helpers, name, change, expected, saved_by
):
    """A state of this version names the field, saved and now; one of 5f1fd87
    is refused first as an older grain_cells's."""
    paths = old_paths if saved_by == "5f1fd87" else csr_paths
    if saved_by == "5f1fd87":
        state = OLD["states"][name]["state"]
        expected = OLDER
    else:
        iterator = iter(PIPELINES[name](paths))
        helpers.take(iterator, 7)
        state = state_of(iterator)
    other = iter(PIPELINES[name](paths, **change))
    with pytest.raises(CheckpointMismatchError) as e:
        set_state(other, state)
    message = str(e.value)
    for text in expected:
        assert text in message, message
    assert "data_source" not in message, message


def test_stamp_is_a_fingerprint_of_the_configuration(csr_paths, helpers):
    *_, loader = helpers.build(csr_paths, **CONFIG)
    stamp = loader.stamp
    assert stamp["sampler"] == {
        "class": "BlockSampler",
        "num_blocks": 59,
        "shuffle": True,
        "seed": 3,
        "num_epochs": 1,
    }
    assert stamp["operations"] == {
        "fetch": {
            "batch_size": 4,
            "fetch_factor": 5,
            "block_size": 5,
            "shuffle": True,
            "seed": 3,
            "remainder": "pad",
            "numeric_obs": "native",
            "condition": None,
        },
        "output": {"class": "CsrOutput", "dtype": "float32"},
        "extra": {},
    }
    # A shard is not part of it.
    *_, sharded = helpers.build(csr_paths, **CONFIG, shard=sharding.ShardOptions(1, 2))
    assert sharded.stamp["sampler"] == stamp["sampler"]


class ReversedSampler:
    """A user's sampler: no `fingerprint()`, so stamped by its repr."""

    def __init__(self, num_blocks: int, tag: str):
        self.num_blocks, self.tag = num_blocks, tag

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, position: int) -> grain.RecordMetadata:
        return grain.RecordMetadata(position, self.num_blocks - 1 - position)

    def __repr__(self) -> str:
        return f"ReversedSampler(tag={self.tag}, shard_index=0, shard_count=1)"


class ScaledOutput:
    """A user's output: no `fingerprint()`, so stamped by its repr."""

    def __init__(self, scale: float):
        self.scale = scale

    def format(self, fetch, rows, batch_size):
        out = grain_cells.CsrOutput().format(fetch, rows, batch_size)
        out["data"] = out["data"] * self.scale
        return out

    def __repr__(self) -> str:
        return f"ScaledOutput(scale={self.scale})"


class FingerprintedSampler(ReversedSampler):
    """A user's sampler with a `fingerprint()` and `epoch_length` of its own."""

    epoch_length = 7

    def fingerprint(self) -> dict:
        return {"class": "FingerprintedSampler"}


def test_only_a_block_stream_is_stamped_by_its_fingerprint(csr_paths):
    """`fingerprint` is a declared member of `BlockStream`, not looked up."""
    source = grain_cells.AnnDataSource(csr_paths, block_size=5)
    ds = grain_cells.cell_dataset(
        source,
        batch_size=4,
        fetch_factor=5,
        sampler=FingerprintedSampler(len(source), "a"),
    )
    assert ds.stamp["sampler"] == "ReversedSampler(tag=a)"
    assert ds.stamp["epoch_length"] == len(source)
    ours = grain_cells.cell_dataset(source, batch_size=4, fetch_factor=5)
    assert ours.stamp["sampler"] == ours.sampler.fingerprint()


def test_user_components_are_stamped_by_repr(csr_paths, helpers):
    source = grain_cells.AnnDataSource(csr_paths, block_size=5)

    def dataset(tag="a", scale=2.0):
        return grain_cells.cell_dataset(
            source,
            batch_size=4,
            fetch_factor=5,
            sampler=ReversedSampler(len(source), tag),
            output=ScaledOutput(scale),
        )

    ds = dataset()
    assert ds.stamp["sampler"] == "ReversedSampler(tag=a)"  # shard left out
    assert ds.stamp["operations"]["output"] == "ScaledOutput(scale=2.0)"
    everything = helpers.run(ds)
    iterator = iter(ds)
    helpers.take(iterator, 6)
    state = state_of(iterator)
    restored = iter(dataset())
    restored.set_state(state)
    same_batches(helpers.take(restored), everything[6:])
    with pytest.raises(
        CheckpointMismatchError, match="sampler: saved tag=a, now tag=b"
    ):
        iter(dataset(tag="b")).set_state(state)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"operations: saved output='ScaledOutput\(scale=2.0\)', now "
        r"output='ScaledOutput\(scale=3.0\)'",
    ):
        iter(dataset(scale=3.0)).set_state(state)


@pytest.mark.parametrize(
    "text, items",
    [
        pytest.param(
            "CsrOutput(dtype=None)",
            {"class": "CsrOutput", "dtype": "None"},
            id="flat",
        ),
        pytest.param(
            "PaddedSparseOutput(width=8, truncate='error', dtype='float16')",
            {
                "class": "PaddedSparseOutput",
                "width": "8",
                "truncate": "'error'",
                "dtype": "'float16'",
            },
            id="quoted",
        ),
        pytest.param(
            "Layer(name='raw', output=DenseOutput(dtype='float32'))",
            {
                "class": "Layer",
                "name": "'raw'",
                "output": "DenseOutput",
                "output.dtype": "'float32'",
            },
            id="nested",
        ),
        pytest.param(
            "Pick(Choice(a=1, b='x, y'), [1, 2], k={'a': (1, 2)})",
            {
                "class": "Pick",
                "Choice": "Choice",
                "Choice.a": "1",
                "Choice.b": "'x, y'",
                "#1": "[1, 2]",
                "k": "{'a': (1, 2)}",
            },
            id="positional-and-brackets",
        ),
        pytest.param("not a call", {"value": "not a call"}, id="no-call"),
    ],
)
def test_repr_texts_are_split_into_named_items(text, items):
    """A user's component stamped by repr: a refusal names the item that
    differs, so its text is split into `name=value` items, nested by dots."""
    assert state_checks._repr_items(text) == items


def test_weights_a_last_bit_apart_are_refused_with_the_fix(csr_paths, helpers):
    """balanced_block_weights changed its last bits once (class x class sums,
    issue 33): a state saved with the old weights is refused, saying to pass
    the saved weights (or start afresh)."""
    iterator = iter(PIPELINES["weighted"](csr_paths, first_weight=1.0))
    helpers.take(iterator, 7)
    state = state_of(iterator)
    apart = float(np.nextafter(1.0, 2.0))  # one last bit
    other = iter(PIPELINES["weighted"](csr_paths, first_weight=apart))
    with pytest.raises(CheckpointMismatchError) as e:
        set_state(other, state)
    message = str(e.value)
    for text in ("sampler: saved weights=", "balanced_block_weights", "np.save"):
        assert text in message, message
    again = iter(PIPELINES["weighted"](csr_paths, first_weight=1.0))
    set_state(again, state)  # the saved weights restore
    helpers.take(again, 2)
