"""A producer's serving threads cannot be held by what consumers wait for: a
preparation, a plug-in send that hangs. A consumer bounds the receive threads
that plug-ins it gave up on leave behind."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import ray
import torch
from ray import cloudpickle

import raydirect as rd
from raydirect import _plugin_transfer

import plugin_transports
from actors import Producer
from helpers import wait_for
from plugin_transports import GatedPrepareTransport, HangingTwoSided

cloudpickle.register_pickle_by_value(plugin_transports)

TCP_BYTES = 8 << 20


@pytest.fixture(scope="module")
def producer(ray_session):
    for gate in (HangingTwoSided.GATE, GatedPrepareTransport.GATE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(gate)
    rd.register_tensor_transport("hanging", ["cpu"], HangingTwoSided, replace=True)
    rd.register_tensor_transport("gated", ["cpu"], GatedPrepareTransport, replace=True)
    p = Producer.remote()
    yield p
    for gate in (HangingTwoSided.GATE, GatedPrepareTransport.GATE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(gate)
    ray.kill(p)


def _tcp_read_works(producer) -> None:
    """A byte read from the same producer still gets a serving thread."""
    got = rd.get(producer.big.remote(TCP_BYTES, 9), tensor_transport="tcp", timeout=20)
    assert got.numel() == TCP_BYTES and int(got[1]) == 9


def test_hanging_plugin_sends_hold_no_data_thread_and_abandoned_receives_are_bounded(producer):
    other = Producer.remote()  # each producer serves two plug-in sends at once
    refs = [ray.get(p.put.remote("dtypes", "hanging"))[0] for p in (producer, other) * 2]
    refs.append(ray.get(producer.put.remote("dtypes", "hanging"))[0])
    for ref in refs[:4]:  # each given up on; its send hangs in the producer
        with pytest.raises(TimeoutError):
            rd.get(ref, timeout=1)
    _tcp_read_works(producer)
    _tcp_read_works(other)
    assert _plugin_transfer._abandoned.running("hanging") == 4
    with pytest.raises(rd.TransferError, match="given up on and never returned"):
        rd.get(refs[4], timeout=5)  # no fifth stuck thread
    open(HangingTwoSided.GATE, "w").close()  # the peer shows up: everything returns
    wait_for(lambda: _plugin_transfer._abandoned.running("hanging") == 0, what="receives end")
    assert rd.get(refs[4], timeout=30)["f32"].shape == (64, 32)
    ray.kill(other)


def test_consumers_waiting_for_a_preparation_hold_no_serving_thread(producer):
    refs = [ray.get(producer.put.remote("dtypes", "gated"))[0] for _ in range(6)]
    results: list[object] = []
    waiting = [
        threading.Thread(target=lambda r=ref: results.append(rd.get(r)), daemon=True)
        for ref in refs
    ]
    for thread in waiting:  # no deadline: each waits for the preparation
        thread.start()
    wait_for(
        lambda: ray.get(producer.requests_waiting.remote()) >= len(refs),
        what="every consumer's request to reach the producer",
    )
    _tcp_read_works(producer)
    assert not results
    open(GatedPrepareTransport.GATE, "w").close()
    for thread in waiting:
        thread.join(timeout=60)
    assert len(results) == 6 and all(isinstance(r["f32"], torch.Tensor) for r in results)
