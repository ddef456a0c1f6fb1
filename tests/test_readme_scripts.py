"""The guides' code, pasted into scripts and run as a new user runs them.

tests/test_docs_snippets.py runs every block as written; here the blocks are
changed a little (the loop body prints row ids, a checkpoint is saved after a
few steps) so that the tests can check which cells came back.

Each script runs as `python <script>` in a new process (spawned workers
re-import it, orbax must finish writing before it exits; forked from one
that imported the libraries once: tests/forked_runs.py), over small files
written by anndata whose values encode their row.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
import time

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {"plate1.h5ad": 150, "plate2.h5ad": 90}
GENES = [f"g{j}" for j in range(12)]


def doc_blocks(page: str, heading: str) -> list[str]:
    """The ```python blocks under `heading` (up to the next heading) in `page`."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    lines = text[text.index(heading + "\n") + len(heading) :].splitlines()
    depth, fenced, section = heading.count("#"), False, []
    for line in lines:
        fenced ^= line.startswith("```")
        if not fenced and re.match(rf"#{{1,{depth}}} ", line):
            break  # the next heading of this level or above, outside code
        section.append(line)
    return re.findall(r"```python\n(.*?)```", "\n".join(section), re.S)


LOADING = os.path.join("docs", "guides", "loading.md")
CHECKPOINTS = os.path.join("docs", "guides", "checkpoints.md")


def write_plates(folder) -> None:
    """plate1/plate2.h5ad with obs cell_line and drug; X[i, j] = i * 100 + j + 1."""
    offset = 0
    for name, n in SIZES.items():
        rows = np.arange(offset, offset + n)
        x = (rows[:, None] * 100 + np.arange(len(GENES)) + 1).astype(np.float32)
        x[rows % 3 == 0, ::2] = 0
        obs = pd.DataFrame(
            {
                "cell_line": pd.Categorical([f"line{r % 4}" for r in rows]),
                "drug": pd.Categorical([f"drug{r % 3}" for r in rows]),
            },
            index=[f"cell{r}" for r in rows],
        )
        adata = anndata.AnnData(
            sp.csr_matrix(x), obs=obs, var=pd.DataFrame(index=GENES)
        )
        adata.write_h5ad(folder / name)
        offset += n


@pytest.fixture(scope="module", autouse=True)
def _forked(forked_runs):
    global _runs
    _runs = forked_runs
    yield
    _runs = None


_runs = None


def run_script(folder, name: str, code: str, timeout: float = 240):
    """Runs `code` as `folder/name` with this checkout importable."""
    path = folder / name
    path.write_text(code)
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    start = time.monotonic()
    done = _runs.run([str(path)], cwd=folder, env=env, timeout=timeout)
    return done, time.monotonic() - start


def use_script(*, guarded: bool) -> str:
    """Loading's "A loader, part by part", with 2 workers; the loop prints rows."""
    code = doc_blocks(LOADING, "## A loader, part by part")[0]
    for needed in ("num_epochs=1", "worker_count=2", "        ...\n"):
        assert needed in code, f"Loading's 'A loader' no longer has {needed!r}"
    code = code.replace(
        "        ...\n", '        print("ROWS", *batch["row_ids"][batch["mask"]])\n'
    )
    if not guarded:
        code = re.sub(r'if __name__ == "__main__":.*\n\s+main\(\)', "main()", code)
        assert "__main__" not in code
    return code


@pytest.mark.slow
def test_loading_guide_loader_runs_as_a_script(tmp_path):
    write_plates(tmp_path)
    done, _ = run_script(tmp_path, "use.py", use_script(guarded=True))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        int(r)
        for line in done.stdout.splitlines()
        if line.startswith("ROWS")
        for r in line.split()[1:]
    ]
    assert sorted(rows) == list(range(sum(SIZES.values())))


def test_unguarded_script_fails_at_once_with_one_error(tmp_path):
    write_plates(tmp_path)
    done, seconds = run_script(tmp_path, "use.py", use_script(guarded=False))
    assert done.returncode != 0
    assert "MainGuardError" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
    assert "use.py (line" in done.stderr
    assert done.stderr.count("Traceback") == 1, done.stderr
    assert len(done.stderr.splitlines()) < 40, done.stderr
    assert seconds < 60


