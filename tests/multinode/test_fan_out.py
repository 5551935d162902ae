"""One producer (node B) to four consumers on two other nodes (A and C), on the
three-node cluster, with the bytes over every node's link counted."""

from __future__ import annotations

import shutil
import time

import pytest

import mn_harness
from mn_harness import LOSS_BOUND_S, is_producer_lost

PATTERN = 64 << 20  # the "pattern" value's bytes (mn_driver.PATTERN_BYTES)
WEIGHTS = 8 * 1024 * 2048 * 4  # mn_fanout_driver.Trainer's model
NODES = {"A": mn_harness.NS_HEAD, "B": mn_harness.NS_WORKER, "C": mn_harness.NS_THIRD}
# TCP/IP headers and Ray's own chatter on top of the payload, at most.
OVERHEAD = 0.15


def counters() -> dict[str, dict[str, int]]:
    return {node: mn_harness.link_bytes(ns) for node, ns in NODES.items()}


def moved(before: dict, after: dict) -> dict[str, dict[str, int]]:
    return {
        node: {way: after[node][way] - before[node][way] for way in ("rx", "tx")} for node in before
    }


@pytest.fixture(scope="module")
def fan_out(cluster3, fanout_script):
    """Runs the modes on one driver and returns {mode: (driver's report, link bytes)}."""
    driver = cluster3.start_driver(fanout_script, "fan_out")
    results = {}
    try:
        ready = driver.expect("ready", timeout=300)
        assert ready["producer"] == mn_harness.ADDR_WORKER
        assert sorted(set(ready["readers"])) == [mn_harness.ADDR_HEAD, mn_harness.ADDR_THIRD]
        for mode in ("broadcast", "direct", "weights"):
            before = counters()
            driver.send(f"go {mode}")
            report = driver.expect("done", timeout=300)
            results[mode] = (report, moved(before, counters()))
        driver.send("go")
        driver.expect("result", timeout=60)
    finally:
        driver.close()
    print({mode: links for mode, (_, links) in results.items()})
    return results


def assert_once_per_node(links: dict, payload: int) -> None:
    """Node B sent the payload once to each of A and C, and each received it once."""
    assert 2 * payload <= links["B"]["tx"] <= 2 * payload * (1 + OVERHEAD), links
    for node in ("A", "C"):
        assert payload <= links[node]["rx"] <= payload * (1 + OVERHEAD), (node, links)


def test_broadcast_crosses_each_link_once_per_node(fan_out):
    report, links = fan_out["broadcast"]
    assert report["mismatches"] == [None] * 4
    # One reader per node (the relay) read across, then its own copy; its neighbour
    # read the relay's copy on their node.
    kinds = [set(r) for r in report["received"]]
    assert kinds.count({mn_harness.CROSS_NODE, "local"}) == 2, kinds
    assert kinds.count({"cma"}) == 2, kinds
    assert_once_per_node(links, PATTERN)


def test_direct_reads_cross_once_per_reader(fan_out):
    """The baseline: every reader reads the producer itself, so the counters must
    see four copies leave node B (this is what makes the broadcast check mean something)."""
    report, links = fan_out["direct"]
    assert report["mismatches"] == [None] * 4
    assert links["B"]["tx"] >= 4 * PATTERN, links


def test_sharded_weight_fan_out_moves_one_copy_per_node(fan_out):
    """Two inference workers per node, each loading half of every weight: a node
    receives one copy of the model, and node B sends two."""
    report, links = fan_out["weights"]
    assert [load["wrong"] for load in report["loads"]] == [[]] * 4
    assert {load["version"] for load in report["loads"]} == {2}
    assert_once_per_node(links, WEIGHTS)


def test_producer_node_lost_during_fan_out(cluster3, fanout_script):
    """Node B's egress throttled so a round takes seconds; its processes are killed
    once bytes flow. Every reader gets exact bytes or a clear error, in bounded time;
    no relay copy or shared-memory segment is left."""
    if shutil.which("tc") is None:
        pytest.skip("needs tc (iproute2) to slow node B's link so the kill lands midway")
    driver = cluster3.start_driver(fanout_script, "fan_out_loss")
    try:
        ready = driver.expect("ready", timeout=300)
        assert ready["warm"]["mismatches"] == [None] * 4
        mn_harness.throttle(mn_harness.NS_WORKER, "400mbit")
        driver.send("go")
        driver.expect("round", timeout=120)
        start = mn_harness.link_bytes(mn_harness.NS_WORKER)["tx"]
        deadline = time.monotonic() + 60
        while mn_harness.link_bytes(mn_harness.NS_WORKER)["tx"] - start < (8 << 20):
            assert time.monotonic() < deadline, "no bytes left node B after the round began"
            time.sleep(0.05)
        killed = cluster3.kill_worker_node(mn_harness.NS_WORKER)
        t0 = time.monotonic()
        result = driver.expect("result", timeout=300)
        total = time.monotonic() - t0
    finally:
        driver.close()
        mn_harness.throttle(mn_harness.NS_WORKER, None)
    print(result["outcomes"], f"total {total:.1f}s")
    errors = [o["error"] for o in result["outcomes"] if "error" in o]
    assert errors, f"no reader saw the loss: {result['outcomes']}"
    for outcome in result["outcomes"]:
        assert outcome.get("mismatch") is None, outcome
        assert "error" not in outcome or is_producer_lost(outcome["error"]), outcome
        assert outcome["seconds"] < LOSS_BOUND_S, outcome
    assert result["held"] == [0, 0, 0, 0], "relay copies outlived the failed fan-out"
    # No staged segment of B's is left. The slabs of their seals stay until the next
    # raydirect process on that node sweeps them (tests/test_seals.py), as any file a
    # SIGKILLed process leaves; the harness's teardown does it here.
    assert mn_harness.shm_segments_of(killed, seals=False) == []
