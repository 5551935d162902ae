"""A process whose cluster is gone exits promptly; the announcements it could not
withdraw are pruned by ``raydirect status`` (issue 27, item 3)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray

from raydirect import _process, _ray
from raydirect._status import collect, format_table

from actors import Producer
from helpers import wait_for

DRIVER = Path(__file__).with_name("exit_driver.py")
# raydirect's exit hooks may wait on a GCS that is gone about a second
# (_ray.EXIT_TIMEOUT_S); Ray's GCS client alone would wait 60 s.
HOOKS_BOUND_S = 2.5
# The rest of a process's exit is Ray's and torch's: the actor's graceful core-worker
# shutdown, the driver tearing down the node it started (10-25 s on this shared
# 2-core machine). Well under the 60 s a hook waiting on the GCS would add.
EXIT_BOUND_S = 45.0


def _marks(marks_dir: Path, pid: int) -> dict[str, float]:
    path = marks_dir / str(pid)
    if not path.exists():
        return {}
    return {
        name: float(t)
        for name, t in (line.split() for line in path.read_text().split("\n") if line)
    }


def _hooks_done(marks_dir: Path, pid: int) -> dict[str, float] | None:
    marks = _marks(marks_dir, pid)
    return marks if {"before", "after"} <= set(marks) else None


def _start_driver(marks_dir: Path) -> tuple[subprocess.Popen[str], list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(DRIVER.parent), env.get("PYTHONPATH", "")])
    with open(marks_dir / "driver.log", "w") as log:  # the child keeps its own copy
        proc = subprocess.Popen(
            [sys.executable, str(DRIVER), str(marks_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            start_new_session=True,
        )
    lines: list[str] = []
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: lines.extend(stdout), daemon=True).start()
    return proc, lines


def test_exit_hooks_wait_on_a_gone_cluster_at_most_a_second(tmp_path):
    proc, lines = _start_driver(tmp_path)
    info: dict[str, Any] = {}
    try:
        line = wait_for(
            lambda: (
                next((x for x in lines if x.startswith("@@RD ")), None)
                or (proc.poll() is not None and f"exited with {proc.returncode}")
            ),
            timeout=300,
            what="the driver's cluster, actor and announcements",
        )
        assert str(line).startswith("@@RD "), (tmp_path / "driver.log").read_text()[-3000:]
        info.update(json.loads(str(line)[len("@@RD ") :]))
        os.kill(info["gcs"], signal.SIGKILL)  # the cluster is gone for both processes

        # The actor, ended by a signal (as a raylet ends its workers).
        os.kill(info["actor"], signal.SIGTERM)
        marks = wait_for(
            lambda: _hooks_done(tmp_path, info["actor"]), timeout=30, what="the actor's exit hooks"
        )
        assert marks["after"] - marks["before"] < HOOKS_BOUND_S  # type: ignore[index]
        wait_for(
            lambda: not _process.process_alive(info["actor"], info["actor_start"]),
            timeout=EXIT_BOUND_S,
            what="the actor's process to end",
        )

        # The driver, ending its script normally.
        assert proc.stdin is not None
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        marks = wait_for(
            lambda: _hooks_done(tmp_path, info["driver"]), timeout=30, what="the driver's hooks"
        )
        assert marks["after"] - marks["before"] < HOOKS_BOUND_S  # type: ignore[index]
        assert proc.wait(timeout=EXIT_BOUND_S) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # A Ray worker runs in a session of its own: end the actor by pid if it hangs on.
        if info and _process.process_alive(info["actor"], info["actor_start"]):
            os.kill(info["actor"], signal.SIGKILL)


# ---------------------------------------------------------------- raydirect status


def _announced_pids() -> set[int]:
    return {json.loads(v)["pid"] for v in _ray.published_agents().values()}


def test_status_prunes_the_announcement_of_a_process_that_died(ray_session):
    p = Producer.remote()
    kept = p.keep.remote("exit-status")  # exported: p's agent is announced
    pid = ray.get(p.pid.remote())
    wait_for(lambda: pid in _announced_pids(), timeout=60, what="the producer's announcement")
    os.kill(pid, signal.SIGKILL)  # no exit hook runs: the announcement stays behind
    wait_for(lambda: _process.start_time_of(pid) == 0, what="the producer to die")
    assert pid in _announced_pids()

    status = collect()
    assert pid not in {r["pid"] for r in status.processes}
    [pruned] = [r for r in status.pruned if r["pid"] == pid]
    assert pruned["reason"] in (f"process {pid} exited", "its actor is dead")
    assert pid not in _announced_pids()  # withdrawn: the next status does not meet it
    assert f"{pid}  {pruned['reason']}" in format_table(status)
    assert "stale announcement" in format_table(status)
    assert pid not in {r["pid"] for r in collect().pruned}
    del kept


def test_status_keeps_a_live_process_that_does_not_answer(ray_session):
    """Alive (this very process) but silent: listed as not answering, not withdrawn."""
    silent = socket.create_server((_ray.node_ip(), 0))  # accepts, never speaks ZeroMQ
    key = f"{_ray.node_id()}/silent-{os.getpid()}"
    info = {
        "address": f"tcp://{_ray.node_ip()}:{silent.getsockname()[1]}",
        "pid": os.getpid(),
        "start_time": _process.START_TIME,
        "node_id": _ray.node_id(),
        "actor_id": None,
        "label": "silent",
    }
    _ray.publish_agent(key, json.dumps(info).encode())
    try:
        start = time.monotonic()
        status = collect(timeout=1.0)
        assert time.monotonic() - start < 20
        [row] = [r for r in status.processes if r.get("label") == "silent"]
        assert row["reachable"] is False and row["stats"] is None
        assert key in _ray.published_agents()
        assert "alive, not answering" in format_table(status)
    finally:
        _ray.withdraw_agent(key)
        silent.close()
