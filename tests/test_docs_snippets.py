"""Every Python code block of README.md and docs/**/*.md, run as written.

The blocks of one page run in order as one script (later blocks use names
that earlier ones defined), in a new process (forked from one that imported
the libraries once: tests/forked_runs.py), in a folder holding the
files that docs/guides/loading.md's data block writes (run first, as
written) plus `my_atlas.h5ad` for the README's "run it on your file".
An HTML comment on the line before a block changes that:

- `<!-- docs-test: data -->`: the block that writes the guides' files.
- `<!-- docs-test: new process -->`: the block starts a new script (a
  checkpoint restored "in a new process").

A block with `if __name__ == "__main__":` (worker processes, which import
the script again) is a script of its own.
- `<!-- docs-test: skip (reason) -->`: not run, for blocks that need a
  bucket, a GPU or the network. They are counted, so they stay few.

Blocks with another info string (`bash`, `text`) are not run.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(
    ["README.md"]
    + [
        os.path.relpath(p, ROOT)
        for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    ]
)
MARKER = re.compile(
    r"<!-- docs-test: (data|new process|skip \((?P<reason>[^)]+)\)) -->"
)
# Blocks not run (buckets, GPUs, network). Raise only with a reason.
MAX_SKIPPED = 6
DATA_PAGE = os.path.join("docs", "guides", "loading.md")


def blocks(page: str) -> list[tuple[str, str, int]]:
    """(marker or "", code, line) of every ```python block of `page`."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        indent, info = fence.group(1), fence.group(2)
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :])
            i += 1
        i += 1
        if info != "python":
            continue
        before = lines[start - 1].strip() if start else ""
        match = MARKER.fullmatch(before)
        if before.startswith("<!-- docs-test") and not match:
            raise ValueError(f"{page}:{start}: unknown marker {before!r}")
        found.append(
            (match.group(1) if match else "", "\n".join(body) + "\n", start + 1)
        )
    return found


def scripts(page: str) -> list[str]:
    """The scripts a page's blocks make, in order (skipped and data blocks left out)."""
    out: list[list[str]] = [[]]
    for marker, code, line in blocks(page):
        if marker.startswith("skip") or marker == "data":
            continue
        alone = 'if __name__ == "__main__":' in code
        if (marker == "new process" or alone) and out[-1]:
            out.append([])
        out[-1].append(f"# {page}:{line}\n{code}")
        if alone:
            out.append([])
    return ["\n".join(parts) for parts in out if parts]


def test_every_block_is_run_or_skipped_with_a_reason():
    all_blocks = {page: blocks(page) for page in PAGES}
    skipped = [
        (page, line)
        for page, found in all_blocks.items()
        for marker, _, line in found
        if marker.startswith("skip")
    ]
    assert len(skipped) <= MAX_SKIPPED, skipped
    assert sum(len(found) for found in all_blocks.values()) >= 20
    data = [b for b in all_blocks[DATA_PAGE] if b[0] == "data"]
    assert len(data) == 1
    others = [
        p for p, f in all_blocks.items() if p != DATA_PAGE for b in f if b[0] == "data"
    ]
    assert others == []


def run(forked_runs, folder, name: str, code: str) -> subprocess.CompletedProcess:
    """`python <name>` of `code` in `folder`, forked (`forked_runs`)."""
    path = folder / name
    path.write_text(code)
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "JAX_PLATFORMS": "cpu",
        "GRAIN_CELLS_CACHE": str(folder / "cache"),
    }
    return forked_runs.run([str(path)], cwd=folder, env=env, timeout=300)


MY_ATLAS = """
import anndata
adata = anndata.read_h5ad("plate1.h5ad")
adata.obs["cell_type"] = adata.obs["cell_line"]
adata.write_h5ad("my_atlas.h5ad")
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory, forked_runs):
    folder = tmp_path_factory.mktemp("docs_data")
    [code] = [code for marker, code, _ in blocks(DATA_PAGE) if marker == "data"]
    for name, script in [("data.py", code), ("my_atlas.py", MY_ATLAS)]:
        done = run(forked_runs, folder, name, script)
        assert done.returncode == 0, done.stderr[-3000:]
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if scripts(p)])
def test_page_runs_as_written(page, data, tmp_path, forked_runs):
    for path in data.glob("*.h5ad"):
        shutil.copy(path, tmp_path / path.name)
    for i, code in enumerate(scripts(page)):
        done = run(forked_runs, tmp_path, f"snippet_{i}.py", code)
        assert done.returncode == 0, (
            f"{page}, script {i}:\n{code}\n{done.stderr[-4000:]}"
        )


@pytest.mark.slow
def test_readme_run_it_on_your_file_command(data, tmp_path, forked_runs):
    """The README's training command on `my_atlas.h5ad`, shortened to a few steps."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Run it on your file\n") :]
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    argv = command.replace("\\\n", " ").split()
    assert argv[:3] == ["python", "-m", "grain_cells.examples.train"], argv
    shutil.copy(data / "my_atlas.h5ad", tmp_path / "my_atlas.h5ad")
    argv = [
        *argv[3:],
        f"--workdir={tmp_path / 'run'}",  # the last one wins
        "--config.num_steps=20",
        "--config.log_every=10",
        "--config.checkpoint_every=20",
    ]
    done = forked_runs.run(
        ["grain_cells.examples.train", *argv],  # python -m
        module=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "cell_type" in done.stdout + done.stderr
