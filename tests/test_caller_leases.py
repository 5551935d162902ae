"""Caller-owned leases: a call through an actor handle passes the caller's own
token, which the producer nests in the Payload as its lease. Every lifetime of
tests/test_lifetime.py runs on them (the driver calls through handles); here,
the token path itself, callers that are actors, the caller's death, and the
calls that get the producer's own lease instead."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest
import ray
import torch

import raydirect as rd
from raydirect import _caller_leases, _ray

from helpers import wait_for

NUMEL = 1 << 16  # 256 KiB of float32: a direct object, not inline


@ray.remote
class Producer:
    @rd.method
    def value(self, n: int) -> torch.Tensor:
        return torch.full((NUMEL,), float(n))

    def claimed(self) -> int:
        """Objects standing on a caller's token now."""
        book = _caller_leases.ledger
        with book._lock:
            return sum(len(pair) for pair in book._pairs.values())

    def held(self) -> int:
        return rd.local_stats().num_objects

    def pid(self) -> int:
        return os.getpid()

    def own_call(self) -> list[ray.ObjectRef]:
        """Its rd.method called as a plain method (no handle, no decorator): the
        Payload carries the producer's own lease; returned nested, so kept."""
        return [ray.put(self.value(7))]


@ray.remote
class Caller:
    def pid(self) -> int:
        return os.getpid()

    def make(self, producer, n: int) -> int:
        self.refs = [producer.value.remote(i) for i in range(n)]
        ray.wait(self.refs, num_returns=n)
        return n

    def drop(self) -> None:
        self.refs = []

    def hand_over(self, producer, holder) -> None:
        """An object made here, held only by ``holder`` (nested) once this returns."""
        ref = producer.value.remote(3)
        ray.get(holder.hold.remote([ref]))

    def queued_frees(self) -> int:
        with _caller_leases.caller_leases._lock:
            return sum(len(p.freed) for p in _caller_leases.caller_leases._pairs.values())


@ray.remote
class Holder:
    def hold(self, refs: list[ray.ObjectRef]) -> None:
        self.refs = refs

    def check(self, n: float) -> bool:
        return bool((rd.get(self.refs[0], timeout=30) == n).all())

    def drop(self) -> None:
        self.refs = []


def test_rd_method_carries_rays_invocation_decorator(ray_session):
    """If a Ray upgrade drops ``__ray_invocation_decorator__``, calls silently go
    back to the producer's own lease: this fails first."""
    p = Producer.remote()
    assert p.value._decorator is _caller_leases.decorate
    ray.kill(p)


def test_a_call_through_a_handle_leases_on_the_callers_token(ray_session):
    p = Producer.remote()
    ref = p.value.remote(1)
    assert float(rd.get(ref)[0]) == 1.0
    assert ray.get(p.claimed.remote()) == 1, "the producer took its own lease, not the caller's"
    del ref
    wait_for(lambda: ray.get(p.held.remote()) == 0, what="freed once the ref is gone")
    assert ray.get(p.claimed.remote()) == 0
    ray.kill(p)


def test_an_actors_objects_live_while_another_process_holds_them(ray_session):
    """Made by one actor, passed nested to another, dropped by the caller."""
    p, caller, holder = Producer.remote(), Caller.remote(), Holder.remote()
    ray.get(caller.hand_over.remote(p, holder))
    assert ray.get(holder.check.remote(3.0))
    assert ray.get(p.held.remote()) == 1
    ray.get(holder.drop.remote())
    wait_for(lambda: ray.get(p.held.remote()) == 0, what="freed after the holder dropped it")
    for a in (p, caller, holder):
        ray.kill(a)


def test_frees_reach_the_producer_when_the_caller_makes_no_more_calls(ray_session):
    """Nothing rides on a next call here: the caller sends its frees on its own."""
    p, caller = Producer.remote(), Caller.remote()
    ray.get(caller.make.remote(p, 5))
    assert ray.get(p.claimed.remote()) == 5
    ray.get(caller.drop.remote())
    wait_for(lambda: ray.get(p.held.remote()) == 0, what="freed without a next call")
    assert ray.get(caller.queued_frees.remote()) == 0
    ray.kill(p)
    ray.kill(caller)


def test_the_callers_death_frees_its_objects(ray_session):
    p, caller = Producer.remote(), Caller.remote()
    ray.get(caller.make.remote(p, 3))
    assert ray.get(p.held.remote()) == 3
    os.kill(ray.get(caller.pid.remote()), signal.SIGKILL)
    wait_for(lambda: ray.get(p.held.remote()) == 0, timeout=60, what="freed after its caller died")
    assert ray.get(p.claimed.remote()) == 0
    ray.kill(p)


