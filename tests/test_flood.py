"""The agent under a flood of 1 MiB junk messages at full rate (issue: two local
clients sending junk as fast as they could made a real 1 MiB transfer time out;
then, each unauthenticated message was JSON-decoded on the loop thread, 10-21 ms
each). Runs Ray inside a network namespace with only ``lo``: nothing leaves the
machine."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import loopback
import pytest

DRIVER = Path(__file__).with_name("flood_driver.py")
FLOOD_S = 10.0


@pytest.fixture(scope="module")
def flooded():
    reason = loopback.unavailable_reason()
    if reason:
        pytest.skip(f"flood test skipped: {reason}")
    result = loopback.run(DRIVER, str(FLOOD_S), timeout=900)
    print({k: v for k, v in result.items() if k != "agent"})
    return result


def test_the_flood_stays_on_loopback(flooded):
    assert flooded["agent"]["node_ip"] == "127.0.0.1"
    assert flooded["agent"]["address"].startswith("tcp://127.0.0.1:")


def test_real_transfers_go_on_during_a_junk_flood(flooded):
    """The figure to report is median_during_s / median_before_s (printed); tests
    assert no timings."""
    assert flooded["client_exit_codes"] == [0, 0]
    # Every transfer during the flood arrived exact (the driver checks each one)
    # within its 60 s timeout; there were some, and the agent serves after it.
    assert flooded["transfers_during"] >= 1
    assert flooded["median_after_s"] is not None


def test_no_junk_reaches_the_loop_thread(flooded):
    """Strangers are refused at the CURVE handshake (ZAP) and raw bytes at ZeroMQ's
    greeting: nothing they send becomes a message. The loop admitted only the real
    transfers' requests (a fetch and, for some, nothing else), and its CPU time
    during the flood is measured (printed: loop_cpu_s against flood_seconds)."""
    if flooded["agent"]["auth"]:
        assert flooded["refused"].get("unauthenticated", 0) >= 10, flooded["refused"]
    assert flooded["admitted_during"] <= 2 * flooded["transfers_during"]
    assert "malformed" not in flooded["refused"]
    # Bounded: the loop thread served the real transfers and nothing else.
    assert flooded["loop_cpu_s"] < 0.5 * flooded["flood_seconds"], flooded["loop_cpu_s"]


def test_the_agent_returns_to_its_fds_and_threads(flooded):
    before, after = flooded["census_before"], flooded["census_after"]
    # Less Ray's gRPC sockets (loopback.ipv6_tcp_sockets): under load its timer
    # thread may start and open one of its own, which is not ours to count.
    ours_before = before["fds"] - flooded["ray_sockets_before"]
    ours_after = after["fds"] - flooded["ray_sockets_after"]
    assert ours_after <= ours_before, (flooded["grown"], flooded["ray_sockets_after"])
    # The agent's threads are a fixed set plus one per open stream connection (the
    # driver's pooled ones are closed by now); Ray's gRPC timer thread is not ours.
    grew = Counter(flooded["python_threads_after"]) - Counter(flooded["python_threads_before"])
    assert not grew, grew
    assert all(name.startswith("grpc") for name in flooded["grown"]["threads"]), flooded["grown"]


def test_idle_and_half_sent_connections_neither_block_nor_bloat(flooded):
    """300 idle and 50 half-sent connections on each of the agent's ports: small and
    large (stream) transfers still arrive exact; the producer's memory stays bounded
    and, once they close, its fds are back (checked above)."""
    idle = flooded["idle"]
    assert idle["connections"] == 2 * 350
    assert idle["transfers_ok"] == 10
    assert idle["rss_growth_bytes"] < 64 << 20, idle
