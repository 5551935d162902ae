"""The command line: status against a running cluster, and the demo end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import ray

from actors import Producer

CLI = [sys.executable, "-m", "raydirect.cli"]


def test_status_lists_holders(ray_session):
    p = Producer.remote()
    ref = p.keep.remote("status", 2500)
    ray.wait([ref])
    pid = ray.get(p.pid.remote())
    address = ray.get_runtime_context().gcs_address
    out = subprocess.run(
        [*CLI, "status", "--address", address, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rows = json.loads(out)
    mine = [r for r in rows if r["pid"] == pid]
    assert mine and mine[0]["reachable"]
    assert mine[0]["stats"]["num_objects"] == 1 and mine[0]["stats"]["num_bytes"] == 10000
    table = subprocess.run(
        [*CLI, "status", "--address", address],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert re.search(rf"Producer.*\s{pid}\s+1\s+9.8 KiB", table), table
    del ref
    ray.kill(p)


def test_demo_runs_and_prints_a_checked_table():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    done = subprocess.run(
        [*CLI, "demo", "--quick"], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"^\s*(\d+) MiB\s+(.+?)\s+([\d.]+)\s+([\d.]+)x$", done.stdout, re.M)
    systems = {name.strip() for _, name, _, _ in rows}
    assert {"auto", "cma", "shm", "tcp", "ray object store"} <= systems
    assert all(float(rate) > 0 for _, _, rate, _ in rows)
    assert "Next:" in done.stdout
