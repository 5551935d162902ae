"""Node B's processes killed while its objects are referenced on node A."""

from __future__ import annotations

import time

import pytest

import mn_harness
from mn_harness import LOSS_BOUND_S, is_producer_lost


@pytest.mark.parametrize("how", ["killed", "killed_and_unreachable"])
def test_node_loss_raises_producer_lost_and_leaves_nothing(cluster, driver_script, how):
    """``killed``: node B's processes SIGKILLed (its address refuses connections).
    ``killed_and_unreachable``: its link taken down as well, as when a machine vanishes."""
    cluster.ensure_worker()  # after a node-loss test
    driver = cluster.start_driver(driver_script, "node_loss")
    try:
        ready = driver.expect("ready", timeout=240)
        assert ready["warm"] == {"mismatch": None, "received": {mn_harness.CROSS_NODE: 1}}
        assert ready["shm_read"] == {"mismatch": None, "received": {"shm": 1}}
        producer_pid = ready["producer"]["pid"]
        assert ready["segments"], "the producer on node B holds no shm segment: nothing to check"
        assert mn_harness.shm_segments_of([producer_pid], seals=False) == ready["segments"]

        killed = cluster.kill_worker_node()
        if how == "killed_and_unreachable":
            cluster.cut_worker_link()
        assert producer_pid in killed and ready["neighbour"]["pid"] in killed
        t0 = time.monotonic()
        driver.send("go")
        result = driver.expect("result", timeout=240)
        total = time.monotonic() - t0
    finally:
        driver.close()

    print({k: v for k, v in result.items() if k.endswith(":seconds")}, f"total {total:.1f}s")
    for reader in ("driver", "actor", "task"):
        outcome = result[reader]
        assert isinstance(outcome, dict) and "error" in outcome, (reader, outcome)
        assert is_producer_lost(outcome["error"]), (reader, outcome["error"])
        assert result[f"{reader}:seconds"] < LOSS_BOUND_S, (reader, result)
    assert total < 3 * LOSS_BOUND_S + 60

    # The surviving node still moves tensors, and no segment of a dead process is left.
    assert result["survivor"] is None, result["survivor"]
    assert result["consumer_stats"].get("cma", 0) >= 1
    assert mn_harness.shm_segments_of(killed) == []
