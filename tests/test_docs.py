"""The docs site stays whole: every public name documented, every page reachable.

Cheap checks that need nothing beyond the test extra; the full strict build
(``./dev docs``) runs too where the docs extra is installed.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import raydirect
import raydirect.testing

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API_PAGE = DOCS / "api.md"
TESTING_NAMES = ("TransportConformance", "make_value", "check", "mismatch", "wait_read_counts")


def _nav_pages(entries: Any) -> list[str]:
    pages: list[str] = []
    for entry in entries:
        if isinstance(entry, str):
            pages.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def _config() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "mkdocs.yml").read_text()))


@pytest.mark.parametrize("name", raydirect.__all__)
def test_every_public_name_has_a_docstring(name):
    doc = inspect.getdoc(getattr(raydirect, name))
    assert doc and len(doc) > 20, f"raydirect.{name} needs a docstring: the API page shows it"


@pytest.mark.parametrize("name", TESTING_NAMES)
def test_the_conformance_suite_is_documented(name):
    assert inspect.getdoc(getattr(raydirect.testing, name)), f"raydirect.testing.{name}"


def test_every_public_name_is_on_the_api_page():
    shown = set(re.findall(r"^::: raydirect\.(\w+)\s*$", API_PAGE.read_text(), re.M))
    missing = sorted(set(raydirect.__all__) - shown)
    assert not missing, f"add `::: raydirect.NAME` to docs/api.md for: {missing}"
    assert "testing" in shown


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = _nav_pages(_config()["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(set(pages) - set(nav)) == [], "pages missing from the nav in mkdocs.yml"
    assert sorted(set(nav) - set(pages)) == [], "nav entries without a page in docs/"
    assert len(nav) == len(set(nav)), "a page is in the nav twice"


def test_relative_links_between_pages_resolve():
    # The site is built from docs/ alone: a link out of it breaks on the site.
    broken = []
    for page in DOCS.rglob("*.md"):
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            resolved = (page.parent / target).resolve()
            if not (resolved.is_file() and DOCS.resolve() in resolved.parents):
                broken.append(f"{page.name}: {target}")
    assert not broken, broken


def test_readme_keeps_two_set_up_free_commands_and_points_to_the_docs():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the Two commands section has a bash block"
    commands = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(commands) == 2, commands
    assert "./dev docs" in readme


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="the docs extra is not installed (`./dev docs` installs it)",
)
def test_site_builds_strictly(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "api" / "index.html").is_file()
