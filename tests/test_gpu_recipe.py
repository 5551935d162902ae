"""The GPU recipe's checks, on the CPU: the wheels of ``SET=device`` carry every
package the GPU run imports that the workplace's GPU machine lacks (the first
run lacked cryptography, cffi and pycparser), checked offline (CHECK_ONLY=1)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
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


def test_the_repacked_ray_keeps_its_dashboard_build(tmp_path):
    """The device set's Ray drops its Java jars and nothing else: without the
    dashboard build, a plain ``ray.init()`` on the GPU machine waited 60 s for a
    dashboard that could not start (seen in a rehearsal on the CPU)."""
    wheel = tmp_path / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"
    kept = ["ray/__init__.py", "ray/dashboard/client/build/index.html"]
    with zipfile.ZipFile(wheel, "w") as z:
        for name in [*kept, "ray/jars/ray_dist.jar"]:
            z.writestr(name, b"x" * 100)
        record = "".join(f"{n},sha256=x,100\n" for n in [*kept, "ray/jars/ray_dist.jar"])
        z.writestr("ray-2.60.0.dist-info/RECORD", record)
    done = _run([sys.executable, str(ROOT / "scripts/gpu_repack.py"), str(wheel)])
    assert done.returncode == 0, done.stdout + done.stderr
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = z.read("ray-2.60.0.dist-info/RECORD").decode()
    assert set(kept) <= names and "ray/jars/ray_dist.jar" not in names
    assert "ray/dashboard/client/build/index.html" in record and "jars" not in record
