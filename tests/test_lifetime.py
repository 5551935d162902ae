"""Lifetime follows Ray's reference counting; failures end in clear errors, not hangs."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import ray
import torch
from ray import cloudpickle

import raydirect as rd
from raydirect import _server, _wire
from raydirect._store import store
from raydirect.transports import nixl_agent
from raydirect.transports.registry import transport_instance

import plugin_transports
from actors import Consumer, Producer, check_value
from actors import make_value as actors_value
from helpers import shm_segments, wait_for
from plugin_transports import PickleShmTransport

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(plugin_transports)


def held(p) -> int:
    return ray.get(p.stats.remote()).num_objects


def made(p, by: str) -> ray.ObjectRef:
    """A direct object of the producer's (a small one would go inline): a method's
    return (lifetime by its lease), or an ``rd.put`` made in the producer and
    handed to the driver inside a list (lifetime by the put ref itself)."""
    if by == "method":
        return p.value.remote("large")
    [ref] = ray.get(p.put.remote("large"))
    return ref


MADE_BY = ["method", "put"]


@pytest.mark.parametrize("by", MADE_BY)
def test_freed_when_last_ref_dropped(pair, by):
    p, c = pair
    wait_for(lambda: held(p) == 0, what="empty store")
    ref = made(p, by)
    assert ray.get(c.check.remote("large", ref)) is None
    assert held(p) == 1
    del ref
    wait_for(lambda: held(p) == 0, what="object freed")


@pytest.mark.parametrize("by", MADE_BY)
def test_borrower_holding_nested_ref_keeps_object(pair, by):
    p, c = pair
    wait_for(lambda: held(p) == 0, what="empty store")
    ref = made(p, by)
    ray.get(c.hold.remote([ref]))  # c borrows a nested ref
    del ref
    # The driver's ref is gone; the borrower's keeps the object alive and readable.
    assert ray.get(c.check_held.remote("large")) is None
    assert held(p) == 1
    ray.get(c.drop.remote())
    wait_for(lambda: held(p) == 0, what="freed after the borrower dropped it")


@pytest.mark.parametrize("by", MADE_BY)
def test_ref_deleted_before_the_consumer_task_ran(pair, by):
    p, c = pair
    wait_for(lambda: held(p) == 0, what="empty store")
    blocker = Consumer.options(max_concurrency=2).remote()
    gate = blocker.wait_gate.remote(60)
    ref = made(p, by)
    # The task cannot start before ``gate`` resolves; meanwhile only it holds ``ref``.
    result = c.check_after.remote("large", ref, gate)
    del ref
    assert held(p) == 1
    ray.get(blocker.open_gate.remote())
    assert ray.get(result) is None
    wait_for(lambda: held(p) == 0, what="freed once the task that held it ran")
    ray.kill(blocker)


def test_an_rd_put_in_the_driver_lives_as_long_as_its_ref_anywhere(pair):
    """The driver owns its put ref: a borrower in another process keeps the
    object after the driver's own ref is gone; the last one frees it here."""
    _, c = pair
    before = set(store._objects)
    ref = rd.put(actors_value("large"))
    [obj_id] = set(store._objects) - before
    ray.get(c.hold.remote([ref]))
    del ref
    assert ray.get(c.check_held.remote("large")) is None
    assert obj_id in store._objects
    ray.get(c.drop.remote())
    wait_for(lambda: obj_id not in store._objects, what="the driver's put freed")


def test_same_ref_twice_in_one_task(pair):
    p, c = pair
    ref = p.value.remote("numpy")
    assert ray.get(c.check_twice.remote("numpy", ref, ref)) is None


def test_many_objects_leave_nothing_behind(pair):
    p, c = pair
    before = shm_segments()
    methods = [p.value, p.value_shm, p.value_tcp]
    for i in range(200):
        ref = methods[i % 3].remote("views")
        assert ray.get(c.check.remote("views", ref)) is None
        del ref
    wait_for(lambda: held(p) == 0, what="store empty after 200 objects")
    stats = ray.get(p.stats.remote())
    assert stats.num_bytes == 0
    # Segments are pooled for reuse, not one per object.
    assert len(shm_segments() - before) <= 2


