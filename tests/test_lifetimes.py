"""Opt-in lifetimes (issue 41): ``@rd.method(reads=N, ttl=s)`` objects carry no
lease and are freed after their N-th read or at their ttl, refs or not; a read
after that gets ProducerLostError naming the lifetime, never stale bytes."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import pytest
import ray
import torch
from ray import cloudpickle

import raydirect as rd
from raydirect import _lifetime, _ray, _stream_server
from raydirect._payload import Payload, get_deferred

from helpers import wait_for

cloudpickle.register_pickle_by_value(sys.modules[__name__])

NUMEL = 1 << 18  # 1 MiB of float32: never inline
BIG_NUMEL = 1 << 24  # 64 MiB of float32: a tcp stream a deadline can cut short


def pattern(seed: int) -> torch.Tensor:
    return torch.arange(NUMEL, dtype=torch.float32) + seed


@ray.remote
class Stage:
    """Returns tensors under several lifetimes; reads others' objects."""

    def __init__(self) -> None:
        self.kept: list[Any] = []

    @rd.method(reads=1)
    def once(self, seed: int) -> torch.Tensor:
        return pattern(seed)

    @rd.method(reads=2)
    def twice(self, seed: int) -> dict[str, Any]:
        return {"w": pattern(seed), "b": pattern(seed + 1)[:1000].reshape(10, 100)}

    @rd.method(ttl=1.0)
    def briefly(self, seed: int) -> torch.Tensor:
        return pattern(seed)

    @rd.method(reads=1, ttl=600, tensor_transport="tcp")
    def once_tcp(self, seed: int) -> torch.Tensor:
        return pattern(seed)

    @rd.method(reads=1, ttl=600, tensor_transport="tcp")
    def once_tcp_big(self, seed: int) -> torch.Tensor:
        return torch.full((BIG_NUMEL,), float(seed))

    @rd.method(reads=1, ttl=600)
    def once_or_in_ten_minutes(self, seed: int) -> torch.Tensor:
        return pattern(seed)

    @rd.method(reads=1, tensor_transport="shm")
    def once_shm(self, seed: int) -> torch.Tensor:
        return pattern(seed)

    @ray.method(num_returns=2)
    @rd.method(reads=1)
    def two_once(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return pattern(seed), pattern(seed + 7)

    @rd.method(reads=1)
    def transposed(self, seed: int) -> torch.Tensor:
        return pattern(seed).reshape(512, 512).t()  # packed once at export

    @rd.method(ttl=0.005)
    def fleeting(self, seed: int) -> torch.Tensor:
        self.kept = [pattern(-1) for _ in range(4)]  # fresh memory where the last ones lay
        return pattern(seed)

    def race(self, producer: Any, rounds: int, transport: str | None) -> dict[str, int]:
        """Read objects freed about as soon as they are made: each read returns
        the exact bytes or raises ProducerLostError, never other bytes."""
        seen = {"exact": 0, "lost": 0, "wrong": 0}
        for seed in range(rounds):
            ref = producer.fleeting.remote(seed)
            try:
                got = rd.get(ref, tensor_transport=transport, timeout=30)
            except rd.ProducerLostError:
                seen["lost"] += 1
                continue
            seen["exact" if torch.equal(got, pattern(seed)) else "wrong"] += 1
        return seen

    def read(self, refs: list[ray.ObjectRef], transport: str | None = None) -> Any:
        return rd.get(refs[0], tensor_transport=transport, timeout=30)

    def read_error(self, refs: list[ray.ObjectRef], transport: str | None = None) -> str:
        try:
            rd.get(refs[0], tensor_transport=transport, timeout=30)
        except rd.ProducerLostError as exc:
            return str(exc)
        return "no error"

    def held(self) -> int:
        return rd.local_stats().num_objects

    def deadlines(self) -> int:
        return len(_lifetime.lifetimes._deadlines)


@pytest.fixture(scope="module")
def stages(ray_session):
    producer, consumer = Stage.remote(), Stage.remote()
    yield producer, consumer
    ray.kill(producer)
    ray.kill(consumer)


def held(actor: Any) -> int:
    return ray.get(actor.held.remote())


def test_no_lease_behind_the_object(ray_session):
    producer = Stage.remote()  # its own: it keeps the object it makes
    ref = producer.once.remote(1)
    [pending] = get_deferred([ref], 30)  # the Payload itself, unread
    payload = pending.payload
    assert isinstance(payload, Payload)
    assert payload.lease is None
    del pending, payload, ref  # dropped unread: no lease tells the producer
    assert held(producer) == 1  # reads=1 without ttl= waits for its read
    ray.kill(producer)


def test_freed_after_its_one_read_while_the_ref_lives(stages):
    producer, consumer = stages
    wait_for(lambda: held(producer) == 0, what="empty store")
    ref = producer.once.remote(3)
    assert torch.equal(ray.get(consumer.read.remote([ref])), pattern(3))
    wait_for(lambda: held(producer) == 0, what="freed after its read")
    error = ray.get(consumer.read_error.remote([ref]))
    assert "reads=1" in error and "lifetime" in error, error


def test_read_by_two_consumers_then_freed(stages):
    producer, consumer = stages
    wait_for(lambda: held(producer) == 0, what="empty store")
    ref = producer.twice.remote(5)
    first = ray.get(consumer.read.remote([ref]))
    assert torch.equal(first["w"], pattern(5))
    assert held(producer) == 1  # one read of two
    second = rd.get(ref, timeout=30)  # the driver is the second reader
    assert torch.equal(second["b"], pattern(6)[:1000].reshape(10, 100))
    wait_for(lambda: held(producer) == 0, what="freed after its second read")
    with pytest.raises(rd.ProducerLostError, match="reads=2"):
        rd.get(ref, timeout=30)


def test_freed_at_its_ttl_unread(stages):
    producer, consumer = stages
    wait_for(lambda: held(producer) == 0, what="empty store")
    ref = producer.briefly.remote(9)
    ray.wait([ref])
    wait_for(lambda: held(producer) == 0, timeout=30, what="freed at its ttl")
    error = ray.get(consumer.read_error.remote([ref]))
    assert "ttl=1" in error, error


def test_a_shorter_ttl_made_later_ends_at_its_own_deadline(stages):
    # The clock is woken only by an export whose deadline comes first: one that
    # sleeps until a ten-minute deadline must still free a one-second object.
    producer, consumer = stages
    wait_for(lambda: held(producer) == 0, what="empty store")
    long_lived = producer.once_or_in_ten_minutes.remote(3)
    ray.wait([long_lived])
    brief = producer.briefly.remote(4)
    ray.wait([brief])
    wait_for(lambda: held(producer) == 1, timeout=30, what="the one-second object freed")
    assert "ttl=1" in ray.get(consumer.read_error.remote([brief]))
    assert torch.equal(ray.get(consumer.read.remote([long_lived])), pattern(3))
    wait_for(lambda: held(producer) == 0, what="the other freed by its read")


def test_objects_read_long_before_their_ttl_leave_no_deadline_behind(stages):
    # Freed by its read, an object's ttl deadline stayed in the clock's heap
    # until the ttl passed: a ttl of minutes at a high rate piled them up.
    producer, _ = stages
    wait_for(lambda: held(producer) == 0, what="empty store")
    for seed in range(300):
        ref = producer.once_or_in_ten_minutes.remote(seed)
        assert torch.equal(rd.get(ref, timeout=30), pattern(seed))
    wait_for(lambda: held(producer) == 0, what="each freed after its read")
    assert ray.get(producer.deadlines.remote()) <= 64


@pytest.mark.parametrize("method", ["once_tcp", "once_shm"])
def test_reads_the_agent_serves_count_too(stages, method):
    producer, consumer = stages
    wait_for(lambda: held(producer) == 0, what="empty store")
    ref = getattr(producer, method).remote(11)
    assert torch.equal(ray.get(consumer.read.remote([ref])), pattern(11))
    wait_for(lambda: held(producer) == 0, what="freed after its read")
    error = ray.get(consumer.read_error.remote([ref]))
    assert "reads=1" in error, error  # the agent's refusal names the lifetime


def stream_tickets(producer: Any) -> tuple[int, int]:
    """The producer's stream server: tickets issued so far, and those not ended."""
    server = lambda _self: (_stream_server.running().issued, _stream_server.running().pending())  # noqa: E731
    return ray.get(_ray.run_in_actor(producer, server))


def test_a_tcp_read_cut_short_uses_up_no_read(stages):
    """A reads=1 object whose tcp stream fails midway (here the reader's deadline)
    is not freed by it: the count waits for the last byte, so reading it again
    gets the bytes. Counted when the ticket was issued, it was freed unread."""
    producer, _ = stages
    wait_for(lambda: held(producer) == 0, what="empty store")
    timeout, unsent = 0.002, []
    for _ in range(60):  # fresh objects, until a read's deadline fell mid-stream
        ref = producer.once_tcp_big.remote(3)
        ray.wait([ref])
        issued, _ = stream_tickets(producer)
        try:
            rd.get(ref, timeout=timeout, tensor_transport="tcp")
            timeout *= 0.7  # read whole in time: cut the next one shorter
            continue
        except ray.exceptions.GetTimeoutError:
            pass
        # Every ticket ended (sent, dropped when sending failed, or unclaimed):
        # what this read started is over on the producer's side too.
        wait_for(lambda: stream_tickets(producer)[1] == 0, timeout=30, what="tickets ended")
        if stream_tickets(producer)[0] == issued:  # given up before the producer answered
            unsent.append(ref)
            timeout *= 1.5
            continue
        try:
            got = rd.get(ref, timeout=60, tensor_transport="tcp")
        except rd.ProducerLostError:  # its deadline fell after the last byte left
            continue
        assert torch.equal(got, torch.full((BIG_NUMEL,), 3.0))
        break
    else:
        pytest.fail("no read cut short midway left its object to read again")
    for ref in unsent:  # the producer may still hold some, their read never counted
        with contextlib.suppress(rd.ProducerLostError):
            rd.get(ref, timeout=60, tensor_transport="tcp")
    wait_for(lambda: held(producer) == 0, what="each freed by the read that arrived")


@pytest.mark.parametrize("forced", ["tcp", "shm"])
def test_a_consumer_may_force_another_guarded_transport(stages, forced):
    producer, consumer = stages
    ref = producer.once.remote(13)
    assert torch.equal(ray.get(consumer.read.remote([ref], forced)), pattern(13))
    wait_for(lambda: held(producer) == 0, what="freed after its read")


def test_each_return_has_its_own_lifetime(stages):
    producer, consumer = stages
    wait_for(lambda: held(producer) == 0, what="empty store")
    a, b = producer.two_once.remote(20)
    assert torch.equal(ray.get(consumer.read.remote([a])), pattern(20))
    wait_for(lambda: held(producer) == 1, what="the read one freed")
    assert torch.equal(rd.get(b, timeout=30), pattern(27))
    wait_for(lambda: held(producer) == 0, what="both freed")


def test_a_non_contiguous_return_reads_exact(stages):
    producer, consumer = stages
    ref = producer.transposed.remote(30)
    got = ray.get(consumer.read.remote([ref]))
    assert torch.equal(got, pattern(30).reshape(512, 512).t())


@pytest.mark.parametrize("transport", [None, "tcp", "shm"])
def test_reads_racing_the_ttl_get_exact_bytes_or_an_error(stages, transport):
    producer, consumer = stages
    seen = ray.get(consumer.race.remote(producer, 40, transport))
    assert seen["wrong"] == 0, seen
    assert seen["exact"] + seen["lost"] == 40, seen
    wait_for(lambda: held(producer) == 0, what="every one freed")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"reads": 0}, ValueError, "at least 1"),
        ({"reads": True}, TypeError, "whole number"),
        ({"reads": 1.5}, TypeError, "whole number"),
        ({"ttl": 0}, ValueError, "positive"),
        ({"ttl": float("inf")}, ValueError, "finite"),
        ({"ttl": "5"}, TypeError, "seconds"),
        ({"reads": 1, "tensor_transport": "nccl"}, ValueError, "drop reads=/ttl="),
        ({"ttl": 5, "tensor_transport": "gloo"}, ValueError, "cma, cuda_ipc, nixl, shm, tcp"),
    ],
)
def test_bad_lifetimes_are_refused_at_decoration(kwargs, error, match):
    with pytest.raises(error, match=match):
        rd.method(**kwargs)


@pytest.mark.parametrize("transport", ["cuda_ipc", "nixl"])
def test_one_sided_transports_that_check_the_seal_carry_lifetimes(transport):
    """Their reads check the object's seal after their copies (CUDA memory too):
    tests/gpu and tests/test_nixl.py read such objects."""
    rd.method(reads=1, ttl=30, tensor_transport=transport)  # not refused
