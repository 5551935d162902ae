"""Invariants of the core itself: the agent keeps serving, control ops have their
own lane, lazily made pools are made once, caches stay bounded."""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
from typing import Any

import pytest
import ray
import torch
import zmq
from ray import cloudpickle

import raydirect as rd
from raydirect import _api, _broadcast, _choice, _consumer, _into, _producer
from raydirect._payload import ProducerInfo

import actors
from helpers import agent_dealer
from plugin_transports import GatedPrepareTransport

_CONTEXT = zmq.Context()  # the test's own sockets, not raydirect's channels
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # helpers run in actors


def _request(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def _dealer(address: str) -> zmq.Socket:
    return agent_dealer(_CONTEXT, address)


def _ask(address: str, frame: bytes, timeout_s: float) -> dict | None:
    sock = _dealer(address)
    try:
        sock.send(frame)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return json.loads(sock.recv_multipart()[0])
    finally:
        sock.close()


@pytest.fixture(scope="module")
def producer(ray_session):
    p = actors.Producer.remote()
    address = ray.get(p.__ray_call__.remote(actors.agent_address))
    yield p, address
    ray.kill(p)


def test_the_agent_logs_an_unexpected_error_and_keeps_serving(producer):
    p, address = producer
    ray.get(p.__ray_call__.remote(actors.break_dispatch_once))
    # This request meets the bug (no answer); the agent must survive it.
    assert _ask(address, _request(op="stats"), timeout_s=2) is None
    reply = _ask(address, _request(op="stats"), timeout_s=30)
    assert reply is not None and reply["ok"] is True


def test_control_ops_are_served_while_slow_sends_fill_the_data_lane(producer):
    """Consumers waiting on slow preparations hold every data worker; a control
    op (stats here; 'sent' notices and group ops alike) is still answered."""
    p, address = producer
    rd.register_tensor_transport("gated", ["cpu"], GatedPrepareTransport, replace=True)
    gate = GatedPrepareTransport.GATE
    if os.path.exists(gate):
        os.unlink(gate)
    refs = [p.value_gated.remote("dtypes") for _ in range(6)]
    ray.wait(refs, num_returns=len(refs))  # made; their preparation waits on the gate
    held = ray.get(p.__ray_call__.remote(actors.held_objects, "gated"))
    waiting = []
    try:
        for obj, cap in held.items():  # each holds a data worker until the gate opens
            sock = _dealer(address)
            sock.send(_request(op="meta", obj=obj, cap=cap, transport="gated", timeout=120))
            waiting.append(sock)
        reply = _ask(address, _request(op="stats"), timeout_s=20)
        assert reply is not None and reply["ok"] is True, "a control op waited behind slow sends"
    finally:
        open(gate, "w").close()
    for sock in waiting:  # the waits end once the gate opens: the data lane was busy
        assert sock.poll(60_000)
        assert json.loads(sock.recv_multipart()[0])["ok"] is True
        sock.close()
    os.unlink(gate)
    assert [actors.check_value("dtypes", v) for v in rd.get(refs, timeout=60)] == [None] * 6


def _export_a_region(self: Any) -> dict:
    self.region = rd.export_region({"k": torch.zeros(1 << 16)})
    return self.region.handle().to_dict()


def _registered_anything(_self: Any) -> bool:
    from raydirect.transports.registry import _instances

    return "nixl" in _instances and _instances["nixl"].registered_bytes() != (0, 0)


def test_an_agent_asked_to_prepare_a_region_for_nixl_refuses(producer):
    """Regions are read with rd.read_ranges; a request to register one for nixl
    (what a reader of an object across nodes sends) is refused, registering
    nothing its close would not release."""
    p, address = producer
    handle = ray.get(p.__ray_call__.remote(_export_a_region))
    ask = _request(
        op="meta", obj=handle["region"], cap=handle["capability"], transport="nixl", prepare=True
    )
    reply = _ask(address, ask, timeout_s=30)
    assert reply is not None and reply["ok"] is False, reply
    assert "rd.read_ranges" in reply["error"], reply
    assert not ray.get(p.__ray_call__.remote(_registered_anything))


class _SlowPool:
    """A pool whose construction takes a while: two callers at once would both make one."""

    made = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        type(self).made += 1
        threading.Event().wait(0.05)  # widens the window a missing lock leaves open


@pytest.mark.parametrize(
    ("module", "attribute", "make"),
    [
        (_producer, "_preparation_pool", lambda: _producer._preparer()),
        (_consumer, "_pool", lambda: _consumer.fetch_pool()),
        (_api, "_async_executor", lambda: _api._async_pool()),
    ],
    ids=["preparer", "fetch-pool", "async-pool"],
)
def test_a_lazily_made_pool_is_made_once(monkeypatch, module, attribute, make):
    monkeypatch.setattr(module, attribute, None)
    monkeypatch.setattr(module, "ThreadPoolExecutor", _SlowPool)
    _SlowPool.made = 0
    start = threading.Barrier(8)
    got: list[Any] = []

    def call() -> None:
        start.wait()
        got.append(make())

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert _SlowPool.made == 1 and len({id(pool) for pool in got}) == 1


def _producer_info(token: bytes, pid: int = 4242) -> ProducerInfo:
    return ProducerInfo(
        agent_address="tcp://127.0.0.1:1",
        node_id="node",
        pid=pid,
        start_time=1,
        process_token=token,
        label="P.m",
    )


def test_refused_transports_forget_a_restarted_producer_and_stay_bounded(monkeypatch):
    monkeypatch.setattr(_choice, "_REFUSALS_KEPT", 4)
    refusals = _choice._Refusals()
    before = _producer_info(secrets.token_bytes(16))
    refusals.add(before)
    restarted = _producer_info(secrets.token_bytes(16))  # same node and pid, new process
    assert before in refusals and restarted not in refusals
    for _ in range(10):
        refusals.add(_producer_info(secrets.token_bytes(16)))
    assert len(refusals._seen) == 4 and before not in refusals


def test_set_target_hints_stay_bounded(monkeypatch, caplog):
    monkeypatch.setattr(_into, "_HINTS_KEPT", 3)
    monkeypatch.setattr(_into, "_hints", type(_into._hints)())
    ids = [secrets.token_bytes(16) for _ in range(5)]
    for obj_id in ids:
        _into.set_hint(obj_id, [object()])
    assert len(_into._hints) == 3 and _into.take_hint(ids[0]) is None
    assert _into.take_hint(ids[-1]) is not None
    assert "were never used" in caplog.text


def test_the_broadcast_node_cache_stays_bounded(monkeypatch, pair):
    monkeypatch.setattr(_broadcast, "_NODES_KEPT", 1)
    monkeypatch.setattr(_broadcast, "_node_cache", type(_broadcast._node_cache)())
    node = ray.get_runtime_context().get_node_id()
    assert _broadcast._nodes_of(list(pair), timeout=60) == [node, node]
    assert len(_broadcast._node_cache) == 1
