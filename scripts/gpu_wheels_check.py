"""Does a folder of wheels carry every package the GPU run imports that the GPU
machine lacks? Run by scripts/gpu_wheels.sh (after its downloads, or alone with
CHECK_ONLY=1); exit 1 naming what is missing.

    python scripts/gpu_wheels_check.py --machine scripts/gpu_machine_packages.txt \\
        (--wheels DIR | --carried NAME [NAME ...]) [--python-version 3.12]

What is needed: the distributions that the code of a GPU run imports (every
module of src/raydirect, tests/gpu with tests/conftest.py, tests/test_cuda.py,
benchmarks/gpu.py and the benchmark modules they import, found by reading
their imports, local modules followed) and raydirect's own dependencies
(pyproject.toml), with their dependencies in turn (no extras; markers read for
Linux and the GPU machine's Python). A distribution the machine has ends the
walk there; one carried is walked through its wheel's metadata (--wheels) or
this interpreter's installed metadata. Optional imports (NIXL, JAX, vLLM, ...)
are listed, not required. The first GPU run lacked cryptography, cffi and
pycparser: nothing had compared the two lists.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata as md
import re
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEARCH = [ROOT / "src", ROOT / "tests", ROOT / "benchmarks"]  # where local modules live
ENTRIES = [
    ROOT / "src/raydirect",
    ROOT / "tests/gpu",
    ROOT / "tests/conftest.py",
    ROOT / "tests/test_cuda.py",
    ROOT / "benchmarks/gpu.py",
]
# Imported only where installed, each behind a check with a skip or an error naming it.
OPTIONAL = {"nixl", "nixl_cu12", "nixl_cu13", "jax", "jaxlib", "vllm", "transformers", "matplotlib"}
# Import names whose distribution is named otherwise, where this interpreter lacks them.
DISTRIBUTION_OF = {"zmq": "pyzmq", "yaml": "pyyaml", "google": "protobuf"}
# Never carried: the machine's own CUDA stack (gpu_wheels.sh deletes such wheels).
NEVER = {"torch", "triton"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def python_files(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for path in paths:
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []
    return out


def local_module(name: str) -> list[Path]:
    """The files of local module ``name`` (dotted), with its packages' __init__."""
    parts = name.split(".")
    for base in SEARCH:
        found = []
        for i in range(1, len(parts) + 1):
            stem = base.joinpath(*parts[:i])
            if (stem / "__init__.py").exists():
                found.append(stem / "__init__.py")
            elif stem.with_suffix(".py").exists():
                found.append(stem.with_suffix(".py"))
                break
            elif i == 1:
                break
        if found:
            return found
    return []


def imported_modules(entries: list[Path]) -> set[str]:
    """Top-level names of the third-party modules ``entries`` import, local
    modules followed (their files read in turn)."""
    todo, seen, found = python_files(entries), set(), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "__future__":
                    continue
                files = local_module(name)
                if files:
                    todo += files
                else:
                    found.add(top)
    return found


def distributions_of(modules: set[str]) -> tuple[set[str], set[str]]:
    """(required distributions, optional modules) for these import names."""
    installed = md.packages_distributions()
    required, optional = set(), set()
    for module in modules:
        if module in OPTIONAL:
            optional.add(module)
            continue
        dists = installed.get(module) or [DISTRIBUTION_OF.get(module, module)]
        required.update(canonical(d) for d in dists)
    return required, optional


def project_dependencies() -> set[str]:
    """pyproject.toml's [project] dependencies (read by pattern: no tomllib before 3.11)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.MULTILINE | re.DOTALL)
    if block is None:
        raise SystemExit("gpu_wheels_check: no dependencies = [...] in pyproject.toml")
    return {requirement_name(r) for r in re.findall(r'^\s*"([^"]+)"', block.group(1), re.M)}


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"cannot read the requirement {requirement!r}")
    return canonical(match.group(1))


def applies(requirement: str, python_version: str) -> bool:
    """A requirement without extras whose marker holds on Linux CPython here."""
    if ";" not in requirement:
        return True
    marker = requirement.split(";", 1)[1]
    try:
        from packaging.markers import Marker
    except ImportError:  # no packaging: only extras are told apart
        return "extra" not in marker
    env = {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "extra": "",
    }
    return bool(Marker(marker).evaluate(env))


def wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    prefix = "Requires-Dist:"
    return [line[len(prefix) :].strip() for line in text.splitlines() if line.startswith(prefix)]


def requirements_of(dist: str, wheels: dict[str, Path]) -> list[str] | None:
    if dist in wheels:
        return wheel_requirements(wheels[dist])
    try:
        return md.requires(dist) or []
    except md.PackageNotFoundError:
        return None


def missing(
    needed: set[str], machine: set[str], carried: set[str], wheels: dict[str, Path], pyver: str
) -> tuple[list[str], list[str]]:
    """(distributions neither on the machine nor carried, each with what needs it;
    carried ones whose own needs could not be read here)."""
    lacking, unread, seen = [], [], set()
    todo = [(d, "the GPU run") for d in sorted(needed)]
    while todo:
        dist, why = todo.pop(0)
        if dist in seen or dist in NEVER or dist == "raydirect":
            continue
        seen.add(dist)
        if dist in machine:
            continue  # the machine's packages bring their own dependencies
        if dist not in carried:  # missing; what it needs in turn is reported too
            lacking.append(f"{dist} (needed by {why})")
        reqs = requirements_of(dist, wheels)
        if reqs is None:
            unread.append(dist)
            continue
        todo += [(requirement_name(r), dist) for r in reqs if applies(r, pyver)]
    return lacking, unread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--machine", type=Path, required=True, help="the machine's packages")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--wheels", type=Path, help="the folder of wheels to check")
    group.add_argument("--carried", nargs="+", help="the distributions that will be carried")
    parser.add_argument("--python-version", default="3.12")
    args = parser.parse_args(argv)
    lines = args.machine.read_text().splitlines()
    machine = {canonical(n) for n in (x.strip() for x in lines) if n and not n.startswith("#")}
    wheels: dict[str, Path] = {}
    if args.wheels is not None:
        for wheel in sorted(args.wheels.glob("*.whl")):
            wheels[canonical(wheel.name.split("-")[0])] = wheel
        carried = set(wheels)
    else:
        carried = {requirement_name(c) for c in args.carried}
    modules = imported_modules(ENTRIES)
    required, optional = distributions_of(modules)
    needed = required | project_dependencies() | {"pytest", "pytest-timeout"}
    lacking, unread = missing(needed, machine, carried, wheels, args.python_version)
    extra = sorted(needed - machine - NEVER - {"raydirect"})
    print(f"gpu_wheels_check: the run needs beyond the machine's packages: {', '.join(extra)}")
    print(f"gpu_wheels_check: optional, carried apart or skipped: {', '.join(sorted(optional))}")
    for dist in unread:
        print(f"gpu_wheels_check: warning: cannot read what {dist} needs (not installed here)")
    if lacking:
        print(
            "gpu_wheels_check: MISSING from the wheels, and the GPU machine lacks them: "
            + "; ".join(lacking)
            + ". Add them to the SET=device list in scripts/gpu_wheels.sh.",
            file=sys.stderr,
        )
        return 1
    print(f"gpu_wheels_check: ok, {len(carried)} carried cover what the machine lacks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