def test_a_read_through_a_dead_callers_ref_is_refused_never_another_objects_bytes(
    ray_session,
):
    """A holder read an object once, so Ray keeps its Payload there; then the
    caller that owned the ref died, and the producer freed the object and made
    another in its memory. Ray still hands the holder the Payload: the read must
    fail, not return what lies at those addresses now (it did: another object's
    bytes, found by a randomised stress of leases)."""
    p, caller, holder = Producer.remote(), Caller.remote(), Holder.remote()
    ray.get(caller.hand_over.remote(p, holder))
    assert ray.get(holder.check.remote(3.0))
    os.kill(ray.get(caller.pid.remote()), signal.SIGKILL)
    wait_for(lambda: ray.get(p.held.remote()) == 0, timeout=60, what="freed after its caller died")
    later = [p.value.remote(9) for _ in range(4)]  # in the memory the freed one had
    assert [float(v[0]) for v in rd.get(later)] == [9.0] * 4
    with pytest.raises(rd.ProducerLostError, match="freed the object"):
        ray.get(holder.check.remote(3.0), timeout=60)
    del later
    ray.kill(p)
    ray.kill(holder)


def test_a_call_without_the_decorator_takes_the_producers_own_lease(ray_session):
    p = Producer.remote()
    [ref] = ray.get(p.own_call.remote())
    assert ray.get(p.claimed.remote()) == 0
    assert float(rd.get(ref)[0]) == 7.0
    del ref
    wait_for(lambda: ray.get(p.held.remote()) == 0, what="freed by the producer's lease")
    ray.kill(p)


def test_a_threaded_producer_frees_every_object(ray_session):
    """Its calls may run before the self-call that opens the pair: those take
    the producer's own lease; all are freed once dropped, none early."""
    p = Producer.options(max_concurrency=4).remote()
    refs = [p.value.remote(i) for i in range(40)]
    values = rd.get(refs)
    assert [float(v[0]) for v in values] == [float(i) for i in range(40)]
    assert ray.get(p.held.remote()) == 40
    del refs, values
    wait_for(lambda: ray.get(p.held.remote()) == 0, what="all freed")
    ray.kill(p)


def test_tokens_of_a_driver_are_caller_owned_memory_store_objects(ray_session):
    """The tokens are minted as task returns: no plasma object per transfer."""
    p = Producer.remote()
    ref = p.value.remote(1)
    ray.wait([ref])
    pair = next(iter(_caller_leases.caller_leases._pairs.values()))
    token = pair.tokens[0]
    ray.wait([token], fetch_local=False)
    found = ray.experimental.get_object_locations([token])
    assert not found[token]["node_ids"], "a token is a plasma object (has Ray changed?)"
    del ref
    ray.kill(p)


def test_a_method_waiting_for_a_free_is_not_blocked_by_it(pair):
    """The free of a dropped ref reaches a single-threaded producer busy in
    ``rd.wait_tensor_freed``: sent to its agent, not queued as a task behind it."""
    p, _ = pair
    ref = p.keep.remote("waited")
    rd.get(ref)
    waiting = p.wait_freed.remote("waited", 30)
    del ref
    assert ray.get(waiting) == "freed"


@pytest.mark.parametrize("ready_callback", ["from Ray", "refused"])
def test_a_free_carried_by_a_call_queued_behind_the_method_waiting_for_it_arrives(
    pair, monkeypatch, ready_callback
):
    """A trainer's step waits for its last weights to be freed, and the call for
    its next weights goes out at once: the free rides on that call, which runs
    only after the step. It reaches the producer's agent all the same; so it
    does where Ray refuses the callback that says when a call has run."""
    monkeypatch.setattr(_caller_leases, "_FLUSH_S", 600.0)  # it waits for a call to carry it
    if ready_callback == "refused":
        monkeypatch.setattr(_ray, "on_ready", _refused)
    p, _ = pair
    ref = p.keep.remote("stepped")
    rd.get(ref)
    before = _queued_frees()
    step = p.wait_freed.remote("stepped", 30)
    del ref
    wait_for(lambda: _queued_frees() > before, what="the free queued for the next call")
    after = p.keep.remote("after the step")
    assert _queued_frees() == 0, "the call did not carry the free"
    assert ray.get(step) == "freed"
    assert float(rd.get(after)[0]) == 0.0
    monkeypatch.undo()  # the frees still to come (this call's) flush as they do
    del after


