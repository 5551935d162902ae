"""The command line (status against a running cluster, the demo end to end) and the
Ray metrics behind the dashboard."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from typing import Any

import ray

from raydirect._status import collect

from actors import Consumer, Producer
from helpers import wait_for

CLI = [sys.executable, "-m", "raydirect.cli"]


def _worker(actor: Any) -> dict[str, Any]:
    """Where an actor runs, through Ray's public runtime context."""

    def where(self: Any) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "worker_id": ctx.get_worker_id(), "node_id": ctx.get_node_id()}

    return dict(ray.get(actor.__ray_call__.remote(where)))


def _row(pid: int) -> dict[str, Any] | None:
    rows = [r for r in collect().processes if r["pid"] == pid and r["reachable"]]
    return rows[0] if rows else None


def test_status_shows_holders_per_transport_and_transfer_counters(ray_session):
    p, c = Producer.remote(), Consumer.remote()
    kept = p.keep.remote("status", 25_000)  # auto, 100,000 bytes, stays held
    over_tcp = p.value_tcp.remote("dtypes")  # stays held too
    assert ray.get(c.check.remote("dtypes", over_tcp)) is None
    pid, cpid = _worker(p)["pid"], _worker(c)["pid"]
    # The producer counts a send once its agent has served it, and a process that only
    # received announces itself from a background thread: both land shortly after.
    wait_for(
        lambda: (_row(pid) or {}).get("stats", {}).get("objects_sent", {}).get("tcp"),
        timeout=60,
        what="the producer's tcp send to be counted",
    )
    wait_for(lambda: _row(cpid), timeout=60, what="the consumer to be listed")
    address = ray.get_runtime_context().gcs_address
    out = subprocess.run(
        [*CLI, "status", "--address", address, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    status = json.loads(out)
    assert pid not in {r["pid"] for r in status["pruned"]}  # stale announcements, withdrawn
    mine = [r for r in status["processes"] if r["pid"] == pid]
    assert mine and mine[0]["reachable"] and "Producer" in mine[0]["label"]
    held = mine[0]["stats"]
    assert held["num_objects"] == 2
    assert held["objects_held"] == {"auto": 1, "tcp": 1}
    assert held["bytes_held"]["auto"] == 100_000
    assert held["num_bytes"] == 100_000 + held["bytes_held"]["tcp"]
    assert (
        held["objects_sent"]["tcp"] == 1 and held["bytes_sent"]["tcp"] == held["bytes_held"]["tcp"]
    )
    assert held["encryption"] == "none"  # this session runs without Ray's TLS
    theirs = [r for r in status["processes"] if r["pid"] == cpid]
    assert theirs and "Consumer" in theirs[0]["label"]
    got = theirs[0]["stats"]
    assert got["num_objects"] == 0
    assert got["objects_received"] == {"tcp": 1}
    assert got["bytes_received"] == {"tcp": held["bytes_held"]["tcp"]}
    assert status["transports"]["tcp"]["objects_received"] >= 1
    assert status["transports"]["auto"]["objects_held"] >= 1

    table = subprocess.run(
        [*CLI, "status", "--address", address],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert re.search(rf"Producer.*\s{pid}\s+2\s+\S+ KiB\s+none$", table, re.M), table
    assert re.search(r"^\s+auto\s+1 / 97.7 KiB\s+-", table, re.M), table
    assert re.search(r"^\s+tcp\s+1 / \S+ \S+\s+1 / \S+ \S+\s+-", table, re.M), table
    assert re.search(r"^\s+tcp\s+-\s+-\s+1 / ", table, re.M), table  # the consumer's line
    del kept, over_tcp
    ray.kill(p)
    ray.kill(c)


_SAMPLE = re.compile(r"^(ray_raydirect_\w+)\{(.*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _scrape(node_id: str) -> dict[tuple[str, str, str], float]:
    """raydirect's samples from the Prometheus endpoint of Ray's metrics agent on
    ``node_id``: (metric, WorkerId, transport) -> value."""
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            text = answer.read().decode()
    except OSError:  # the agent may not listen yet: poll again
        return {}
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            labels = dict(_LABEL.findall(match.group(2)))
            key = (match.group(1), labels.get("WorkerId", ""), labels.get("transport", ""))
            samples[key] = float(match.group(3))
    return samples


def test_counters_reach_rays_metrics_endpoint(ray_session):
    p, c = Producer.remote(), Consumer.remote()
    kept = p.keep.remote("metrics", 25_000)  # auto, 100,000 bytes
    assert ray.get(c.check.remote("large", p.value.remote("large"))) is None  # one transfer
    producer, consumer = _worker(p), _worker(c)
    pw, cw = producer["worker_id"], consumer["worker_id"]

    last: list[dict[tuple[str, str, str], float]] = [{}]

    def exported() -> dict[tuple[str, str, str], float] | None:
        samples = last[0] = _scrape(producer["node_id"])
        ok = (
            samples.get(("ray_raydirect_objects_held", pw, "auto")) == 1
            and samples.get(("ray_raydirect_bytes_held", pw, "auto")) == 100_000
            and any(k[0] == "ray_raydirect_objects_sent_total" and k[1] == pw for k in samples)
            and any(k[0] == "ray_raydirect_bytes_received_total" and k[1] == cw for k in samples)
        )
        return samples if ok else None

    # Exported every few seconds, reported by the worker to its node's metrics
    # agent every few more: poll.
    try:
        samples = wait_for(exported, timeout=120, what="raydirect metrics on the node's endpoint")
    except AssertionError as e:
        seen = sorted(k for k in last[0] if k[1] in (pw, cw))
        raise AssertionError(f"{e}; producer {pw}, consumer {cw}; theirs there: {seen}") from e
    assert isinstance(samples, dict)
    sent = {
        k[2]: v for k, v in samples.items() if k[:2] == ("ray_raydirect_objects_sent_total", pw)
    }
    received = {
        k[2]: v for k, v in samples.items() if k[:2] == ("ray_raydirect_objects_received_total", cw)
    }
    assert sent == received and sum(received.values()) == 1, (sent, received)
    assert set(received) <= {"cma", "shm"}  # same node: auto reads memory, not tcp

    del kept  # the gauge must come back to 0, not keep the last value
    wait_for(
        lambda: _scrape(producer["node_id"]).get(("ray_raydirect_objects_held", pw, "auto")) == 0,
        timeout=120,
        what="raydirect_objects_held to drop to 0",
    )
    ray.kill(p)
    ray.kill(c)


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


def test_status_of_an_address_where_no_cluster_listens_says_so_at_once():
    """Ray's own attempt at a closed port retried for more than ten minutes."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening
        run = subprocess.run(
            [*CLI, "status", "--address", address], capture_output=True, text=True, timeout=120
        )
    assert run.returncode == 2, run.stderr
    assert f"no Ray cluster at '{address}'" in run.stderr and "--address HOST:PORT" in run.stderr
    assert "Traceback" not in run.stderr