def _put_watched(self, transport: str) -> list[ray.ObjectRef]:
    """An rd.put of a tensor only the object keeps, and a weak reference to its memory."""
    from torch.multiprocessing.reductions import StorageWeakRef

    t = torch.full((1 << 18,), 5, dtype=torch.int32)
    self.watched = StorageWeakRef(t.untyped_storage())
    return [rd.put(t, tensor_transport=transport)]


def _collector(_self, on: bool) -> None:
    import gc

    (gc.enable if on else gc.disable)()


def _watched_alive(self) -> bool:
    return not self.watched.expired()


NIXL = pytest.param("nixl", marks=pytest.mark.skipif(not nixl_agent.available(), reason="no NIXL"))


@pytest.mark.parametrize("transport", ["auto", "tcp", "shm", "pickle_shm", NIXL])
def test_a_free_releases_the_memory_without_the_cyclic_collector(pair, transport):
    """The free itself lets the tensors go: nothing of raydirect's holds an object
    in a reference cycle. Objects prepared in the background (plug-ins, nixl) were
    held by one (object -> its preparation's future -> the done-callback -> object)
    until Python's cyclic collector ran, which in a Ray worker can be minutes."""
    p, _ = pair
    rd.register_tensor_transport("pickle_shm", ["cpu"], PickleShmTransport, replace=True)
    [ref] = ray.get(p.__ray_call__.remote(_put_watched, transport))
    assert bool((rd.get(ref, timeout=60) == 5).all())
    ray.get(p.__ray_call__.remote(_collector, False))  # only reference counting frees now
    try:
        del ref
        wait_for(lambda: held(p) == 0, what="object freed")
        # The store counts an object out before its reaper thread has released it
        # and dropped its last reference: poll. A cycle keeps it alive to the deadline.
        wait_for(
            lambda: not ray.get(p.__ray_call__.remote(_watched_alive)),
            timeout=10,
            what="the freed object's tensor to go with Python's cyclic collector off",
        )
    finally:
        ray.get(p.__ray_call__.remote(_collector, True))


def test_producer_blocked_forever_still_serves(pair):
    p, c = pair
    ref = p.value.remote("large")
    ray.wait([ref])
    p.block_forever.remote()  # the actor's only thread never returns
    for transport in ("tcp", "shm", "cma", "auto"):
        assert check_value("large", rd.get(ref, timeout=30, tensor_transport=transport)) is None
    assert ray.get(c.check.remote("large", ref), timeout=30) is None


def test_killed_producer_gives_clear_error_in_bounded_time(ray_session):
    p, c = Producer.remote(), Consumer.remote()
    refs = [p.value_shm.remote("dtypes"), p.value_tcp.remote("dtypes"), p.value.remote("large")]
    assert ray.get(c.check.remote("dtypes", refs[0])) is None  # staged in a segment
    pid = ray.get(p.pid.remote())
    os.kill(pid, signal.SIGKILL)
    for ref in refs:
        start = time.monotonic()
        with pytest.raises(rd.ProducerLostError, match="Re-run the producer"):
            rd.get(ref)
        assert time.monotonic() - start < 15
        message = ray.get(c.fetch_error.remote([ref]), timeout=60)
        assert "RaySystemError" in message and "Producer.value" in message
    # Nothing left in /dev/shm by the killed process.
    assert not [s for s in shm_segments() if s.startswith(f"rd-{pid}-")]
    ray.kill(c)


def test_restarted_producer_reports_lost_object(ray_session):
    p = Producer.options(max_restarts=1).remote()
    ref = p.value_tcp.remote("dtypes")
    ray.wait([ref])
    old = ray.get(p.pid.remote())
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: _pid_or_none(p) not in (None, old), timeout=60, what="restart")
    with pytest.raises(rd.ProducerLostError):
        rd.get(ref, timeout=30)
    ray.kill(p)


