"""The docs site builds with warnings as errors (mkdocs.yml: `strict: true`).

Strict covers broken links and anchors between pages, pages missing from the
nav, and the API reference: mkdocstrings renders `grain_cells.__all__` and
the public sub-packages from their docstrings through griffe, whose warnings
(a parameter documented that the signature lacks, a malformed section) fail
the build too.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

import grain_cells

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_PAGES = ["grain_cells", "errors", "tokens", "checkpoint", "synthetic"]


def test_docs_site_builds_strict(tmp_path):
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.skip(f"{module} is not installed: pip install -e '.[docs]'")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    assert "WARNING" not in done.stderr, done.stderr[-5000:]
    # Every public name has its entry, generated from its docstring (names
    # imported on first use get theirs under a heading of their public name).
    page = (site / "api" / "grain_cells" / "index.html").read_text()
    headings = set(re.findall(r'<h[23] id="([^"]+)"', page))
    headings |= set(
        re.findall(r'<h[23] id="[^"]+" class="doc doc-heading">\s*(\S+)', page)
    )
    missing = [n for n in grain_cells.__all__ if f"grain_cells.{n}" not in headings]
    assert not missing, f"add them to docs/api/grain_cells.md: {missing}"
    for name in API_PAGES:
        assert (site / "api" / name / "index.html").is_file()


def test_every_docs_page_is_in_the_nav():
    import yaml

    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)

    def pages(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            if isinstance(value, list):
                yield from pages(value)
            else:
                yield value

    in_nav = set(pages(config["nav"]))
    on_disk = {
        os.path.relpath(os.path.join(d, f), os.path.join(ROOT, "docs"))
        for d, _, files in os.walk(os.path.join(ROOT, "docs"))
        for f in files
        if f.endswith(".md")
    }
    assert in_nav == on_disk


def test_readme_fits_on_a_screen_and_links_into_the_docs():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert len(text.splitlines()) <= 250
    for page in (
        "guides/loading.md",
        "guides/checkpoints.md",
        "reference/bad-input.md",
    ):
        assert f"docs/{page}" in text
        assert os.path.isfile(os.path.join(ROOT, "docs", page))


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    command = "python -m pytest -q -p no:cacheprovider"
    assert f'pip install -e ".[test]" && {command}\n' in readme
    assert ci.count(f"\n{command}\n") == 2


def _doc_texts():
    """(name, text) of every docs page, BUILD.md and README.md (not the
    CHANGELOG, whose entries name what was moved or removed).
    """
    names = ["BUILD.md", "README.md"] + [
        os.path.relpath(os.path.join(d, f), ROOT)
        for d, _, files in os.walk(os.path.join(ROOT, "docs"))
        for f in files
        if f.endswith(".md")
    ]
    for name in names:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            yield name, f.read()


def test_names_and_modules_the_docs_cite_exist():
    """A dotted `grain_cells.x.y` name resolves (module, then attributes) and
    a `grain_cells/....py` path is a file: notes that cite moved code rot.
    """
    stale = []
    for name, text in _doc_texts():
        for dotted in set(re.findall(r"`(grain_cells(?:\.\w+)+)", text)):
            parts = dotted.split(".")
            for k in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:k]))
                    break
                except ImportError:  # an attribute of the module above
                    continue
            for attr in parts[k:]:
                obj = getattr(obj, attr, None)
            if obj is None:
                stale.append(f"{name}: {dotted}")
        for path in set(re.findall(r"grain_cells/[\w/]+\.py", text)):
            if not os.path.exists(os.path.join(ROOT, path)):
                stale.append(f"{name}: {path}")
    assert not stale, "docs cite what does not exist:\n" + "\n".join(sorted(stale))
