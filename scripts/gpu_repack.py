"""Repack a Ray wheel for the GPU machine: without its Java jars (31 of its 75 MiB),
so the wheels scripts/gpu_wheels.sh makes fit one device call (64 MiB).

    python scripts/gpu_repack.py ray-*.whl

The dashboard build stays (2.4 MiB): without it a plain ``ray.init()`` waits 60 s
for a dashboard that cannot start, then logs ``FrontendNotFoundError``. The
wheel's RECORD drops the same entries, so pip installs it cleanly.
"""

from __future__ import annotations

import os
import sys
import zipfile

DROP = ("ray/jars/",)


def repack(path: str) -> tuple[int, int]:
    """Rewrite the wheel at ``path`` in place; its size before and after, in bytes."""
    before = os.path.getsize(path)
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".tmp", "w") as dst:
        for item in src.infolist():
            if item.filename.startswith(DROP):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith(DROP)).encode()
            dst.writestr(item, data)  # keeps each entry's compression and permissions
    os.replace(path + ".tmp", path)
    return before, os.path.getsize(path)


if __name__ == "__main__":
    for wheel in sys.argv[1:]:
        before, after = repack(wheel)
        print(f"  {os.path.basename(wheel)}: {before >> 20} MiB -> {after >> 20} MiB")
