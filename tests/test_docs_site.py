"""The README is the door to the docs site (issue 30, item 2): short, its quick start the commands
CI runs, every relative link to a file that exists, every page of ``mkdocs.yml``'s nav on disk.

The site itself is built by ``.ci/run`` (``mkdocs build --strict``: broken links between pages,
docstrings griffe cannot read); these checks need no MkDocs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
MKDOCS = ROOT / "mkdocs.yml"
DOCS = ROOT / "docs"

# a Markdown link or image whose target is not a URL, a mail address or an in-page anchor
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _nav_pages(text: str) -> list[str]:
    """The ``.md`` files named under ``nav:`` in ``mkdocs.yml`` (``- Title: page.md`` or ``- page.md``)."""
    nav = text.split("\nnav:\n", 1)
    assert len(nav) == 2, "mkdocs.yml: no top-level nav:"
    return re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?([\w./-]+\.md)\s*$", nav[1], re.M)


def _quick_start(readme: str) -> str:
    m = re.search(r"^## Quick start\n(.*?)(?=^## )", readme, re.S | re.M)
    assert m, "README.md: no '## Quick start' section"
    return m.group(1)


def test_every_page_of_the_nav_exists_and_every_page_is_in_the_nav():
    text = MKDOCS.read_text()
    assert re.search(r"^strict: true$", text, re.M), "mkdocs.yml: strict: true is missing"
    pages = _nav_pages(text)
    assert len(pages) >= 10 and len(set(pages)) == len(pages), pages
    assert [p for p in pages if not (DOCS / p).is_file()] == []
    assert sorted(p.name for p in DOCS.glob("*.md")) == sorted(pages)
    for required in ("researcher.md", "contract.md", "how-a-run-works.md", "threat-model.md", "operator.md",
                     "fleet.md", "gpu-hosts.md", "manifest.md", "benchmarks.md", "api.md"):
        assert required in pages


def test_the_api_reference_renders_the_public_modules():
    api = (DOCS / "api.md").read_text()
    assert re.findall(r"^::: (\S+)$", api, re.M) == [
        "prism_challenge.api", "prism_challenge.options", "prism_challenge.manifest.results", "prism_challenge.events",
        "prism_challenge.failures"]


def test_the_readme_is_under_300_lines():
    n = len(README.read_text().splitlines())
    assert n < 300, f"README.md has {n} lines; move the detail to docs/"


def test_the_quick_start_holds_the_command_ci_runs():
    ci = CI.read_text().rstrip("\n").splitlines()
    last = ci[-1]
    assert last == "pip install -e '.[test]' && python -m pytest"
    quick = _quick_start(README.read_text())
    fence = re.search(r"```bash\n(.*?)```", quick, re.S)
    assert fence, "README.md: the quick start's fenced commands are missing"
    commands = [ln for ln in fence.group(1).splitlines() if ln and not ln.startswith("#")]
    assert commands == [
        "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && prism eval examples/tiny-1m "
        "--token-budget 20000",
        "python3 -m venv .venv && . .venv/bin/activate && " + last,
    ]
    assert "**Installs by role.**" in quick


def test_ci_builds_the_docs_strict_before_the_tests():
    lines = CI.read_text().rstrip("\n").splitlines()
    build = [i for i, ln in enumerate(lines) if "mkdocs build --strict" in ln]
    assert len(build) == 1 and build[0] < len(lines) - 1
    assert lines[build[0]] == "python -m pip install -q -e '.[docs]' && mkdocs build --strict --site-dir site"


def test_every_relative_link_in_the_readme_names_a_file_that_exists():
    targets = LINK.findall(README.read_text())
    relative = [t for t in targets if not re.match(r"^(?:[a-z][a-z0-9+.-]*:|#)", t)]
    assert len(relative) >= 10, relative  # the links to docs/ are there
    missing = [t for t in relative if not (ROOT / t.split("#", 1)[0]).exists()]
    assert missing == []
    assert {t for t in relative if t.startswith("docs/")} >= {f"docs/{p}" for p in _nav_pages(MKDOCS.read_text())
                                                              if p != "index.md"} | {"docs/index.md"}


STAGES = ("intake", "gates", "data", "evaluator", "audit", "score", "manifest", "research", "service")
"""The package's stages, in the order a run takes them (issue 30: one subpackage per stage)."""


def test_the_package_reads_as_the_pipeline_a_subpackage_per_stage_and_at_most_a_dozen_loose_modules():
    package = ROOT / "src" / "prism_challenge"
    loose = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 12, loose
    assert {"api.py", "options.py"} <= set(loose) and (package / "pipeline" / "__init__.py").is_file()
    for stage in STAGES:
        init = package / stage / "__init__.py"
        assert init.is_file(), stage
        assert ast.get_docstring(ast.parse(init.read_text())), f"{stage}/__init__.py has no docstring"


def test_the_readmes_layout_names_every_module_of_the_package_and_its_stages():
    layout = README.read_text().split("\n## Layout\n", 1)[1]
    package = ROOT / "src" / "prism_challenge"
    folders = (package, *(package / s for s in ("pipeline", "evaluator", "intake", "audit", "score", "manifest",
                                                 "research")))
    modules = [p for d in folders for p in sorted(d.glob("*.py")) if p.name != "__init__.py"]
    assert len(modules) > 60
    where = [layout.find(f"\n  {s}/") for s in STAGES]
    assert -1 not in where and where == sorted(where), dict(zip(STAGES, where))  # every stage, in the run's order
    missing = [str(p.relative_to(package)) for p in modules if not re.search(rf"\b{re.escape(p.name)}\b", layout)]
    assert missing == []
