"""The GPU recipe's checks, on the CPU: the wheels of ``SET=device`` carry every
package the GPU run imports that the workplace's GPU machine lacks (the first
run lacked cryptography, cffi and pycparser), checked offline (CHECK_ONLY=1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = [sys.executable, str(ROOT / "scripts/gpu_wheels_check.py")]
MACHINE = ["--machine", str(ROOT / "scripts/gpu_machine_packages.txt")]


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, capture_output=True, text=True, timeout=120, env={**os.environ, **env}, check=False
    )


def test_the_device_set_covers_what_the_gpu_machine_lacks():
    done = _run(
        ["bash", str(ROOT / "scripts/gpu_wheels.sh")],
        CHECK_ONLY="1",
        SET="device",
        PYTHON=sys.executable,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok," in done.stdout and "cryptography" in done.stdout


def test_the_check_names_each_missing_package_and_what_needs_it():
    carried = ["ray", "pyzmq", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py"]
    done = _run([*CHECK, *MACHINE, "--carried", *carried])
    assert done.returncode == 1, done.stdout + done.stderr
    for line in ("cryptography (needed by", "cffi (needed by cryptography)", "pycparser (needed"):
        assert line in done.stderr, done.stderr


def test_the_imports_of_the_gpu_run_are_read_through_local_modules():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_wheels_check as check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    modules = check.imported_modules(check.ENTRIES)
    # raydirect's own, the benchmark's (through rdbench) and the tests' (through conftest)
    assert {"torch", "ray", "zmq", "cryptography", "numpy", "pytest"} <= modules
    assert not {"raydirect", "rdbench", "helpers", "actors"} & modules
