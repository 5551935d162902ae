"""Transfers between two Ray nodes with distinct addresses (node B -> node A).

One driver run (mn_driver.py ``transfers``) makes every transfer and records
what each reader received and through which transport; the tests below assert
on its report. Contents are compared element by element in the reader.
"""

from __future__ import annotations

from typing import Any

import pytest

import mn_harness

KINDS = ("pattern", "dtypes")  # a 64 MiB int32 pattern; a dict of many dtypes and a view


@pytest.fixture(scope="module")
def report(cluster: mn_harness.Cluster, driver_script) -> dict[str, Any]:
    cluster.ensure_worker()  # after a node-loss test
    return cluster.run_driver(driver_script, "transfers", timeout=280)


def entry(report: dict[str, Any], key: str) -> Any:
    value = report[key]
    if isinstance(value, dict) and "error" in value:
        pytest.fail(f"{key} failed: {value['error']}\n{value.get('traceback', '')}")
    return value


def test_actors_run_on_distinct_nodes(report):
    producer, consumer = report["producer"], report["consumer"]
    assert producer["ip"] == mn_harness.ADDR_WORKER
    assert consumer["ip"] == mn_harness.ADDR_HEAD == report["driver"]["ip"]
    assert producer["node_id"] != consumer["node_id"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reader", ["actor", "task", "driver"])
def test_auto_across_nodes_uses_nixl_or_tcp(report, reader, kind):
    assert entry(report, f"auto/{kind}/{reader}") == {
        "mismatch": None,
        "received": {mn_harness.CROSS_NODE: 1},
        **({"ip": mn_harness.ADDR_HEAD} if reader == "task" else {}),
    }


def test_an_object_read_once_across_nodes_is_freed_by_its_read(report):
    """reads=1: over nixl where installed (the seal guards it), else tcp."""
    assert entry(report, "once/first") == {
        "mismatch": None,
        "received": {mn_harness.CROSS_NODE: 1},
    }
    assert entry(report, "once/held") == 0
    second = report["once/second"]["error"]
    assert second["is_producer_lost"] and "reads=1" in second["message"], second


@pytest.mark.parametrize("kind", KINDS)
def test_auto_across_nodes_as_task_argument(report, kind):
    assert entry(report, f"auto/{kind}/task_arg") is None  # no mismatch


def test_auto_within_a_node_uses_cma(report):
    assert entry(report, "auto/same_node_B/task") == {
        "mismatch": None,
        "received": {"cma": 1},
        "ip": mn_harness.ADDR_WORKER,
    }
    assert entry(report, "auto/same_node_A/actor") == {"mismatch": None, "received": {"cma": 1}}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reader", ["actor", "driver"])
def test_declared_tcp_across_nodes(report, reader, kind):
    assert entry(report, f"tcp/{kind}/{reader}") == {"mismatch": None, "received": {"tcp": 1}}


@pytest.mark.parametrize("kind", KINDS)
def test_gloo_across_nodes_without_socket_ifname(report, kind):
    assert report["producer"]["gloo_socket_ifname"] is None
    assert report["consumer"]["gloo_socket_ifname"] is None
    assert entry(report, "gloo/group") == "ab"
    assert entry(report, f"gloo/{kind}/actor") == {"mismatch": None, "received": {"gloo": 1}}


@pytest.mark.parametrize("kind", KINDS)
def test_driver_outside_the_group_reads_gloo_object_over_tcp(report, kind):
    assert entry(report, f"gloo/{kind}/driver") == {"mismatch": None, "received": {"tcp": 1}}


def test_an_encrypting_consumer_refuses_clear_bytes_from_another_node(report):
    """RAYDIRECT_ENCRYPT=1 on the consumer only: node B's clear producer is refused
    (naming it, the setting and the fixes); an encrypting one on node B, a clear one
    on the consumer's own node, and node B's clear one with RAYDIRECT_ALLOW_CLEAR=1
    are read."""
    refused = report["encrypting/clear_across"]
    assert "error" in refused, refused
    error = refused["error"]
    assert error["type"] == "TransferError", error
    assert f"pid {report['producer']['pid']} on {mn_harness.ADDR_WORKER}" in error["message"]
    assert "RAYDIRECT_ENCRYPT=1" in error["message"]
    assert "RAYDIRECT_ALLOW_CLEAR=1" in error["message"]
    for read in ("sealed_across", "clear_same_node", "allowed_clear_across"):
        assert entry(report, f"encrypting/{read}") == {"mismatch": None, "received": {"tcp": 1}}


def test_status_shows_agents_bound_to_node_addresses(report):
    rows = entry(report, "status")
    ip_of = {report["producer"]["node_id"]: mn_harness.ADDR_WORKER}
    ip_of[report["consumer"]["node_id"]] = mn_harness.ADDR_HEAD
    by_pid = {row["pid"]: row for row in rows}
    assert report["producer"]["pid"] in by_pid, rows
    assert report["consumer"]["pid"] in by_pid, rows
    for row in rows:
        host = row["address"].removeprefix("tcp://").partition("/")[0].rsplit(":", 1)[0]
        assert host == ip_of[row["node_id"]], row
        assert row["reachable"], row
    assert by_pid[report["producer"]["pid"]]["stats"]["objects_sent"].get("gloo") == 2


@pytest.mark.parametrize("how", ["dropped", "caller_died"])
def test_a_callers_leases_across_nodes(report, how):
    """Objects of node B made for a caller on node A are freed when it drops its
    refs (the frees cross to B's agent) and when it dies (Ray reports its death)."""
    got = entry(report, f"caller_leases/{how}")
    assert got["made"] == 3 and got["left"] == 0, got
