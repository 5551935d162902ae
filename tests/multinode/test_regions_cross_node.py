"""Regions across nodes: an owner on node B, readers on node A holding only the
handle, as JSON (issue 40). One driver run (mn_region_driver.py ``regions``)
makes every read; the tests assert on its report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import mn_harness

DRIVER = Path(__file__).with_name("mn_region_driver.py")
EXACT_OVER_TCP = {"wrong_layers": [], "received": {"tcp": 1}}


@pytest.fixture(scope="module")
def report(cluster: mn_harness.Cluster) -> dict[str, Any]:
    cluster.ensure_worker()  # after a node-loss test
    return cluster.run_driver(DRIVER, "regions", timeout=280)


def entry(report: dict[str, Any], key: str) -> Any:
    value = report[key]
    if isinstance(value, dict) and "error" in value and "untouched" not in value:
        pytest.fail(f"{key} failed: {value['error']}\n{value.get('traceback', '')}")
    return value


def test_the_owner_and_the_reader_are_on_distinct_nodes(report):
    assert report["owner"]["ip"] == mn_harness.ADDR_WORKER
    assert report["reader"]["ip"] == mn_harness.ADDR_HEAD


@pytest.mark.parametrize("read", ["auto/actor", "auto/driver", "tcp/actor", "cma/actor"])
def test_node_a_reads_node_bs_region_over_tcp(report, read):
    # auto never picks nixl for a region; cma reaches only its node: tcp either way
    assert entry(report, read) == EXACT_OVER_TCP


def test_a_reader_on_the_owners_node_reads_over_cma(report):
    assert entry(report, "auto/same_node") == {"wrong_layers": [], "received": {"cma": 1}}


def test_writes_and_notices_cross_nodes(report):
    assert entry(report, "after_write") == EXACT_OVER_TCP
    assert entry(report, "notify") == EXACT_OVER_TCP
    assert report["heard"] == [{"request": "r-1", "blocks": [3, 4, 5, 100, 7, 255, 0]}]
    assert report["owner_sent"].get("tcp", 0) > 0


def test_a_read_after_close_is_producer_lost(report):
    outcome = report["after_close"]
    assert outcome["error"]["type"] == "ProducerLostError", outcome
    assert "region 'kv'" in outcome["error"]["message"]
    assert outcome["untouched"]


def test_an_encrypting_owner_is_read_over_tls(report):
    assert report["sealed_owner"]["encryption"] in ("tls", "ktls")
    assert entry(report, "tls/sealed") == EXACT_OVER_TCP
    refused = report["tls/clear_refused"]
    assert refused["error"]["type"] == "TransferError" and refused["untouched"], refused
    assert "in clear" in refused["error"]["message"]


def test_a_read_after_the_owner_was_killed_is_producer_lost(report):
    assert entry(report, "killed/before") == EXACT_OVER_TCP
    outcome = report["killed/after"]
    assert outcome["error"]["type"] == "ProducerLostError", outcome  # not a timeout
    print(f"a reader on node A saw the owner's death after {report['killed/detect_s']}s")