def test_rays_ready_callback_is_there(ray_session):
    """Frees carried on a call are sent again when the call has not run soon
    (``_ray.on_ready``, Ray's private ``ObjectRef._on_ready``): this fails first
    if a Ray upgrade drops it."""
    ran = threading.Event()
    ref = ray.put(1)
    _ray.on_ready(ref, lambda error: ran.set() if error is None else None)
    assert ran.wait(30)


def _refused(ref, callback) -> None:
    raise AttributeError("'ObjectRef' object has no attribute '_on_ready'")


def _queued_frees() -> int:
    """Frees this process (the driver) holds for its next call or its flusher."""
    leases = _caller_leases.caller_leases
    with leases._lock:
        return sum(len(p.freed) for p in leases._pairs.values())


@ray.remote
class AsyncCaller:
    async def make(self, producer, n: int) -> None:
        self.refs = [producer.value.remote(i) for i in range(n)]

    async def drop(self) -> None:
        self.refs = []


def test_an_async_actors_calls_are_freed_when_it_drops_them(ray_session):
    p, caller = Producer.remote(), AsyncCaller.remote()
    ray.get(caller.make.remote(p, 3))
    wait_for(lambda: ray.get(p.held.remote()) == 3, what="three objects made")
    assert ray.get(p.claimed.remote()) == 3
    ray.get(caller.drop.remote())
    wait_for(lambda: ray.get(p.held.remote()) == 0, what="freed once the async caller dropped them")
    ray.kill(p)
    ray.kill(caller)


@ray.remote
class Taker:
    def __init__(self) -> None:
        self._gate = threading.Event()

    def wait_gate(self, timeout: float) -> bool:
        return self._gate.wait(timeout)

    def open_gate(self) -> None:
        self._gate.set()

    def first(self, value: torch.Tensor, _gate: bool) -> float:
        return float(value[0])


def test_a_pending_tasks_argument_keeps_the_object(ray_session):
    """The only ref is held by a task that cannot start yet: the caller's token
    stays in scope with it."""
    p, taker = Producer.remote(), Taker.options(max_concurrency=2).remote()
    gate = taker.wait_gate.remote(60)
    ref = p.value.remote(5)
    result = taker.first.remote(ref, gate)
    del ref
    wait_for(lambda: ray.get(p.claimed.remote()) == 1, what="the object made on a token")
    assert ray.get(p.held.remote()) == 1
    ray.get(taker.open_gate.remote())
    assert ray.get(result) == 5.0
    wait_for(lambda: ray.get(p.held.remote()) == 0, what="freed once the task ran")
    ray.kill(p)
    ray.kill(taker)


def test_a_restarted_producer_takes_its_own_leases(ray_session):
    """The pair was opened by the producer's first incarnation: the new one
    refuses the caller's tokens and leases on its own, and frees all the same."""
    p = Producer.options(max_restarts=1).remote()
    first = p.value.remote(1)
    assert float(rd.get(first)[0]) == 1.0
    del first
    os.kill(ray.get(p.pid.remote()), signal.SIGKILL)
    wait_for(lambda: _answers(p), timeout=60, what="the producer restarted")
    _on_the_producers_own_lease(p, 2)
    ray.kill(p)


def _answers(actor) -> bool:
    try:
        ray.get(actor.held.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
    return True


def test_an_actor_with_a_pending_calls_limit_keeps_every_place_for_its_caller(ray_session):
    """No mint may take one of a ``max_pending_calls`` limit's places: calls up to
    the limit are accepted, on the producer's own leases."""
    p = Producer.options(max_pending_calls=1).remote()
    _on_the_producers_own_lease(p, 6)
    ray.kill(p)


def _on_the_producers_own_lease(p, n: int) -> None:
    """``p.value(n)`` read through a handle, made on no token of the caller's, and
    freed (by the producer's own lease) once dropped."""
    ref = p.value.remote(n)
    assert float(rd.get(ref)[0]) == float(n)
    assert _asked(p.claimed) == 0
    del ref
    wait_for(lambda: _asked(p.held) == 0, what="freed by the producer's own lease")


def _asked(method: Any) -> Any:
    """``method.remote()``'s answer, asked again while Ray refuses the call under a
    ``max_pending_calls`` limit: it can count the last call pending a moment after
    its reply is in (CI's failures, on ``held`` and then on ``claimed``)."""

    def ask() -> tuple[Any] | None:  # a tuple: an answer of 0 still ends the wait
        try:
            return (ray.get(method.remote()),)
        except ray.exceptions.PendingCallsLimitExceeded:
            return None

    return wait_for(ask, what=f"{method} taken under the pending-calls limit")[0]
