"""When ``rd.get`` of several refs raises, none of its fetches writes the caller's
tensors any more, and the fetch pool is free for the next call."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import ray
import torch

import raydirect as rd
from raydirect import _consumer, _stream_client, _stream_server

from actors import Producer
from helpers import Relay, read_through, wait_for

BIG = 512 << 20


def _dead_producers_ref() -> ray.ObjectRef:
    """A ref whose value the driver holds but whose producer is gone: its fetch
    fails at once, while the other fetches of the call are under way."""
    p = Producer.remote()
    ref = p.keep.remote("lost", 100_000)  # 400 KB: a direct object
    ray.wait([ref])
    pid = ray.get(p.pid.remote())
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=30, what="the producer to exit")
    return ref


def _pool_idle(timeout: float = 60.0) -> None:
    """Every thread of the fetch pool free at once (a barrier they all must reach)."""
    pool = _consumer.fetch_pool()
    barrier = threading.Barrier(_consumer._FETCH_THREADS)
    futures = [pool.submit(barrier.wait, timeout) for _ in range(_consumer._FETCH_THREADS)]
    for future in futures:
        future.result(timeout=timeout)


@pytest.fixture(scope="module")
def big_producer(ray_session):
    p = Producer.remote()
    yield p
    ray.kill(p)


@pytest.mark.parametrize("transport", ["cma", "shm", "tcp"])
def test_a_failed_get_leaves_no_fetch_writing_the_callers_tensors(big_producer, transport):
    """The review's reproduction: rd.get([failing_ref, big_ref], into=[None, target])."""
    failing = _dead_producers_ref()
    big = big_producer.big.remote(BIG, 3)
    ray.wait([big])
    target = torch.zeros(BIG, dtype=torch.uint8)
    with pytest.raises(rd.ProducerLostError):
        rd.get([failing, big], into=[None, target], tensor_transport=transport, timeout=60)
    target.zero_()  # from here on the memory is the caller's again
    _pool_idle()  # whatever fetch was still running has ended by now
    assert int(target.count_nonzero()) == 0, "a fetch went on writing after rd.get raised"
    got = rd.get(big, timeout=60)  # the pool serves the next call
    assert got.numel() == BIG and int(got[1]) == 3


def test_a_cancelled_get_async_stops_writing(big_producer):
    refs = [big_producer.big.remote(BIG, 7)]
    ray.wait(refs)
    target = torch.zeros(BIG, dtype=torch.uint8)

    async def cancelled() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(rd.get_async(refs, into=[target], tensor_transport="tcp"), 0.05)

    asyncio.run(cancelled())
    target.zero_()
    _pool_idle()
    assert int(target.count_nonzero()) == 0


SLOW = 128 << 20
PACE = (64 << 10, 0.01)  # the slow link: 64 KiB every 10 ms per connection (6.4 MB/s)


def _slow_link(position: int, data: bytes) -> bytes:
    """Bytes keep flowing, never idle long enough for an idle socket's timeout:
    what a stop must notice (a link this slow, not a sleep to wait for something)."""
    time.sleep(PACE[1])
    return data


def test_a_cancelled_get_async_stops_while_bytes_flow(big_producer, monkeypatch):
    """The call's gate closes while a tcp window's bytes flow (over a slow relay,
    128 MiB takes 10 s): every stream stops within a receive of the close, so the
    cancellation returns with a sliver of the window relayed, where before it
    waited for the whole window (streams looked at the gate only after 0.2 s of
    idle socket)."""
    ref = big_producer.big.remote(SLOW, 9)
    ray.wait([ref])
    port = ray.get(big_producer.__ray_call__.remote(lambda self: _stream_server.running().port))
    host = ray.util.get_node_ip_address()
    relay = Relay(host, (host, port), down=_slow_link, chunk=PACE[0])
    read_through(monkeypatch, relay)
    target = torch.zeros(SLOW, dtype=torch.uint8)

    async def cancel_midway() -> int:
        task = asyncio.ensure_future(rd.get_async(ref, into=target, tensor_transport="tcp"))
        give_up = time.monotonic() + 60
        while relay.down_bytes < 1 << 20:  # the window's bytes are flowing
            assert not task.done() and time.monotonic() < give_up, "no bytes flowed"
            await asyncio.sleep(0.01)
        task.cancel()  # closes the call's gate; returns once no stream writes
        with pytest.raises(asyncio.CancelledError):
            await task
        return relay.down_bytes

    try:
        relayed = asyncio.run(cancel_midway())
    finally:
        monkeypatch.undo()
        relay.close()
        _stream_client.close_idle()
    print(f"relayed before the cancellation returned: {relayed} of {SLOW} bytes")
    assert relayed < SLOW // 4, f"{relayed} bytes relayed before the cancellation returned"


def test_a_failure_midway_says_the_targets_may_be_partly_written(big_producer):
    """A read cut short (a sibling's failure, the deadline) leaves its into= targets
    holding what had arrived: the error said nothing of the caller's tensors."""
    failing = _dead_producers_ref()
    big = big_producer.big.remote(BIG >> 2, 5)
    ray.wait([big])
    target = torch.zeros(BIG >> 2, dtype=torch.uint8)
    with pytest.raises(rd.ProducerLostError, match=r"The into= targets of ref 1 may be partly"):
        rd.get([failing, big], into=[None, target], tensor_transport="tcp", timeout=60)
    with pytest.raises(rd.ProducerLostError, match=r"The into= targets may be partly written"):
        rd.get(failing, into=torch.zeros(100_000, dtype=torch.float32), timeout=60)
    with pytest.raises(rd.ProducerLostError) as lost:
        rd.get([failing, big], timeout=60)
    assert "into=" not in str(lost.value)  # no targets, nothing said of them