UNGUARDED_DATASET = """
import grain_cells

source = grain_cells.AnnDataSource(["plate1.h5ad", "plate2.h5ad"], block_size=10)
ds = grain_cells.cell_dataset(source, batch_size=10, worker_count=2)
for batch in ds:
    print("ROWS", *batch["row_ids"][batch["mask"]])
"""


def test_unguarded_cell_dataset_with_workers_fails_at_once(tmp_path):
    # It used to end after 12-28 s in multiprocessing's bootstrapping
    # tracebacks ("can only join a started process").
    write_plates(tmp_path)
    done, seconds = run_script(tmp_path, "ds.py", UNGUARDED_DATASET)
    assert done.returncode != 0
    assert "MainGuardError" in done.stderr
    assert "ds.py (line" in done.stderr
    assert done.stderr.count("Traceback") == 1, done.stderr
    assert "ROWS" not in done.stdout
    assert seconds < 60


AFTER = """
rows = [next(iterator)["row_ids"].tolist() for _ in range(5)]
print("RESULT", json.dumps({"rows": rows, "w": np.asarray(train_state["w"]).tolist()}))
"""


def result(done) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow
def test_checkpoint_guide_saves_and_restores_in_a_new_process(tmp_path):
    write_plates(tmp_path)
    setup, save, restore = doc_blocks(CHECKPOINTS, "## Save and restore")
    zeros = 'train_state = {"w": np.zeros(4)}'
    assert zeros in setup and zeros in restore
    # Saved after a few steps, with a state of other values than the restore's.
    setup = setup.replace(zeros, 'train_state = {"w": np.arange(4.0) * 7}')
    first = "iterator = iter(loader)\n"
    assert save.count(first) == 1
    save = save.replace(first, first + "for _ in range(step):\n    next(iterator)\n")
    done, _ = run_script(tmp_path, "save.py", "import json\n" + setup + save + AFTER)
    saved = result(done)
    done, _ = run_script(tmp_path, "restore.py", "import json\n" + restore + AFTER)
    restored = result(done)
    assert restored == saved
    assert saved["w"] == [0.0, 7.0, 14.0, 21.0]


@pytest.mark.slow
def test_plain_grain_dataloader_with_workers_and_unparsed_flags(tmp_path):
    """Loading: "The plain grain.DataLoader works too", in a program that never
    parsed absl flags; with the recommended `worker_buffer_size=fetch_factor`
    it yields the same minibatches in the same order."""
    write_plates(tmp_path)
    code = textwrap.dedent(
        """
        import grain
        import grain_cells
        from absl import flags

        def main():
            assert not flags.FLAGS.is_parsed()
            source = grain_cells.AnnDataSource(
                ["plate1.h5ad", "plate2.h5ad"], block_size=8)
            for buffer in (1, 16):  # Grain's default; the fetch factor
                loader = grain.DataLoader(
                    data_source=source,
                    sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=1),
                    operations=grain_cells.fetch_operations(source, batch_size=16),
                    worker_count=2,
                    worker_buffer_size=buffer,
                    read_options=grain_cells.pipeline.READ_OPTIONS,
                )
                for batch in loader:
                    x = batch["data"].reshape(-1)
                    ids = batch["row_ids"][batch["mask"]]
                    # every stored value of row r lies in (r * 100, r * 100 + 13)
                    rows = np.repeat(ids, np.diff(batch["indptr"])[: ids.size])
                    assert ((x > rows * 100) & (x < rows * 100 + 13)).all()
                    print("ROWS", buffer, *ids)

        import numpy as np

        if __name__ == "__main__":
            main()
        """
    )
    done, _ = run_script(tmp_path, "plain.py", code)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {1: [], 16: []}
    for line in done.stdout.splitlines():
        if line.startswith("ROWS"):
            buffer, *ids = map(int, line.split()[1:])
            rows[buffer].append(ids)
    assert sorted(r for ids in rows[1] for r in ids) == list(range(sum(SIZES.values())))
    assert rows[16] == rows[1]
