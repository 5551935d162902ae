"""`raydirect bench`: every workload runs end to end and reports JSON (no timing checks)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

CLI = [sys.executable, "-m", "raydirect.cli"]
WORKLOADS = {1, 2, 3, 4, 5, 6}


def test_bench_quick_json_has_rows_for_every_workload(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    tiny = [
        "--quick",
        "--workloads", ",".join(map(str, sorted(WORKLOADS))),
        "--groups", "raydirect,object-store,floors",
        "--sizes", "4KiB",
        "--state-size", "1MiB",
        "--consumers", "1,2",
        "--round-trips", "20",
        "--part-size", "64KiB",
        "--driver-size", "1MiB",
        "--repeats", "1",
    ]  # fmt: skip
    png = tmp_path / "bench.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    done = subprocess.run(
        [*CLI, "bench", *tiny, "--json", str(out), *plot],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {r["workload"] for r in rows} == WORKLOADS
    assert set(report["workloads"]) == {str(w) for w in WORKLOADS}
    for row in rows:
        assert row["error"] is None, row
        if row["skipped"] is None:  # measured: a cold time and one repeat, all checked
            assert row["cold_s"] is not None and len(row["times_s"]) >= 1, row
            assert row["median"] is not None, row
    systems = {(r["workload"], r["system"]) for r in rows if r["skipped"] is None}
    assert (1, "raydirect auto") in systems and (1, "ray object store") in systems
    assert (3, "ray actor call") in systems and (5, "raydirect auto") in systems
    assert (6, "raydirect WeightPublisher, 4-way sharded") in systems
    # the floor of a sharded load: one copy of rank 0's bytes, in one process
    assert (6, "floor: in-process copy, 4-way sharded") in systems
    # progress lines name workload, system and point
    assert "w2 raydirect auto @ 2 consumers" in done.stderr
    # one markdown table per workload on stdout
    for w in WORKLOADS:
        assert f"## {w}. " in done.stdout
    if plot:  # matplotlib is optional (the `bench` extra)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
