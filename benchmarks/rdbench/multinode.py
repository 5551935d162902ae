"""Workloads 15 and 16: tensors across real nodes, Ray nodes in network namespaces.

The cluster is the one of ``tests/multinode`` (``mn_harness``: each node in its
own network namespace on one bridge, 10.77.0.1-3, every link counted; needs
root, ``ip`` and a free set of namespace names). This process starts it, runs
``rdbench/cross_node.py`` as a driver inside the head's namespace, answers the
driver's questions about node B's link counter, converts the driver's timings
into rows and tears the cluster down. Where the harness cannot run, every row
says why and is skipped. Neither workload runs unless named in ``--workloads``:
starting a cluster takes over the harness's namespaces, which a test run on the
same machine may be using.

- **15, two nodes**: one tensor from an actor on node B to an actor on node A at
  each of ``--node-sizes``; raydirect ``tcp`` (one stream; its default streams;
  encrypted in TLS frames; in TLS records in user space), raydirect ``gloo``,
  Ray's object store and Ray's RDT over gloo (its workers get
  ``GLOO_SOCKET_IFNAME=rdveth``; raydirect's do not), and ``iperf3`` over the
  same link (one stream, ``-n`` bytes), the wire's own rate.
- **16, fan-out**: one tensor of ``--state-size`` from node B to four consumers,
  two on node A and two on node C: ``rd.broadcast`` (one read per node, relayed
  within it), every consumer reading node B directly over ``tcp``, Ray's object
  store, Ray's RDT over gloo, and weight sync (a trainer on node B publishes a
  model of that size, four workers load half of it each); with the copies of
  the tensor node B sent on its link.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rdbench.common import (
    GB,
    OBJECT_STORE,
    RDT_GLOO,
    Row,
    describe_error,
    format_size,
    log,
)
from rdbench.fleet import Context

TESTS = Path(__file__).resolve().parents[2] / "tests" / "multinode"
sys.path.insert(0, str(TESTS))
import mn_harness as harness  # noqa: E402  (stdlib and raydirect: importing it starts nothing)

DRIVER = Path(__file__).resolve().with_name("cross_node.py")
IPERF = "iperf3 (1 stream)"
DIRECT = "raydirect direct (tcp)"
COPIES = "copies node B sent"
BASELINES_15 = (IPERF, OBJECT_STORE, RDT_GLOO)
BASELINES_16 = (DIRECT, OBJECT_STORE, RDT_GLOO)
IPERF_PORT = 5201
RUN_TIMEOUT_S = 1500.0  # a whole scenario


def two_nodes(ctx: Context) -> list[Row]:
    """Workload 15 (the module's docstring)."""
    cfg = ctx.config
    sizes = cfg.node_sizes
    missing = _missing() or (
        None if shutil.which("iperf3") else "iperf3 is missing: apt install iperf3"
    )
    if missing:
        return [_skipped(15, s, missing) for s in (IPERF, "raydirect tcp")]
    repeats = cfg.repeats(max(sizes))
    with harness.started(object_store_bytes=max(sizes) * 4 + (256 << 20)) as cluster:
        rows = [_iperf_row(n, repeats) for n in sizes]
        result = _drive(cluster, "two-nodes", sizes, repeats)
    log(
        f"w15: nodes {result.get('nodes')}, raydirect's consumer received by transport "
        f"{result.get('received')}"
    )
    return rows + [_row(15, r) for r in result["rows"]]


def fan_out(ctx: Context) -> list[Row]:
    """Workload 16 (the module's docstring)."""
    cfg = ctx.config
    missing = _missing()
    if missing:
        return [_skipped(16, s, missing) for s in ("raydirect broadcast", DIRECT)]
    size = cfg.state_bytes
    with harness.started(object_store_bytes=size * 4 + (256 << 20), workers=2) as cluster:
        result = _drive(cluster, "fan-out", [size], cfg.repeats(size))
    return [_row(16, r) for r in result["rows"]]


def _missing() -> str | None:
    reason = harness.unavailable_reason()
    return f"needs the multi-node harness (root, network namespaces): {reason}" if reason else None


def _skipped(workload: int, system: str, reason: str) -> Row:
    row = Row(workload, system, "-", 0, 0)
    row.skipped = reason
    return row


def _drive(cluster: Any, scenario: str, sizes: list[int], repeats: int) -> dict:
    """Run ``cross_node.py`` inside the head's namespace to its result, answering
    its questions about node B's link counter on the way."""
    log(f"{scenario}: nodes up, driver starting")
    driver = cluster.start_driver(
        DRIVER, scenario, ",".join(map(str, sizes)), str(repeats)
    )  # fmt: skip
    try:
        while True:
            message = driver.expect(("link?", "result"), timeout=RUN_TIMEOUT_S)
            if message["event"] == "result":
                return message
            driver.send(str(harness.link_bytes(harness.NS_WORKER)["tx"]))
    finally:
        driver.close()
        log(driver.stderr_tail(2000))


def _row(workload: int, result: dict[str, Any]) -> Row:
    """The driver's timings of one system at one size, as a row."""
    nbytes = int(result["nbytes"])
    delivered = int(result.get("delivered", nbytes * (4 if workload == 16 else 1)))
    row = Row(workload, result["system"], format_size(nbytes), nbytes, delivered)
    row.cold_s, row.times_s = result.get("cold_s"), list(result["times_s"])
    row.error = result.get("error")
    if result["sent"]:
        row.measured[COPIES] = statistics.median(result["sent"]) / nbytes
        row.samples[COPIES] = [s / nbytes for s in result["sent"]]
    return row


def _iperf_row(nbytes: int, repeats: int) -> Row:
    """iperf3 from node B to node A over the same link, ``-n nbytes``, as a row."""
    row = Row(15, IPERF, format_size(nbytes), nbytes, nbytes)
    try:
        rates = [_iperf(["-n", str(nbytes)]) for _ in range(repeats + 1)]
    except Exception as exc:
        row.error = describe_error(exc)
        return row
    row.cold_s, *rest = (nbytes / (rate * GB) for rate in rates)
    row.times_s = list(rest)
    return row


def _iperf(args: list[str]) -> float:
    """GB/s one iperf3 client run from node B received on node A."""
    server = subprocess.Popen(
        ["ip", "netns", "exec", harness.NS_HEAD, "iperf3", "-s", "-1", "-B", harness.ADDR_HEAD,
         "-p", str(IPERF_PORT)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = ["ip", "netns", "exec", harness.NS_WORKER, "iperf3", "-J", "-c", harness.ADDR_HEAD]
    try:
        for _ in _attempts(50):  # the server needs a moment to listen
            proc = subprocess.run(
                [*client, "-p", str(IPERF_PORT), *args], capture_output=True, text=True, timeout=120
            )
            report = json.loads(proc.stdout or "{}")
            if proc.returncode == 0 and "sum_received" in report.get("end", {}):
                return float(report["end"]["sum_received"]["bits_per_second"]) / 8 / GB
        raise RuntimeError(f"iperf3 failed: {proc.stdout[-500:]} {proc.stderr[-500:]}")
    finally:
        server.kill()
        server.wait(timeout=30)


def _attempts(count: int) -> Iterator[int]:
    for i in range(count):
        yield i
        time.sleep(0.1)


def node_targets(rows: Sequence[Row]) -> str:
    """Workload 16's copies: what node B sent over its link per system, in
    copies of the tensor (a fan-out that reads once per node sends two)."""
    lines = [
        f"| {r.system} | {r.param} | {r.measured[COPIES]:.2f} |"
        for r in rows
        if COPIES in r.measured
    ]
    if not lines:
        return ""
    return "\n".join([f"| system | size | {COPIES} (median) |", "|---|---|---:|", *lines])
