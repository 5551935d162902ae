"""The layout rules of docs/architecture.md that import-linter does not check.

``lint-imports`` (in ``./dev test``) checks the layers. These check the rest: a
module under 500 lines, a function under 60, and no raydirect import inside a
function (a deferred import is how an upward import, a cycle, is usually
hidden), the CLI's lazy subcommands aside.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

SRC = Path(__file__).resolve().parents[1] / "src" / "raydirect"
MODULE_LINES = 500
FUNCTION_LINES = 60
LOCAL_IMPORTS_ALLOWED = {"cli.py"}  # subcommands import their module when run
MODULES = sorted(SRC.rglob("*.py"))


def _name(path: Path) -> str:
    return str(path.relative_to(SRC.parent))


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _imports_raydirect(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "raydirect"
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "raydirect" for a in node.names)
    return False


def test_the_package_has_modules():
    assert len(MODULES) > 20  # the glob found the sources: the checks below check something


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_a_module_is_under_500_lines(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines < MODULE_LINES, f"{_name(path)} has {lines} lines: split it by concern"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_a_function_is_under_60_lines(path: Path):
    long = [
        f"{f.name} ({f.end_lineno - f.lineno + 1} lines, line {f.lineno})"  # type: ignore[operator]
        for f in _functions(ast.parse(path.read_text()))
        if f.end_lineno - f.lineno + 1 >= FUNCTION_LINES  # type: ignore[operator]
    ]
    assert not long, f"{_name(path)}: {', '.join(long)}"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_raydirect_import_inside_a_function(path: Path):
    if path.name in LOCAL_IMPORTS_ALLOWED:
        return
    local = [
        f"{f.name} (line {node.lineno})"
        for f in _functions(ast.parse(path.read_text()))
        for node in ast.walk(f)
        if _imports_raydirect(node)
    ]
    assert not local, f"{_name(path)} imports raydirect inside {', '.join(local)}"


def test_the_checks_catch_what_they_look_for(tmp_path: Path):
    # A function with a deferred import and 60 lines: both checks must see it.
    body = "\n".join(["    x = 1"] * 58)
    source = f"def f():\n    from raydirect import _ray\n{body}\n"
    (f,) = _functions(ast.parse(source))
    assert f.end_lineno - f.lineno + 1 == FUNCTION_LINES  # type: ignore[operator]
    assert any(_imports_raydirect(n) for n in ast.walk(f))


def test_the_vllm_integration_is_kept_to_the_public_api():
    """The import-linter contract that keeps raydirect.vllm a client must name every
    private module: one added later and left out would be open to it."""
    config = tomllib.loads((SRC.parent.parent / "pyproject.toml").read_text())
    contract = next(
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c.get("source_modules") == ["raydirect.vllm"]
    )
    private = {f"raydirect.{p.stem}" for p in SRC.glob("_*.py") if p.stem != "__init__"}
    private |= {"raydirect.transports", "raydirect.cli", "raydirect.testing", "raydirect.errors"}
    missing = private - set(contract["forbidden_modules"])
    assert not missing, f"add {sorted(missing)} to the contract's forbidden_modules"