def _pid_or_none(actor):
    try:
        return ray.get(actor.pid.remote(), timeout=5)
    except Exception:
        return None


def test_producer_killed_during_a_tcp_stream(ray_session):
    p, c = Producer.remote(), Producer.remote()
    big = p.big.remote(512 << 20, 5)
    ray.wait([big])
    pid = ray.get(p.pid.remote())
    start = time.monotonic()
    pending = c.try_get.remote([big], None, "tcp")
    os.kill(pid, signal.SIGKILL)  # before or during the stream: both must end cleanly
    message = ray.get(pending, timeout=120)
    assert message.startswith("ProducerLostError"), message
    assert time.monotonic() - start < 60
    ray.kill(c)


class _Recorded:
    """What a handler answers, kept (the agent's ``Reply`` sends it on)."""

    def __init__(self) -> None:
        self.headers: list[dict] = []

    def send(self, header: dict, *frames: object, copy: bool = True) -> None:
        self.headers.append(header)


def test_an_shm_fetch_served_after_its_free_answers_lost_and_stages_no_segment(ray_session):
    """The race the agent's lanes allow: a fetch found its object, then waited (a
    queued data lane, a consumer that timed out) while Ray freed it. Served now,
    it must answer "lost" as a fetch of a freed object does, and stage no segment:
    the free has run, so nothing would ever release one (a 16 MiB /dev/shm leak)."""
    before = set(store._objects)
    ref = rd.put(torch.ones(4 << 20, dtype=torch.int32), tensor_transport="shm")  # 16 MiB
    [obj] = [o for k, o in store._objects.items() if k not in before]
    segments = shm_segments()
    del ref  # Ray's reference counting frees it, through the lease, as in production
    wait_for(lambda: obj.freed, what="the object freed by its lease")
    reply = _Recorded()
    request = {"op": _wire.FETCH, "obj": obj.obj_id.hex(), "cap": obj.capability.hex(),
               "transport": "shm", "nbytes": obj.nbytes}  # fmt: skip
    _server.Server._run(_server._handlers[_wire.FETCH], obj, request, reply)  # as the lane does
    assert [h.get("kind") for h in reply.headers] == [_wire.LOST], reply.headers
    assert shm_segments() == segments  # no segment staged for it
    pool = transport_instance("shm")._pool
    assert pool is None or obj.obj_id not in pool._used


@ray.remote(num_cpus=0)
class StagedThenFreed:
    @rd.method(tensor_transport="shm")
    def value(self) -> torch.Tensor:
        return torch.full((1 << 18,), 3.0)  # 1 MiB

    def free_and_restage(self) -> int:
        """Free every object held here, as a lease's callback does (here while the
        driver still holds the ref, as when the ref's owner died), then stage
        other bytes into each segment that went back to the pool, as the agent
        does for the next object."""
        from raydirect._store import store
        from raydirect.transports.registry import transport_instance

        for obj_id in list(store._objects):
            store.free(obj_id)
        pool = transport_instance("shm")._pool
        reused = [pool.acquire(f"next-{i}".encode(), 1 << 20) for i in range(len(pool._idle))]
        for seg in reused:
            seg.view.fill_(7)
        return len(reused)


def test_an_shm_copy_that_races_the_free_and_a_restaging_raises(ray_session, monkeypatch):
    """The reader got the segment's name, then the object was freed and another
    staged into the segment before the reader copied it out: the copy must raise,
    not return the other bytes (the segment's tag, ``transports.shm``)."""
    p = StagedThenFreed.remote()
    ref = p.value.remote()
    shm = transport_instance("shm")
    mapped = shm._mapped.view

    def view_then_free(name: str, size: int) -> torch.Tensor:
        seg = mapped(name, size)
        assert ray.get(p.free_and_restage.remote()) >= 1  # the segment went back, was reused
        return seg

    monkeypatch.setattr(shm._mapped, "view", view_then_free)
    with pytest.raises(rd.ProducerLostError, match="freed the object"):
        rd.get(ref, timeout=30)
    monkeypatch.undo()
    del ref
    ray.kill(p)
